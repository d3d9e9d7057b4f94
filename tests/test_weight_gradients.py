"""A linear layer's weight gradient, ``mm(g.t(), x)`` over every token, is lowered for a TPU as a
product contracting (blocks, rows) of the tokens, as JAX's autodiff contracts a 3-D activation's
(batch, sequence): contracted as one long dim, the TPU compiler laid the Llama step's residual
stream and its gradient out column-major and its head's input gradient took 11.8 M estimated
cycles on v5e instead of 6.1 (bench/RESULTS.md, whole7). Other products, and every product on
XLA:CPU (no half-precision product over two contracted dims there), keep one contracted dim."""

import re

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchtpu.lowering import linalg, registry

MM = registry.TABLE[torch.ops.aten.mm.default].fn


def _contractions(x_shape: tuple, y_shape: tuple, platform: str) -> list:
    """The contracted dims of each dot_general in mm's lowering for the platform."""
    args = [jax.ShapeDtypeStruct(s, jnp.bfloat16) for s in (x_shape, y_shape)]
    text = jax.jit(MM).trace(*args).lower(lowering_platforms=(platform,)).as_text()
    return re.findall(r"contracting_dims = \[([\d, ]*)\] x \[([\d, ]*)\]", text)


@pytest.mark.parametrize("x_shape,y_shape", [
    ((256, 2048), (2048, 128)),  # (out, tokens) x (tokens, in): the tokens longer than both
    ((256, 8192), (8192, 128)),
    ((8192, 32768), (32768, 1024)),  # a head's input gradient: its vocab contracted so too
])
def test_a_weight_gradient_contracts_the_tokens_in_blocks_on_a_tpu(x_shape, y_shape):
    assert _contractions(x_shape, y_shape, "tpu") == [("1, 2", "0, 1")]
    assert _contractions(x_shape, y_shape, "cpu") == [("1", "0")]


@pytest.mark.parametrize("x_shape,y_shape", [
    ((2048, 256), (256, 128)),     # a forward product: the contraction is the width
    ((8192, 2048), (2048, 1024)),  # a head's weight gradient (vocab x tokens x width)
    ((256, 1000), (1000, 128)),    # tokens in no whole number of blocks
])
def test_other_products_keep_one_contracted_dim(x_shape, y_shape):
    assert _contractions(x_shape, y_shape, "tpu") == [("1", "0")]


def test_the_blocked_contraction_is_the_product():
    # The TPU's form run here in float32 (XLA:CPU has it for float32): the same product.
    g = np.random.default_rng(0).standard_normal((3072, 64), np.float32)
    x = np.random.default_rng(1).standard_normal((3072, 32), np.float32)
    got = np.asarray(linalg._rows_in_blocks(jnp.asarray(g.T), jnp.asarray(x)))
    np.testing.assert_allclose(got, g.T @ x, rtol=1e-4, atol=1e-3)


def test_a_linear_weight_gradient_over_many_tokens_matches_cpu():
    torch.manual_seed(0)
    x, w = torch.randn(2, 1024, 64), torch.randn(32, 64)
    grads = []
    for device in ("cpu", "tpu"):
        wd = w.detach().to(device).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            y = torch.nn.functional.linear(x.to(device), wd)
        y.float().square().sum().backward()
        grads.append(wd.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], rtol=2e-2, atol=2e-1)
