"""ATen op -> JAX lowerings, one module per op family; importing this fills the table."""

from torchtpu.lowering import (  # noqa: F401
    attention,
    conv,
    elementwise,
    factory,
    fft,
    histogram,
    index,
    layers,
    linalg,
    nn,
    optim,
    quant,
    random,
    reduction,
    rnn,
    sampling,
    shape,
    special,
    transformer,
    upsample,
)
