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


def test_large_scores_keep_full_precision():
    # Scores in the thousands: probabilities from exp(s - max) / sum, as CPU's softmax; from
    # exp(s - logsumexp) the logsumexp's rounding (5e-4 at 5000) scaled even a lone key's 1.
    q, k, v = (x.detach() * 30 for x in _qkv(L=2, S=3))
    assert_same(sdpa(*to_device([q, k, v])), sdpa(q, k, v), atol=1e-6, rtol=1e-6)
    # One key: its probability is exactly 1, gradients included: q and k get exactly zero, as
    # float64 gives (CPU's float32 math path leaves rounding there, up to 4e-2 on an AVX2 host).
    q, k, v = _qkv(L=2, S=1)
    with torch.no_grad():
        q.mul_(30), k.mul_(30), v.mul_(30)
    out, grads, _ = _run(sdpa, [q, k, v], "tpu")
    wide = [x.detach().double().requires_grad_() for x in (q, k, v)]
    expected, expected_grads, _ = _run(sdpa, wide, "cpu", log=False)
    assert_same([out, *grads], [t.float() for t in (expected, *expected_grads)], atol=1e-6,
                rtol=1e-6)


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


@pytest.mark.parametrize("causal", [False, True])
def test_gqa_takes_the_fused_op_with_its_heads_repeated(causal):
    # Llama, Qwen and Gemma configs have fewer key/value heads than query heads.
    q, k, v = _qkv(h=4)[0], *_qkv(h=2)[1:]
    _check(lambda q, k, v: sdpa(q, k, v, is_causal=causal, enable_gqa=True), [q, k, v],
           fused=True)


def test_float64_takes_the_math_path_at_full_precision():
    _check(lambda q, k, v: sdpa(q, k, v, is_causal=True), _qkv(dtype=torch.float64),
           fused=False, atol=1e-12, rtol=1e-12)


def _fused_dropout_run(fn, inputs, seed=0, seed_with=torch.tpu.manual_seed):
    """fn on tpu after seed_with(seed): output and gradients (see _run), checking that the fused
    ops ran without the math path's pieces or a CPU fallback."""
    before = torchtpu.metrics.snapshot()["cpu_fallbacks"]
    seed_with(seed)
    out, grads, ops = _run(fn, inputs, "tpu")
    assert FUSED in ops and FUSED_BACKWARD in ops
    assert aten.bmm.default not in ops and aten._safe_softmax.default not in ops
    assert torchtpu.metrics.snapshot()["cpu_fallbacks"] == before
    return out, grads


def test_dropout_is_fused_and_keeps_one_minus_p_of_the_mass():
    p = 0.25
    q, k, _ = _qkv(L=64, S=64)
    v = torch.ones(2, 2, 64, 1, requires_grad=True)
    out, grads = _fused_dropout_run(lambda q, k, v: sdpa(q, k, v, dropout_p=p), [q, k, v])
    # With v = 1 each output is the row's kept probability mass / (1 - p): 1 on average.
    rows = out.detach().cpu().flatten()
    assert abs(rows.mean().item() - 1.0) < 0.05
    assert rows.min() < 0.95 and rows.max() > 1.05  # dropped some, not nothing
    assert all(torch.isfinite(g.cpu()).all() for g in grads)


def test_dropout_keeps_uniform_probabilities_at_0_or_1_over_keep():
    # q = k = 0: every probability is 1/S; v = one-hot per key puts each of them in its own
    # column, so out * S is the dropout factor, 0 or 1 / (1 - p), at a rate close to 1 - p.
    p, S = 0.5, 32
    q, k = torch.zeros(2, 2, 16, 8), torch.zeros(2, 2, S, 8)
    v = torch.eye(S).expand(2, 2, S, S).requires_grad_()
    out, _ = _fused_dropout_run(lambda q, k, v: sdpa(q, k, v, dropout_p=p), [q, k, v])
    factor = out.detach().cpu() * S
    kept = factor > 1.0
    assert_same(factor, kept.float() / (1 - p), atol=1e-5, rtol=1e-5)
    assert 0.4 < kept.float().mean().item() < 0.6


def _reveal_mask_values(S: int, ev: int = 3) -> torch.Tensor:
    """v = [one-hot per key | random]: out[..., :S] is p * mask, nonzero where kept."""
    return torch.cat([torch.eye(S).expand(2, 2, S, S), torch.randn(2, 2, S, ev)], -1)


