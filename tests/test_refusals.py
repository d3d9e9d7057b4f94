"""Calls CPU refuses are refused on tpu, with CPU's exception and words, in every eager mode:
dtypes CPU's kernels do not implement (``eager/refusals.py``), and values its kernels check
(class targets out of range, probabilities outside [0, 1], ...: each op's ``@check`` beside
its lowering, built on ``lowering/checks.py``; Debug raises at the call; Strict and DeferAndFuse
on a TPU at the next host read, as CUDA's device asserts do). The whole OpInfo sweep is
``python -m torchtpu.testing.refusals`` (``bench/RESULTS.md``); a few OpInfos of it run here,
and all of them under TORCHTPU_TESTS=full.
"""

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.device import asserts
from torchtpu.eager import refusals
from torchtpu.testing import refusals as sweep

MODES = list(torch.tpu.EagerMode)

BAD = {
    "mm_float_long": lambda d: torch.mm(torch.ones(3, 3, device=d),
                                        torch.ones(3, 3, dtype=torch.long, device=d)),
    "gelu_long": lambda d: F.gelu(torch.arange(-1, 3, device=d)),
    "softmax_long": lambda d: torch.softmax(torch.arange(4, device=d), 0),
    "log_softmax_bool": lambda d: torch.log_softmax(torch.ones(4, dtype=torch.bool, device=d), 0),
    "inv_long": lambda d: torch.linalg.inv(torch.eye(3, dtype=torch.long, device=d)),
    "addmm_out_of_place_half_float": lambda d: torch.addmm(
        torch.ones(3, device=d), torch.ones(3, 3, device=d, dtype=torch.float16),
        torch.ones(3, 3, device=d)),
    # Large enough that the stand-ins are shrunk (refusals.SMALL).
    "mm_large_float_long": lambda d: torch.mm(torch.ones(100, 100, device=d),
                                              torch.ones(100, 100, dtype=torch.long, device=d)),
    "cross_entropy_target_3_of_3": lambda d: F.cross_entropy(
        torch.ones(2, 3, device=d), torch.tensor([0, 3], device=d)),
    "nll_loss2d_negative_target": lambda d: F.nll_loss(
        torch.ones(1, 3, 2, 2, device=d), torch.tensor([[[0, 1], [-2, 0]]], device=d)),
}


# Values CPU's kernels check (the ops' ``@check``s, ``lowering/checks.py``'s ``first_bad``).
VALUES = {
    "bce_input_above_1": lambda d: F.binary_cross_entropy(
        torch.tensor([0.5, 1.5], device=d), torch.tensor([0.0, 1.0], device=d)),
    "bernoulli_p_above_1": lambda d: torch.bernoulli(torch.tensor([0.5, 1.5], device=d)),
    "bernoulli__tensor_p": lambda d: torch.ones(2, device=d).bernoulli_(
        torch.tensor([0.5, -0.5], device=d)),
    "normal_negative_std": lambda d: torch.normal(torch.zeros(2, device=d),
                                                  torch.tensor([1.0, -1.0], device=d)),
    "multilabel_margin_target": lambda d: F.multilabel_margin_loss(
        torch.ones(2, 3, device=d), torch.tensor([[0, 3, -1], [0, 1, -1]], device=d)),
    "repeat_interleave_negative": lambda d: torch.repeat_interleave(
        torch.ones(2, device=d), torch.tensor([1, -1], device=d)),
    "index_copy_bounds": lambda d: torch.zeros(2, 3, device=d).index_copy(
        -1, torch.tensor([5], device=d), torch.ones(2, 1, device=d)),
    "index_fill_bounds": lambda d: torch.zeros(3, device=d).index_fill(
        0, torch.tensor([-4], device=d), 1.0),
    "max_unpool_index": lambda d: F.max_unpool1d(
        torch.ones(1, 1, 2, device=d), torch.tensor([[[0, 9]]], device=d), 2),
    "searchsorted_sorter": lambda d: torch.searchsorted(
        torch.tensor([1.0, 2.0], device=d), torch.tensor([1.5], device=d),
        sorter=torch.tensor([0, 5], device=d)),
    "embedding_bag_last_offset": lambda d: F.embedding_bag(
        torch.tensor([0, 1], device=d), torch.ones(3, 2, device=d), torch.tensor([0, 5], device=d)),
    "embedding_bag_first_offset": lambda d: F.embedding_bag(
        torch.tensor([0, 1], device=d), torch.ones(3, 2, device=d), torch.tensor([1, 1], device=d)),
    "embedding_bag_index": lambda d: F.embedding_bag(
        torch.tensor([[0, 7]], device=d), torch.ones(3, 2, device=d)),
}
BAD.update(VALUES)
BAD["bernoulli__scalar_p"] = lambda d: torch.ones(3, device=d).bernoulli_(1.5)


