"""SDPA's fused op through JAX's Pallas splash kernel where it is lowered for a TPU
(``lowering/attention_tpu.py``): the rule that picks it, its numerics against CPU (through the
Pallas interpreter), and that a TPU lowering holds the kernel while a CPU lowering does not."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchtpu  # noqa: F401
from torchtpu.lowering import attention, attention_tpu
from torchtpu.testing.compare import assert_same

N, H, L, D = 1, 2, 1024, 128


def _qkv(dtype=jnp.bfloat16, shape=(N, H, L, D)):
    keys = jax.random.split(jax.random.key(0), 4)
    return [jax.random.normal(k, shape, jnp.float32).astype(dtype) for k in keys]


def _torch(x):
    return torch.tensor(np.asarray(x.astype(jnp.float32)))


@pytest.mark.parametrize("change, applies", [
    ({}, True),
    ({"is_causal": False}, False),
    ({"dropout_p": 0.1}, False),
    ({"attn_bias": jnp.zeros((L, L), jnp.bfloat16)}, False),
    ({"dtype": jnp.float32}, False),            # not measured: XLA's form
    ({"dtype": jnp.float16}, True),
    ({"shape": (N, H, 512, D)}, False),         # below 1024 positions
    ({"shape": (N, H, 1536, D)}, True),
    ({"shape": (N, H, 1280, D)}, False),        # not a multiple of the 512 block
    ({"shape": (N, H, L, 64)}, False),          # head_dim not a multiple of 128
])
def test_the_rule(change, applies):
    change = dict(change)
    q, k, v, _ = _qkv(change.pop("dtype", jnp.bfloat16), change.pop("shape", (N, H, L, D)))
    call = {"attn_bias": None, "dropout_p": 0.0, "is_causal": True} | change
    assert attention_tpu.applies(q, k, v, **call) is applies


def test_splash_forward_and_backward_against_cpu():
    """The kernel run by the Pallas interpreter: out, lse and the three gradients against CPU's
    SDPA of the same bfloat16 values in float32 (bf16 rounding of the kernel's operands: ~1e-2
    of values of ~3)."""
    q, k, v, g = _qkv()
    scale = D ** -0.5
    out, lse = attention_tpu.forward(q, k, v, scale, interpret=True)
    dq, dk, dv = attention_tpu.backward(q, k, v, out, lse, g, scale, interpret=True)
    tq, tk, tv = (_torch(x).requires_grad_() for x in (q, k, v))
    ref = F.scaled_dot_product_attention(tq, tk, tv, is_causal=True)
    ref.backward(_torch(g))
    s = (tq @ tk.transpose(-1, -2) * scale).masked_fill(~torch.ones(L, L).bool().tril(), -1e30)
    for got, want in ((out, ref), (lse, torch.logsumexp(s, -1)), (dq, tq.grad), (dk, tk.grad),
                      (dv, tv.grad)):
        assert got.dtype == (jnp.float32 if got is lse else jnp.bfloat16)
        torch.testing.assert_close(_torch(got), want.detach(), atol=3e-2, rtol=2e-2)


def _lowered_text(fn, args, platform: str) -> str:
    return jax.jit(fn).trace(*args).lower(lowering_platforms=(platform,)).as_text()


def test_a_tpu_lowering_holds_the_kernel_and_a_cpu_lowering_does_not():
    q, k, v, g = _qkv()
    key = jax.random.key(0)

    def forward(q, k, v):
        return attention.sdpa_forward(key, q, k, v, is_causal=True)[:2]

    def backward(g, q, k, v, out, lse):
        return attention.sdpa_backward(g, q, k, v, None, [True, True, True, False], out, lse,
                                       None, None, L, L, 0.0, True, None, None)[:3]

    out, lse = forward(q, k, v)
    for fn, args in ((forward, (q, k, v)), (backward, (g, q, k, v, out, lse))):
        assert "tpu_custom_call" in _lowered_text(fn, args, "tpu")
        assert "tpu_custom_call" not in _lowered_text(fn, args, "cpu")
    # Not causal: XLA's form on a TPU too.
    assert "tpu_custom_call" not in _lowered_text(
        lambda q, k, v: attention.sdpa_forward(key, q, k, v)[:2], (q, k, v), "tpu")


def test_bf16_causal_attention_on_the_device_against_cpu():
    """Where the rule applies, the program holds both forms and XLA:CPU runs XLA's: forward and
    gradients of bf16 inputs against CPU's SDPA of the same values in float32."""
    q, k, v = (torch.randn(1, 2, L, D, dtype=torch.bfloat16, generator=torch.Generator()
                           .manual_seed(i)) for i in range(3))

    def run(device, dtype):
        xs = [x.to(device, dtype).requires_grad_() for x in (q, k, v)]
        out = F.scaled_dot_product_attention(*xs, is_causal=True)
        (out.float() * out.float()).sum().backward()
        return [t.float() for t in [out] + [x.grad for x in xs]]

    got = run("tpu", torch.bfloat16)
    assert_same(got, run("cpu", torch.float32), atol=3e-2, rtol=3e-2)
