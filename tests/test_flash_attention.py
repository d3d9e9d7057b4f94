"""The flash form of attention on tpu (aten._flash_attention_forward/backward, dense and varlen)
against SDPA's math per sequence on CPU (torchtpu/testing/flash.py; CPU has no flash kernel)."""

import pytest
import torch
from torch.nn.attention.varlen import varlen_attn

import torchtpu  # noqa: F401
from torchtpu.testing.compare import assert_same, to_device
from torchtpu.testing.flash import reference

aten = torch.ops.aten
FORWARD = aten._flash_attention_forward.default
BACKWARD = aten._flash_attention_backward.default

# Three packed sequences of unequal lengths (keys longer than queries in the first) and a
# trailing token outside every sequence; K/V with half the query heads.
CUM_Q = torch.tensor([0, 3, 8, 9], dtype=torch.int32)
CUM_K = torch.tensor([0, 4, 9, 11], dtype=torch.int32)


def _inputs(dense: bool, heads=4, kv_heads=2, e=8, dtype=torch.float32):
    torch.manual_seed(0)
    q_len, k_len = ((2, 5), (2, 7)) if dense else ((10,), (11,))
    return (torch.randn(*q_len, heads, e, dtype=dtype),
            *(torch.randn(*k_len, kv_heads, e, dtype=dtype) for _ in "kv"))


CASES = {
    # dense (B, L, H, E) with L < S: causal (bottom-right) with a left window
    "dense-causal-window": (True, dict(is_causal=True, window_size_left=2)),
    # varlen (T, H, E) with cum_seq_q/k: a two-sided window (plain causal, TorchTitan's case,
    # runs through varlen_attn below)
    "varlen-window": (False, dict(window_size_left=1, window_size_right=1)),
}


@pytest.mark.parametrize("case", CASES)
def test_flash_forward_and_backward_match_sdpa_per_sequence(case):
    dense, options = CASES[case]
    q, k, v = _inputs(dense)
    cum_q, cum_k = (None, None) if dense else (CUM_Q, CUM_K)
    max_q, max_k = (5, 7) if dense else (5, 5)
    causal = options.get("is_causal", False)
    window = options.get("window_size_left"), options.get("window_size_right")
    args = (cum_q, cum_k, max_q, max_k, 0.0, causal)
    windows = dict(window_size_left=window[0], window_size_right=window[1])

    out, lse, rng, unused, _ = FORWARD(*to_device((q, k, v, *args[:2]), "tpu"), *args[2:], False,
                                       **windows)
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, expected_lse = reference(*inputs, cum_q, cum_k, causal, None, *window)
    assert_same(out, expected, atol=1e-5, rtol=1e-5)
    assert_same(lse, expected_lse, atol=1e-5, rtol=1e-5)

    grad = torch.randn_like(expected)
    grads = BACKWARD(*to_device((grad, q, k, v), "tpu"), out, lse,
                     *to_device(args[:2], "tpu"), *args[2:], rng, unused, **windows)
    assert_same(grads, torch.autograd.grad(expected, inputs, grad), atol=1e-5, rtol=1e-5)


def _causal_varlen(q, k, v, cum):
    return varlen_attn(q, k, v, cum, cum, 5, 5, window_size=(-1, 0))


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.full)],
                         ids=["eager", "compiled"])
def test_varlen_attn_trains_in_bfloat16_like_cpu(compiled):
    """PyTorch's varlen_attn (TorchTitan's varlen backend) end to end, with autograd; compiled,
    the graphs hold its custom ops (torch_attn::_varlen_attn and its backward) whole."""
    q, k, v = (t.to(torch.bfloat16) for t in _inputs(False, kv_heads=4))
    inputs = [t.to("tpu").requires_grad_() for t in (q, k, v)]
    attention = torch.compile(_causal_varlen, backend="tpu") if compiled else _causal_varlen
    out = attention(*inputs, CUM_Q.to("tpu"))
    out.float().square().sum().backward()

    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    expected, _ = reference(*cpu, CUM_Q, CUM_Q, True)
    expected.float().square().sum().backward()
    assert_same(out, expected, atol=1e-2, rtol=1e-2)
    assert_same([t.grad for t in inputs], [t.grad for t in cpu], atol=3e-2, rtol=3e-2)


def test_flash_dropout_is_refused_with_a_pointer_to_sdpa():
    q, k, v = to_device(_inputs(True), "tpu")
    with pytest.raises(NotImplementedError, match="torchtpu.unsupported: .*dropout_p > 0"):
        FORWARD(q, k, v, None, None, 5, 7, 0.1, False, False)