def _cpu_error(case) -> Exception:
    with pytest.raises(Exception) as info:
        BAD[case]("cpu")
    return info.value


@pytest.mark.parametrize("mode", MODES, ids=[m.value for m in MODES])
@pytest.mark.parametrize("case", sorted(BAD))
def test_refused_as_on_cpu(case, mode):
    expected = _cpu_error(case)
    with torch.tpu.set_eager_mode(mode):
        with pytest.raises(type(expected)) as info:
            BAD[case]("tpu").cpu()
    assert str(info.value) == str(expected)


def test_what_cpu_takes_is_taken_and_asked_once_per_signature(monkeypatch):
    calls = []
    ask = refusals._on_stand_ins
    monkeypatch.setattr(refusals, "_on_stand_ins",
                        lambda *a, **k: calls.append(a[0]) or ask(*a, **k))
    a = torch.randn(3, 5, device="tpu")
    out = [torch.mm(a, torch.randn(5, n, device="tpu")) for n in (2, 7, 11)]
    assert sum(op is torch.ops.aten.mm.default for op in calls) <= 1  # new shapes: no new ask
    assert out[-1].shape == (3, 11)
    # Integer matmul, where CPU has the kernel; ignore_index outside the classes.
    i = torch.arange(6, device="tpu").reshape(2, 3)
    assert torch.equal(torch.mm(i, i.T).cpu(), torch.mm(i.cpu(), i.cpu().T))
    x = torch.randn(2, 3)
    t = torch.tensor([2, -100])
    assert torch.allclose(F.cross_entropy(x.to("tpu"), t.to("tpu")).cpu(), F.cross_entropy(x, t))


@pytest.mark.parametrize("mode", [torch.tpu.EagerMode.DEFER_NEVER,
                                  torch.tpu.EagerMode.DEFER_AND_FUSE], ids=["strict", "defer"])
def test_a_traced_numbers_sign_is_asked_of_cpu_again(mode):
    # An integer tensor to a negative power is refused, to a positive one not: a kept meta
    # result for ``x ** 5`` skipped the question for ``x ** -5`` (garbage values, no error).
    n = torch.arange(1, 5)
    d = n.to("tpu")
    with torch.tpu.set_eager_mode(mode):
        for power in (5, -5):
            for call in (lambda t, p=power: t ** p,
                         lambda t, p=power: torch._foreach_pow([t], [p])[0]):
                try:
                    want = call(n)
                except RuntimeError as e:
                    with pytest.raises(RuntimeError, match=str(e)):
                        call(d).cpu()
                else:
                    assert torch.equal(call(d).cpu(), want)


def test_stand_ins_refused_for_their_shapes_do_not_refuse_the_call():
    # Shrunk stand-ins of a large grouped convolution have one channel for 4 groups, which CPU
    # refuses; in float32 alike, so the dtypes are not to blame.
    x, w = torch.randn(1, 4, 64, 64, dtype=torch.float64), torch.randn(4, 1, 3, 3)
    out = F.conv2d(x.to("tpu"), w.double().to("tpu"), groups=4)
    assert torch.allclose(out.cpu(), F.conv2d(x, w.double(), groups=4))
    with pytest.raises(RuntimeError) as expected:
        F.conv2d(x, w, groups=4)  # float64 and float32: CPU refuses the mix
    with pytest.raises(RuntimeError) as info:
        F.conv2d(x.to("tpu"), w.to("tpu"), groups=4)
    assert str(info.value) == str(expected.value)


