"""Device kernels composed of other tpu ops, for ops whose result no lowering can give.

``equal`` returns a Python bool (one host read), and ``rrelu_with_noise`` writes its ``noise``
argument but returns a new tensor, a shape the in-place / ``out=`` machinery does not take. Each
is built, like a decomposition, from ops that do have lowerings; they live here, not in
``lowering/``, because they touch tensors.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def equal(x: torch.Tensor, y: torch.Tensor) -> bool:
    if x.shape != y.shape:
        return False
    return bool(torch.eq(x, y).all().item())


def rrelu_with_noise(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    # The functional op and a copy into noise, so the noise that backward reads is the one drawn.
    out, drawn = aten.rrelu_with_noise_functional(x, noise, lower, upper, training,
                                                  generator=generator)
    if training:
        noise.copy_(drawn)
    return out


def rrelu_with_noise_(x, noise, lower=0.125, upper=1 / 3, training=False, generator=None):
    return x.copy_(rrelu_with_noise(x, noise, lower, upper, training, generator))


def register(lib: torch.library.Library) -> None:
    lib.impl(aten.equal.default, equal, "PrivateUse1")
    lib.impl(aten.rrelu_with_noise.default, rrelu_with_noise, "PrivateUse1")
    lib.impl(aten.rrelu_with_noise_.default, rrelu_with_noise_, "PrivateUse1")