@pytest.mark.parametrize("causal", [False, True], ids=["float_mask", "causal"])
def test_dropout_gradients_match_a_reference_with_the_same_mask(causal):
    """Backward regenerates the forward's mask: the gradients equal PyTorch's math path run on
    CPU with the mask the forward used (read from out, where v puts each probability alone)."""
    p, S = 0.3, 6
    q, k, _ = _qkv(S=S)
    v = _reveal_mask_values(S).requires_grad_()
    if causal:
        inputs, kwargs = [q, k, v], dict(is_causal=True)
        fn = lambda q, k, v: sdpa(q, k, v, dropout_p=p, is_causal=True)  # noqa: E731
    else:
        inputs, kwargs = [q, k, v, torch.randn(2, 1, 4, S, requires_grad=True)], {}
        fn = lambda q, k, v, m: sdpa(q, k, v, attn_mask=m, dropout_p=p)  # noqa: E731
    out, grads = _fused_dropout_run(fn, inputs)
    mask = out.detach().cpu()[..., :S] > 0
    assert 0 < mask.float().mean() < 1

    def reference(q, k, v, m=None):
        return aten._scaled_dot_product_attention_math(q, k, v, m, p, dropout_mask=mask,
                                                        **kwargs)[0]

    expected, expected_grads, _ = _run(reference, inputs, "cpu")
    assert_same(out, expected, atol=1e-5, rtol=1e-5)
    assert_same(grads, expected_grads, atol=1e-5, rtol=1e-5)


def _dropout_out_and_grads(seed: int, seed_with=torch.tpu.manual_seed):
    torch.manual_seed(0)  # the same inputs every time
    inputs = _qkv(L=8, S=16)
    return _fused_dropout_run(lambda q, k, v: sdpa(q, k, v, dropout_p=0.5), inputs, seed,
                              seed_with)


def test_attention_without_dropout_leaves_the_generator_alone():
    q, k, v = to_device(_qkv())
    torch.manual_seed(3)
    expected = torch.rand(5, device="tpu").cpu()
    torch.manual_seed(3)
    sdpa(q, k, v, is_causal=True).square().sum().backward()
    assert torch.equal(torch.rand(5, device="tpu").cpu(), expected)
    torch.manual_seed(3)
    sdpa(q, k, v, dropout_p=0.3)
    assert not torch.equal(torch.rand(5, device="tpu").cpu(), expected)


def test_dropout_repeats_for_a_seed():
    out, grads = _dropout_out_and_grads(seed=1)
    again, again_grads = _dropout_out_and_grads(seed=1, seed_with=torch.manual_seed)
    other, _ = _dropout_out_and_grads(seed=2)
    assert_same(again, out, atol=0, rtol=0)
    assert_same(again_grads, grads, atol=0, rtol=0)
    assert not torch.equal(other.cpu(), out.cpu())


@pytest.mark.parametrize("mode", [torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
                                  torch.tpu.EagerMode.DEFER_AND_FUSE])
def test_dropout_is_the_same_in_every_eager_mode(mode):
    out, grads = _dropout_out_and_grads(seed=3)
    with torch.tpu.set_eager_mode(mode):
        out_mode, grads_mode = _dropout_out_and_grads(seed=3)
    assert_same(out_mode, out, atol=0, rtol=0)
    assert_same(grads_mode, grads, atol=0, rtol=0)


def test_dropout_compiled_forward_and_backward_match_eager(compiled_graphs):
    """The compiled backward graph gets the forward graph's key (philox_seed) and redraws the
    forward's mask; the forward is not recomputed there with a fresh key."""
    torch.manual_seed(0)
    inputs = _qkv(L=8, S=16)
    fn = lambda q, k, v: sdpa(q, k, v, dropout_p=0.5)  # noqa: E731
    out, grads = _fused_dropout_run(fn, inputs, seed=4)
    torch.manual_seed(4)
    compiled, compiled_grads, _ = _run(torch.compile(fn, backend="tpu"), inputs, "tpu", log=False)
    assert_same(compiled, out, atol=1e-6, rtol=1e-6)
    assert_same(compiled_grads, grads, atol=1e-6, rtol=1e-6)
    _fused_forward_then_backward(compiled_graphs)


def test_dropout_p_1_drops_everything_like_pytorch():
    _check(lambda q, k, v: sdpa(q, k, v, dropout_p=1.0), _qkv(), atol=0, rtol=0)


def test_choice_kernel():
    q, k, v = (x.detach() for x in to_device(_qkv(S=4)))
    assert aten._fused_sdp_choice(q, k, v) == int(torch._C._SDPBackend.OVERRIDEABLE)
    assert aten._fused_sdp_choice(q, k, v, None, 0.1) == int(torch._C._SDPBackend.OVERRIDEABLE)
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


