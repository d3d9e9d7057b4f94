"""A half-precision product with many more columns than its contraction (a vocabulary head) reads
its rows from behind an optimization barrier: the TPU compiler otherwise fuses their computation
(the final norm, the cast to bf16) into the product and recomputes it for every block of columns,
which cost the Llama step's head 10.2 M estimated cycles on v5e at 4 x 2048 tokens instead of 4.7
(bench/RESULTS.md, whole11). Other products have no barrier; the values are the table's."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchtpu.lowering import registry

MM = registry.TABLE[torch.ops.aten.mm.default].fn


def _barriers(x_shape: tuple, y_shape: tuple, dtype=jnp.bfloat16) -> int:
    args = [jax.ShapeDtypeStruct(s, dtype) for s in (x_shape, y_shape)]
    text = jax.jit(MM).trace(*args).lower(lowering_platforms=("tpu",)).as_text()
    return text.count("optimization_barrier")


def test_a_head_reads_its_rows_behind_a_barrier():
    assert _barriers((8192, 1024), (1024, 32768)) == 1
    assert _barriers((16, 64), (64, 1024), jnp.float16) == 1


@pytest.mark.parametrize("x_shape,y_shape,dtype", [
    ((8192, 1024), (1024, 2816), jnp.bfloat16),   # an MLP's up projection
    ((8192, 1024), (1024, 1024), jnp.bfloat16),   # attention's projections
    ((8192, 2816), (2816, 1024), jnp.bfloat16),   # the MLP's down projection
    ((1024, 8192), (8192, 32768), jnp.bfloat16),  # a weight gradient's shapes: the tokens long
    ((8192, 1024), (1024, 32768), jnp.float32),   # float32: no rows cast in the product
])
def test_other_products_have_no_barrier(x_shape, y_shape, dtype):
    assert _barriers(x_shape, y_shape, dtype) == 0


def test_a_head_under_autocast_matches_cpu():
    torch.manual_seed(0)
    x, w = torch.randn(48, 32), torch.randn(1024, 32) * 0.1
    norm = torch.nn.RMSNorm(32)
    out = {}
    for device in ("cpu", "tpu"):
        wd = w.detach().to(device).requires_grad_()
        xd = x.detach().to(device).requires_grad_()
        with torch.autocast(device, dtype=torch.bfloat16):
            logits = torch.nn.functional.linear(norm.to(device)(xd), wd)
        logits.float().logsumexp(-1).sum().backward()
        out[device] = [t.detach().cpu().float() for t in (logits, wd.grad, xd.grad)]
    for got, want in zip(out["tpu"], out["cpu"]):
        np.testing.assert_allclose(got.numpy(), want.numpy(), rtol=2e-2, atol=2e-2)
