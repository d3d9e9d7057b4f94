"""Fused SDPA on tpu (torchtpu/lowering/attention.py) against CPU: values, gradients, routing."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import torchtpu
from torchtpu.compile import backend
from torchtpu.testing.compare import assert_same, to_device

aten = torch.ops.aten
FUSED = aten._scaled_dot_product_fused_attention_overrideable.default
FUSED_BACKWARD = aten._scaled_dot_product_fused_attention_overrideable_backward.default
sdpa = F.scaled_dot_product_attention


class _OpLog(TorchDispatchMode):
    """The ATen ops that reach the device, in order."""

    def __init__(self) -> None:
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _qkv(n=2, h=2, L=4, S=6, e=8, ev=None, dtype=torch.float32):
    return [torch.randn(n, h, length, d, dtype=dtype, requires_grad=True)
            for length, d in ((L, e), (S, e), (S, ev or e))]


def _run(fn, inputs, device, log=True):
    """fn's output, the gradients of (out * out).sum() for each input that requires grad, and
    the ATen ops that ran (none logged for a compiled fn: Dynamo would not compile under a mode).
    """
    inputs = to_device(inputs, device) if device != "cpu" else inputs
    with _OpLog() if log else contextlib.nullcontext() as ops:
        out = fn(*inputs)
        out.square().sum().backward()
    grads = [x.grad for x in inputs if x.requires_grad]
    return out, grads, ops.ops if log else []


def _check(fn, inputs, *, fused=True, atol=1e-5, rtol=1e-5, reference=None):
    out, grads, ops = _run(fn, inputs, "tpu")
    expected, expected_grads, _ = _run(reference or fn, inputs, "cpu")
    assert_same(out, expected, atol=atol, rtol=rtol)
    assert_same(grads, expected_grads, atol=atol, rtol=rtol)
    if fused:
        assert FUSED in ops and FUSED_BACKWARD in ops
        assert aten.bmm.default not in ops and aten._safe_softmax.default not in ops
    else:
        assert FUSED not in ops
    return ops


CASES = {
    "causal": (lambda q, k, v: sdpa(q, k, v, is_causal=True), dict(S=4)),
    "causal_L_ne_S": (lambda q, k, v: sdpa(q, k, v, is_causal=True), dict(L=6, S=4)),
    "plain_L_ne_S": (lambda q, k, v: sdpa(q, k, v), dict()),
    "scale_head_dim_12": (lambda q, k, v: sdpa(q, k, v, scale=0.3), dict(e=12, ev=5)),
}


@pytest.mark.parametrize("case", CASES)
def test_fused_matches_cpu(case):
    fn, shape = CASES[case]
    _check(fn, _qkv(**shape))


def test_float_mask_and_its_gradient():
    mask = torch.randn(2, 1, 4, 6, requires_grad=True)  # broadcast over heads
    _check(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), [*_qkv(), mask])


def test_bool_mask():
    mask = torch.rand(4, 6) > 0.4
    mask[:, 0] = True
    _check(lambda q, k, v: sdpa(q, k, v, attn_mask=mask.to(q.device)), _qkv())


def test_fully_masked_row_gives_what_the_math_path_gives():
    mask = torch.rand(4, 6) > 0.4
    mask[:, 0] = True
    mask[2] = False

    def math(q, k, v):  # SDPA's math path, which gets bool masks as 0 / -inf
        additive = torch.zeros(mask.shape).masked_fill(~mask, float("-inf"))
        return aten._scaled_dot_product_attention_math(q, k, v, additive)[0]

    _check(lambda q, k, v: sdpa(q, k, v, attn_mask=mask.to(q.device)), _qkv(), reference=math)


def test_bfloat16():
    _check(lambda q, k, v: sdpa(q, k, v, is_causal=True), _qkv(dtype=torch.bfloat16),
           atol=2e-2, rtol=2e-2)


def test_gqa_takes_the_math_path():
    q, k, v = _qkv(h=4)[0], *_qkv(h=2)[1:]
    _check(lambda q, k, v: sdpa(q, k, v, enable_gqa=True), [q, k, v], fused=False)


def test_float64_takes_the_math_path_at_full_precision():
    _check(lambda q, k, v: sdpa(q, k, v, is_causal=True), _qkv(dtype=torch.float64),
           fused=False, atol=1e-12, rtol=1e-12)


def test_dropout_takes_the_math_path_without_fallback():
    q, k, v = to_device(_qkv(L=32, S=32))
    v = torch.ones_like(v, requires_grad=True)
    before = torchtpu.metrics.snapshot()["cpu_fallbacks"]
    with _OpLog() as log:
        out = sdpa(q, k, v, dropout_p=0.5)
        out.sum().backward()
    assert FUSED not in log.ops and aten.bmm.default in log.ops
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == before
    # With v = 1 each output is (kept probability mass) / (1 - p): 2 when all kept, 0 when none;
    # dropout must have dropped some but not all of it.
    row = out[..., 0].cpu()
    assert torch.isfinite(row).all() and row.min() < 1.5 and row.max() > 0.5
    assert all(torch.isfinite(x.grad.cpu()).all() for x in (q, k, v))


def test_choice_kernel():
    q, k, v = (x.detach() for x in to_device(_qkv(S=4)))
    assert aten._fused_sdp_choice(q, k, v) == int(torch._C._SDPBackend.OVERRIDEABLE)
    assert aten._fused_sdp_choice(q, k, v, None, 0.1) == int(torch._C._SDPBackend.MATH)
    assert aten._fused_sdp_choice(q[0], k[0], v[0]) == int(torch._C._SDPBackend.MATH)


def test_inference_mode_is_fused():
    q, k, v = (x.detach() for x in _qkv())
    dq, dk, dv = to_device([q, k, v])
    with torch.inference_mode(), _OpLog() as log:
        out = sdpa(dq, dk, dv, is_causal=True)
    # The device's SDPA kernel takes the call whole (the math path would show its pieces here).
    assert log.ops == [aten.scaled_dot_product_attention.default]
    assert_same(out, sdpa(q, k, v, is_causal=True), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mode", [torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
                                  torch.tpu.EagerMode.DEFER_AND_FUSE])
def test_eager_modes(mode):
    with torch.tpu.set_eager_mode(mode):
        _check(lambda q, k, v: sdpa(q, k, v, is_causal=True), _qkv(S=4))


def test_autocast_runs_fused_in_bfloat16():
    q, k, v = (x.detach() for x in to_device(_qkv()))
    with torch.autocast("tpu"), _OpLog() as log:
        out = sdpa(q, k, v)
    assert FUSED in log.ops and out.dtype == torch.bfloat16
    assert_same(out.float(), sdpa(q, k, v), atol=2e-2, rtol=2e-2)


def test_compiled_forward_and_backward(monkeypatch):
    graphs = []
    original = backend.CompiledGraph.__init__

    def spy(self, gm, *args, **kwargs):
        graphs.append({n.target for n in gm.graph.nodes})
        original(self, gm, *args, **kwargs)

    monkeypatch.setattr(backend.CompiledGraph, "__init__", spy)
    torch._dynamo.reset()
    mask = torch.randn(4, 6, requires_grad=True)
    fn = torch.compile(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), backend="tpu")
    inputs = [*_qkv(), mask]
    out, grads, _ = _run(fn, inputs, "tpu", log=False)
    expected, expected_grads, _ = _run(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), inputs,
                                       "cpu")
    torch._dynamo.reset()
    assert_same(out, expected, atol=1e-5, rtol=1e-5)
    assert_same(grads, expected_grads, atol=1e-5, rtol=1e-5)
    assert [FUSED in g for g in graphs] == [True, False]
    assert [FUSED_BACKWARD in g for g in graphs] == [False, True]
