"""DeferAndFuse's replay (``eager/defer_replay.py``): a call repeating the call recorded at the
same place of an earlier recording is appended without the op path; any difference in its op,
its tensors' geometry, dtype or storage value, or its other arguments takes the op path. Every
step's values are compared with CPU's."""

import pytest
import torch

from torchtpu.eager import defer_replay
from torchtpu.testing.llama import LlamaConfig, seeded_step

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE


@pytest.fixture(autouse=True)
def fresh_tape():
    """Each test keeps its own calls (the process's kept calls outlive the mode)."""
    defer_replay.REPLAY.tape.clear()


def _replayed(fn):
    """(fn's result, how many calls the replay appended inside it)."""
    before = defer_replay.REPLAY.replayed
    out = fn()
    return out, defer_replay.REPLAY.replayed - before


def test_a_training_loop_replays_its_steps_with_cpus_values():
    config = LlamaConfig(layers=2, seq=8, vocab=64, dim=32, heads=2, hidden=64)
    model, step, x, y = seeded_step(config, "tpu")
    cpu_model, cpu_step, cx, cy = seeded_step(config, "cpu")
    counts = []
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(4):
            loss, n = _replayed(lambda: step(x, y).item())
            counts.append(n)
            torch.testing.assert_close(loss, cpu_step(cx, cy).item(), rtol=2e-2, atol=1e-2)
    assert counts[0] == 0 and min(counts[1:]) > 100, counts
    for p, q in zip(model.parameters(), cpu_model.parameters()):
        torch.testing.assert_close(p.cpu(), q, rtol=2e-2, atol=1e-2)


def _loop(make, steps):
    """make(step) under DeferAndFuse, read at every step, and on CPU: equal values, and the
    replayed counts per step."""
    counts = []
    with torch.tpu.set_eager_mode(DEFER):
        for i in range(steps):
            got, n = _replayed(lambda i=i: make(i, "tpu").cpu())
            counts.append(n)
            want = make(i, "cpu")
            torch.testing.assert_close(got, want)
            assert got.stride() == want.stride()
    return counts


# Consecutive steps differ in one thing at a time: the step before kept the other form.
ORDER = [0, 0, 1, 1, 0]


def test_a_view_read_at_another_offset_or_strides_takes_the_op_path():
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(1))
    w = torch.randn(4, generator=torch.Generator().manual_seed(2))
    on = {"tpu": (a.to("tpu"), w.to("tpu")), "cpu": (a, w)}

    def make(i, device):
        x, v = on[device]
        s = x * 1.0
        square = s if ORDER[i] == 0 else s.t()  # strides (4, 1), then (1, 4)
        row = s[ORDER[i]]                        # offset 0, then 4
        return torch.sin(square * v) + torch.cos(row)

    counts = _loop(make, 5)
    assert counts[1] == 5  # mul, mul, sin, cos, add: the same calls again


def test_another_constant_dtype_or_shape_takes_the_op_path():
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(4))
    on = {"tpu": a.to("tpu"), "cpu": a}

    def make(i, device):
        x = on[device]
        if i == 5:
            x = x.double()
        elif i == 6:
            x = x[:3]
        y = torch.cos(x)
        k = ORDER[i % 5]
        return (torch.cumsum(y, dim=k) + torch.copysign(y, (0.0, -0.0)[k])
                + torch.pow(y, 2 + k) * (2.0, 2)[k])

    counts = _loop(make, 7)
    assert counts[1] >= 5  # the same calls again


def test_another_number_type_or_tensor_dtype_takes_the_op_path():
    a = torch.randn(3, 5, generator=torch.Generator().manual_seed(7))
    on = {"tpu": a.to("tpu"), "cpu": a}

    def make(i, device):
        s = on[device] * 4
        # The same geometry and storage, read as float32 or as int32 (a reinterpreting view).
        v = s if ORDER[i] == 0 else s.view(torch.int32)
        # 1 and True are equal keys that compute differently: bool * 1 is int64, * True bool.
        flags = torch.ops.aten.mul.Scalar(s > 0, (1, True)[ORDER[i]])
        return torch.abs(v), flags

    counts = []
    with torch.tpu.set_eager_mode(DEFER):
        for i in range(5):
            got, n = _replayed(lambda i=i: [t.cpu() for t in make(i, "tpu")])
            counts.append(n)
            for g, w in zip(got, make(i, "cpu")):
                torch.testing.assert_close(g, w)
    assert counts[1] == 4, counts  # mul, abs, gt, mul: the same calls again


def test_a_storage_of_another_shape_behind_the_same_view_takes_the_op_path():
    a, b = (torch.randn(n, generator=torch.Generator().manual_seed(n)) for n in (16, 8))
    on = {"tpu": (a.to("tpu").view(4, 4), b.to("tpu")), "cpu": (a.view(4, 4), b)}

    def make(i, device):
        stored = on[device][ORDER[i]]
        pending = stored * 2
        # The same shape (4,), strides (1,) and offset 0, read from a (4, 4) or an (8,) storage,
        # computed (a parameter's) or pending in the recording.
        return torch.sin(stored.view(-1)[:4]) + torch.cos(pending.view(-1)[:4])

    counts = _loop(make, 5)
    assert counts[1] == 4  # mul, sin, cos, add: the same calls again


