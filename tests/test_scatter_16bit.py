"""Writes into 16-bit float tensors (index_copy_, index_put_, scatter_) on XLA:CPU: the values
CPU's torch writes, bit for bit (NaN, -0.0 and infinities included), and a program that does not
convert the whole destination to f32 and back (XLA:CPU's way with a bf16/f16 scatter, which cost
a vLLM step 1.7 s on a 512 MiB KV cache; ``lowering/index.py``, ``set_at``)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchtpu.lowering import scatter as lowering

ROWS, WIDTH = 1 << 15, 64


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_writes_equal_cpu_bit_for_bit(dtype):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(16, 8, generator=gen).to(dtype)
    src = torch.randn(3, 8, generator=gen).to(dtype)
    src[0, :3] = torch.tensor([float("nan"), -0.0, float("inf")])
    rows = torch.tensor([5, 0, 11])
    cols = torch.randint(0, 8, (16, 8), generator=gen)

    def writes(t, s, r, c):
        return [t.clone().index_copy_(0, r, s),
                t.clone().index_put_((r,), s),
                t.clone().scatter_(1, c, t.flip(0)),
                t.clone().scatter_(1, c, -0.0)]

    cpu = writes(x, src, rows, cols)
    tpu = writes(x.to("tpu"), src.to("tpu"), rows.to("tpu"), cols.to("tpu"))
    for want, got in zip(cpu, tpu):
        assert got.dtype == dtype
        assert torch.equal(got.cpu().view(torch.int16), want.view(torch.int16))


def test_a_row_write_does_not_convert_the_whole_destination():
    cache = jnp.zeros((ROWS, WIDTH), jnp.bfloat16)
    rows = jnp.array([3, 7], jnp.int64)
    new = jnp.ones((2, WIDTH), jnp.bfloat16)
    text = jax.jit(lowering.index_copy, static_argnums=1).lower(cache, 0, rows, new).compile(
    ).as_text()
    assert f"f32[{ROWS},{WIDTH}]" not in text
    out = np.asarray(jax.jit(lowering.index_copy, static_argnums=1)(cache, 0, rows, new))
    assert (out[[3, 7]] == 1).all() and out.sum() == 2 * WIDTH