def test_target_out_of_bounds_at_the_next_host_read_on_a_tpu(monkeypatch):
    # Strict as on a TPU: the targets are not read at the call; the device checks them.
    monkeypatch.setattr(asserts, "_host_reads_stall", lambda: True)
    x, t = torch.ones(2, 3, device="tpu"), torch.tensor([0, 3], device="tpu")
    loss = F.cross_entropy(x, t)
    with pytest.raises(IndexError, match="Target 3 is out of bounds.") as info:
        loss.item()
    assert info.value.__notes__[0].startswith("Checked on the device")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        with pytest.raises(IndexError, match="Target 3 is out of bounds."):
            F.cross_entropy(x, t)  # Debug: at the call


def test_defer_and_fuse_checks_a_view_of_targets_without_running_the_recording():
    # The Llama step's targets.reshape(-1): under DeferAndFuse a view's read is recorded, so the
    # check reads the view in its storage's host values (running the step's recording there
    # made two programs a step); the error still comes at the call, in CPU's words.
    x = torch.ones(2, 3, device="tpu")
    good = torch.tensor([[0, 2]], device="tpu")
    bad = torch.tensor([[5, 0], [1, 3]], device="tpu")  # its column 1: a strided view
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        before = torchtpu.metrics.snapshot()["executions"]
        loss = F.cross_entropy(x * 2, good.reshape(-1))
        assert torchtpu.metrics.snapshot()["executions"] == before
        torch.testing.assert_close(loss.cpu(), F.cross_entropy(torch.full((2, 3), 2.0),
                                                               torch.tensor([0, 2])))
        with pytest.raises(IndexError, match="^Target 3 is out of bounds.$"):
            F.cross_entropy(x * 2, bad[:, 1])


@pytest.mark.parametrize("mode", MODES[::2], ids=[m.value for m in MODES[::2]])
@pytest.mark.parametrize("case", sorted(VALUES))
def test_values_checked_on_the_device_raise_at_the_next_host_read(case, mode, monkeypatch):
    # As on a TPU: Strict and DeferAndFuse leave the values to the device; the error comes at
    # the next host read, of CPU's type, with the op and (in a note) the call's line.
    monkeypatch.setattr(asserts, "_host_reads_stall", lambda: True)
    expected = _cpu_error(case)
    with torch.tpu.set_eager_mode(mode):
        with pytest.raises(type(expected)) as info:
            BAD[case]("tpu")
            torch.ones(1, device="tpu").cpu()
    assert str(info.value).startswith("torchtpu.check: aten."), info.value
    if case != "embedding_bag_index":  # CPU's words for it name the index's position
        assert str(expected).split("\n")[0].split(" but got offsets")[0] in str(info.value)
    assert info.value.__notes__[0].startswith("Checked on the device")


def test_compiled_graphs_refuse_what_cpu_kernels_refuse():
    # Dynamo wraps a backend's error in BackendCompilerFailed; CPU's words are in it.
    a, b = torch.ones(3, 3, device="tpu"), torch.ones(3, 3, dtype=torch.long, device="tpu")
    with pytest.raises(Exception, match="expected m1 and m2 to have the same dtype"):
        torch.compile(lambda x, y: torch.mm(x, y) * 2, backend="tpu")(a, b)
    f = torch.compile(lambda x, y: torch.mm(x, y.float()) * 2, backend="tpu")
    assert torch.equal(f(a, b).cpu(), torch.full((3, 3), 6.0))


FAST = "mm|nn.functional.gelu|softmax|nn.functional.cross_entropy"


def test_sweep_of_a_few_opinfos():
    report = sweep.run(FAST)
    table = report.format() + "\n" + sweep.summary(report, over=True)
    assert {"mm", "nn.functional.gelu", "softmax", "nn.functional.cross_entropy"} <= {
        r.name for r in report.results}, table
    assert report.failed == 0 and report.passed > 20, table
    assert sum(r.over for r in report.results) == 0, table