@pytest.fixture
def compiled_graphs(monkeypatch):
    """The op targets of each graph the tpu compile backend gets, in order."""
    graphs = []
    original = backend.CompiledGraph.__init__

    def spy(self, gm, *args, **kwargs):
        graphs.append({n.target for n in gm.graph.nodes})
        original(self, gm, *args, **kwargs)

    monkeypatch.setattr(backend.CompiledGraph, "__init__", spy)
    torch._dynamo.reset()
    yield graphs
    torch._dynamo.reset()


def _fused_forward_then_backward(graphs) -> None:
    assert [FUSED in g for g in graphs] == [True, False]
    assert [FUSED_BACKWARD in g for g in graphs] == [False, True]


def test_compiled_forward_and_backward(compiled_graphs):
    mask = torch.randn(4, 6, requires_grad=True)
    fn = torch.compile(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), backend="tpu")
    inputs = [*_qkv(), mask]
    out, grads, _ = _run(fn, inputs, "tpu", log=False)
    expected, expected_grads, _ = _run(lambda q, k, v, m: sdpa(q, k, v, attn_mask=m), inputs,
                                       "cpu")
    assert_same(out, expected, atol=1e-5, rtol=1e-5)
    assert_same(grads, expected_grads, atol=1e-5, rtol=1e-5)
    _fused_forward_then_backward(compiled_graphs)


def test_half_precision_products_keep_their_dtype():
    # A bf16 call's five products take bf16 operands (float32 accumulation): float32 (L, S)
    # operands were most of a bf16 GPT-2 block's bytes on TPU. The scores stay float32.
    import jax
    import jax.numpy as jnp

    from torchtpu.lowering import attention

    q, k, v = (jnp.ones((1, 2, 16, 8), jnp.bfloat16) for _ in range(3))

    def step(q, k, v):
        out, lse, *_ = attention.sdpa_forward(None, q, k, v, is_causal=True)
        seed = jnp.zeros((), jnp.int64)
        grads = attention.sdpa_backward(out.astype(q.dtype), q, k, v, None,
                                        [True, True, True, False], out, lse, None, None, 16,
                                        16, 0.0, True, seed, seed)
        return out, lse, grads[:3]

    dots = [e for e in jax.make_jaxpr(step)(q, k, v).eqns if e.primitive.name == "dot_general"]
    assert len(dots) == 7  # forward: q @ k, p @ v; backward: q @ k again, dp, dq, dk, dv
    assert all(x.aval.dtype == jnp.bfloat16 for e in dots for x in e.invars), \
        [[x.aval.dtype for x in e.invars] for e in dots]
    assert all(e.outvars[0].aval.dtype == jnp.float32 for e in dots)


@pytest.mark.parametrize("lengths", [dict(L=3, S=0), dict(L=0, S=0), dict(L=0, S=4)])
def test_no_queries_or_no_keys_give_what_cpu_gives(lengths):
    # No keys: every row has nothing to attend to (zeros, as CPU's math path); the max over an
    # empty row raised JAX's "zero-size array to reduction operation max".
    for causal in (False, True):
        _check(lambda q, k, v, c=causal: sdpa(q, k, v, is_causal=c), _qkv(**lengths))


def test_a_failing_fused_call_is_not_reported_as_cpus_stub():
    # CPU's kernel of the device-only fused op is a stub that refuses every call ("not
    # implemented ... for privateuse1 backends"): no verdict on the arguments, so a tpu failure
    # keeps its own error (the no-keys call above showed the stub's words instead).
    from torchtpu.eager import fallback

    q = torch.randn(1, 1, 2, 4, device="tpu")
    assert fallback.cpu_error(FUSED, (q, q, q), {}) is None
    # a kernel's own NotImplementedError (a dtype it does not take) stays CPU's verdict
    bad = torch.tensor([1.0], device="tpu")
    assert isinstance(fallback.cpu_error(aten.bincount.default, (bad,), {}), NotImplementedError)


@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_math_path_lays_its_output_out_as_cpus_flash_kernel(dtype):
    # float64 takes the math path here, whose output is contiguous; CPU's flash kernel lays it
    # out as the query: for heads transposed out of (B, L, H, E), CPU's
    # .transpose(1, 2).view(B, L, -1) works, and ours raised "view size is not compatible".
    x = torch.randn(2, 5, 3, 8, dtype=dtype, requires_grad=True)

    def attend(x):
        q = x.transpose(1, 2)
        mask = torch.ones(5, 5, dtype=torch.bool, device=x.device).tril()
        return sdpa(q, q, q, attn_mask=mask).transpose(1, 2).view(2, 5, 24)

    _check(attend, [x], fused=dtype is not torch.float64, atol=1e-6 if dtype is torch.float32
           else 1e-12)