def test_arguments_sharing_a_storage_as_before_or_not_take_the_op_path():
    a, b = (torch.randn(4, 4, generator=torch.Generator().manual_seed(n)) for n in (5, 6))
    on = {"tpu": (a.to("tpu"), b.to("tpu")), "cpu": (a, b)}

    def make(i, device):
        x, y = on[device]
        # x @ x.t() reads one storage twice, x @ y.t() two, in the same geometry: the kept
        # x @ x.t() replayed over x and y computed x @ x.t() again.
        return x @ (x, y)[ORDER[i]].t()

    counts = _loop(make, 5)
    assert counts == [0, 1, 0, 1, 0]


def test_another_default_dtype_takes_the_op_path():
    n = torch.arange(12).reshape(3, 4)
    on = {"tpu": n.to("tpu"), "cpu": n}

    def make(i, device):
        # The same call, whose result's dtype is the default dtype: a kept float32 call was
        # replayed after ``torch.set_default_dtype(torch.float64)``.
        torch.set_default_dtype((torch.float32, torch.float64)[ORDER[i]])
        x = on[device] + 1
        return torch.sqrt(x) + x * 2.5

    try:
        counts = _loop(make, 5)
    finally:
        torch.set_default_dtype(torch.float32)
    assert counts == [0, 4, 0, 4, 0]  # add, sqrt, mul, add; none across a change


def test_casts_and_laid_out_results_repeat_as_the_op_path_made_them():
    a = torch.randn(4, 6, generator=torch.Generator().manual_seed(8))
    on = {"tpu": a.to("tpu"), "cpu": a}

    def make(i, device):
        x = on[device] * 1.0
        # Pointwise results of a transposed input keep its layout (strides (1, 4)).
        y = torch.sigmoid(x.t()) * 2
        return y + x.to((torch.bfloat16, torch.float16)[ORDER[i]]).t()

    counts = _loop(make, 5)
    assert counts[1] == 5  # mul, sigmoid, mul, the cast, add: the same calls again


def test_a_call_with_a_check_of_values_is_never_replayed():
    a = torch.randn(5, 3, generator=torch.Generator().manual_seed(5))
    x = a.to("tpu")
    with torch.tpu.set_eager_mode(DEFER):
        for idx in ([0, 4], [1, 3]):
            got = torch.index_select(torch.cos(x), 0, torch.tensor(idx).to("tpu"))
            torch.testing.assert_close(got.cpu(), torch.index_select(torch.cos(a), 0,
                                                                     torch.tensor(idx)))
        with pytest.raises(IndexError) as cpu:
            torch.index_select(torch.cos(a), 0, torch.tensor([1, 9]))
        with pytest.raises(IndexError, match=str(cpu.value).split(":")[-1].strip()[:20]):
            torch.index_select(torch.cos(x), 0, torch.tensor([1, 9]).to("tpu")).cpu()


def test_a_storage_written_in_place_is_read_anew():
    a = torch.randn(4, 4, generator=torch.Generator().manual_seed(6))
    x, c = a.to("tpu"), a.clone()
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(3):
            got, _ = _replayed(lambda: (torch.tanh(x) * 2).cpu())
            torch.testing.assert_close(got, torch.tanh(c) * 2)
            x.mul_(0.5)
            c.mul_(0.5)


def test_the_mode_entered_at_every_step_replays_from_the_second():
    a = torch.randn(3, 3, generator=torch.Generator().manual_seed(9))
    x = a.to("tpu")
    counts = []
    for _ in range(3):
        with torch.tpu.set_eager_mode(DEFER):
            got, n = _replayed(lambda: (torch.exp(x) * 3).cpu())
        counts.append(n)
        torch.testing.assert_close(got, torch.exp(a) * 3)
    assert counts[1:] == [2, 2]
    before = defer_replay.REPLAY.replayed
    torch.testing.assert_close((torch.exp(x) * 3).cpu(), torch.exp(a) * 3)  # Strict: op path
    assert defer_replay.REPLAY.replayed == before


def test_a_place_whose_calls_keep_growing_is_kept_anew_only_now_and_then(monkeypatch):
    taped = []
    tape = defer_replay.Replay._tape

    def spy(self, rec, trace, n, op, *rest):
        taped.append(op)
        return tape(self, rec, trace, n, op, *rest)

    monkeypatch.setattr(defer_replay.Replay, "_tape", spy)
    a = torch.rand(4, generator=torch.Generator().manual_seed(10)) + 0.5
    x = a.to("tpu")
    with torch.tpu.set_eager_mode(DEFER):
        for k in range(10):  # another exponent at every step: never the same call again
            torch.testing.assert_close(torch.pow(x, 1.5 + k).cpu(), torch.pow(a, 1.5 + k))
    # Kept at its first calls, then at every RETRY-th only.
    assert taped.count(torch.ops.aten.pow.Tensor_Scalar) == defer_replay.STRIKES + 1