@pytest.mark.full
@pytest.mark.parametrize("mode", sorted(sweep.MODES))
def test_sweep_of_every_opinfo(mode):
    report = sweep.run(mode=mode, over=False)
    assert report.rate >= 0.99, report.format() + "\n" + sweep.summary(report, over=False)


def test_runner_counts_refusals_acceptances_and_words():
    from torch.testing._internal.opinfo.core import OpInfo, SampleInput

    def samples(op, device, dtype, requires_grad, **kwargs):
        yield SampleInput(torch.ones(2, 2, device=device, dtype=dtype),
                          args=(torch.ones(2, 2, device=device, dtype=dtype),))

    def lenient(a, b):  # accepts on tpu what CPU refuses
        if a.device.type == "tpu":
            return a
        return torch.mm(a, b)

    def reworded(a, b):
        if a.device.type == "tpu" and a.dtype != b.dtype:
            raise RuntimeError("other words")
        return torch.mm(a, b)

    def make(name, fn):
        return OpInfo(name, op=fn, dtypes=(torch.float32,), sample_inputs_func=samples)

    plain = sweep.check_op(make("plain", torch.mm))
    assert plain.passed > 0 and plain.failed == plain.errored == plain.over == 0
    loose = sweep.check_op(make("lenient", lenient))
    assert loose.failed == plain.passed and "accepted; CPU raises" in loose.first_error
    words = sweep.check_op(make("reworded", reworded))
    assert words.errored > 0 and "other words" in words.first_error
    strict = sweep.check_op(make("strict", lambda a, b: torch.mm(a, b) if a.is_cpu else 1 / 0))
    assert strict.over > 0


NORMS = {
    "layer_norm": lambda: torch.nn.LayerNorm(8),
    "layer_norm_plain": lambda: torch.nn.LayerNorm(8, elementwise_affine=False),
    "batch_norm": lambda: torch.nn.BatchNorm1d(4),
    "batch_norm_eval": lambda: torch.nn.BatchNorm1d(4).eval(),
    "instance_norm": lambda: torch.nn.InstanceNorm1d(4, affine=True),
}


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "f16"])
@pytest.mark.parametrize("norm", sorted(NORMS))
def test_a_half_norms_backward_takes_the_float32_statistics_its_forward_made(norm, dtype):
    # The forward's mean and rstd are float32 (the meta kernel's, CUDA's convention), where CPU
    # keeps a half input's dtype and refuses float32 ones: asked of CPU as they were, a bfloat16
    # LayerNorm's backward raised "expected scalar type BFloat16 but found Float" in every mode.
    torch.manual_seed(0)
    x = torch.randn(3, 4, 8)
    grad = torch.randn(3, 4, 8, dtype=torch.float64)

    def step(device, dt):
        m = NORMS[norm]().to(dt).to(device)
        xs = x.to(dt).to(device).requires_grad_()
        (m(xs).double() * grad.to(device)).sum().backward()
        return [t.detach().double().cpu() for t in (xs.grad, *(p.grad for p in m.parameters()))]

    want, cpu = step("cpu", torch.float64), step("cpu", dtype)
    for mode in (torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_AND_FUSE):
        with torch.tpu.set_eager_mode(mode):
            got = step("tpu", dtype)
        for g, c, w in zip(got, cpu, want, strict=True):
            scale = w.abs().max().item()
            assert (g - w).abs().max().item() <= 2 * (c - w).abs().max().item() + 1e-3 * scale
    # A gradient of another dtype than the input's is still refused, as on CPU.
    out, mean, rstd = (t.to("tpu") for t in torch.ops.aten.native_layer_norm(
        x.to(dtype), (8,), None, None, 1e-5))
    with pytest.raises(RuntimeError, match="expected scalar type"):
        torch.ops.aten.native_layer_norm_backward(
            out.float(), out, (8,), mean, rstd, None, None, [True, False, False])[0].cpu()
