"""Captured steps (torch.tpu.TPUGraph, torch.tpu.graph, make_graphed_callables): one program per
replay, the same losses as eager training, guards that raise, RNG that advances, host reads
that raise at the user's line."""

import inspect

import numpy as np
import pytest
import torch

from torchtpu import metrics

N, D_IN, H, D_OUT = 16, 12, 20, 6


def _net(dropout: float = 0.0, device: str = "tpu") -> torch.nn.Module:
    torch.manual_seed(3)
    return torch.nn.Sequential(torch.nn.Linear(D_IN, H), torch.nn.Dropout(dropout),
                               torch.nn.GELU(), torch.nn.Linear(H, D_OUT)).to(device)


def _batches(n: int) -> list:
    gen = torch.Generator().manual_seed(4)
    return [(torch.randn(N, D_IN, generator=gen), torch.randn(N, D_OUT, generator=gen))
            for _ in range(n)]


def _adamw(model, capturable: bool = True):
    return torch.optim.AdamW(model.parameters(), lr=0.02, weight_decay=0.1, capturable=capturable)


def _cpu_training(batches, schedule=None) -> list:
    """The losses of the same training on CPU (AdamW's capturable form is for devices only)."""
    model = _net(device="cpu")
    opt = _adamw(model, capturable=False)
    losses = []
    for i, (x, y) in enumerate(batches):
        if schedule:
            opt.param_groups[0]["lr"] = schedule(i)
        opt.zero_grad(set_to_none=True)
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses


def _captured(model, opt, static_x, static_y):
    """The whole-network pattern of PyTorch's CUDA Graphs notes, "cuda" -> "tpu"."""
    g = torch.tpu.TPUGraph()
    opt.zero_grad(set_to_none=True)
    with torch.tpu.graph(g):
        static_loss = torch.nn.functional.mse_loss(model(static_x), static_y)
        static_loss.backward()
        opt.step()
    return g, static_loss


def test_whole_step_replay_matches_cpu_training_with_a_scheduled_lr():
    batches = _batches(7)
    schedule = lambda i: 0.02 * 0.8 ** i  # noqa: E731
    expected = _cpu_training(batches, schedule)
    model = _net()
    opt = _adamw(model)
    static_x, static_y = (t.to("tpu") for t in batches[0])
    losses = []
    s = torch.tpu.Stream()
    s.wait_stream(torch.tpu.current_stream())
    with torch.tpu.stream(s):
        for i, (x, y) in enumerate(batches[:3]):  # warm-up: creates the optimizer state
            opt.param_groups[0]["lr"] = schedule(i)
            static_x.copy_(x)
            static_y.copy_(y)
            opt.zero_grad(set_to_none=True)
            loss = torch.nn.functional.mse_loss(model(static_x), static_y)
            loss.backward()
            opt.step()
            losses.append(loss.item())
    torch.tpu.current_stream().wait_stream(s)
    before = [p.detach().cpu() for p in model.parameters()]
    captures = metrics.snapshot().get("captures", 0)
    g, static_loss = _captured(model, opt, static_x, static_y)
    assert metrics.snapshot().get("captures", 0) - captures == 1
    # Capturing records without running: the parameters did not move.
    for p, q in zip(model.parameters(), before, strict=True):
        assert torch.equal(p.detach().cpu(), q)
    runs = metrics.snapshot()["executions"]
    for i, (x, y) in enumerate(batches[3:], start=3):
        opt.param_groups[0]["lr"] = schedule(i)  # an input of the program, not a constant
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
        losses.append(static_loss.item())
    np.testing.assert_allclose(losses, expected, rtol=1e-5, atol=1e-7)
    # Each replay is one program (the copies in are one each, the loss read none), and replays
    # capture nothing.
    assert metrics.snapshot()["executions"] - runs <= 4 * 3
    assert metrics.snapshot().get("captures", 0) - captures == 1
    assert all(p.grad is not None for p in model.parameters())


def test_dropout_masks_differ_between_replays():
    model = _net(dropout=0.5)
    static_x = torch.randn(N, D_IN, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_out = model(static_x)
    outs = []
    for _ in range(2):
        g.replay()
        outs.append(static_out.cpu())
    assert not torch.equal(outs[0], outs[1])


def test_host_read_inside_a_capture_raises_at_the_users_line():
    x = torch.randn(4, device="tpu")
    g = torch.tpu.TPUGraph()
    line = inspect.currentframe().f_lineno + 3
    with pytest.raises(torch.tpu.CaptureError, match=rf"test_graphs.py:{line}"):
        with torch.tpu.graph(g):
            (x * 2).sum().item()
    with pytest.raises(torch.tpu.CaptureError, match="result shape depends on values"):
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            x[x > 0]
    # The aborted capture left the device as it was.
    assert torch.tpu.is_current_stream_capturing() is False
    assert (x + 1).cpu().shape == (4,)


def test_a_gather_by_a_persistent_index_buffer_replays_each_new_index():
    """vLLM's pattern: indices refilled in place between replays, read through a view of their
    buffer. The bounds check of the index is a host read at capture on the CPU platform; inside
    a capture it must not run (its values are not a replay's)."""
    table = torch.randn(10, 3)
    buffer = torch.zeros(8, dtype=torch.long, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = table.to("tpu").index_select(0, buffer[:5]) * 2
    for idx in ([1, 2, 3, 4, 5], [9, 0, 9, 0, 7]):
        buffer[:5].copy_(torch.tensor(idx))
        g.replay()
        torch.testing.assert_close(out.cpu(), table[idx] * 2)


def test_guards_raise_rather_than_replay_stale_programs():
    model = _net()
    sgd = torch.optim.SGD(model.parameters(), lr=0.1)
    static_x, static_y = torch.randn(N, D_IN, device="tpu"), torch.randn(N, D_OUT, device="tpu")
    g, _ = _captured(model, sgd, static_x, static_y)
    g.replay()
    sgd.param_groups[0]["lr"] = 0.05  # SGD's lr is baked into its program: must raise
    with pytest.raises(torch.tpu.CaptureError, match=r"\['lr'\] changed"):
        g.replay()
    sgd.param_groups[0]["lr"] = 0.1
    g.replay()
    sgd.zero_grad(set_to_none=True)
    with pytest.raises(torch.tpu.CaptureError, match="not the tensor the capture used"):
        g.replay()


def test_optimizers_a_replay_could_not_repeat_raise_at_capture():
    model = _net()
    plain = torch.optim.AdamW(model.parameters(), lr=0.01)  # CPU step counts
    static_x, static_y = torch.randn(N, D_IN, device="tpu"), torch.randn(N, D_OUT, device="tpu")
    torch.nn.functional.mse_loss(model(static_x), static_y).backward()
    plain.step()
    with pytest.raises(torch.tpu.CaptureError, match="capturable=True"):
        _captured(model, plain, static_x, static_y)
    cold = _adamw(model)  # no warm-up step: its state would be created inside the capture
    with pytest.raises(torch.tpu.CaptureError, match="warm-up"):
        _captured(model, cold, static_x, static_y)


def test_make_graphed_callables_matches_cpu_forward_and_backward(tmp_path):
    model = _net()
    cpu = torch.nn.Sequential(torch.nn.Linear(D_IN, H), torch.nn.Dropout(0.0),
                              torch.nn.GELU(), torch.nn.Linear(H, D_OUT))
    cpu.load_state_dict({k: v.cpu() for k, v in model.state_dict().items()})
    sample = torch.randn(N, D_IN, device="tpu", requires_grad=True)
    graphed = torch.tpu.make_graphed_callables(model, (sample,), num_warmup_iters=1)
    for x, _ in _batches(2):
        a = x.to("tpu").requires_grad_()
        out = graphed(a)
        out.square().sum().backward()
        b = x.clone().requires_grad_()
        expected = cpu(b)
        expected.square().sum().backward()
        np.testing.assert_allclose(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(a.grad.cpu(), b.grad, rtol=1e-5, atol=1e-6)
        for p, q in zip(model.parameters(), cpu.parameters(), strict=True):
            np.testing.assert_allclose(p.grad.cpu(), q.grad, rtol=1e-5, atol=1e-5)
    with pytest.raises(torch.tpu.CaptureError, match="captured as"):
        graphed(torch.randn(N + 1, D_IN, device="tpu", requires_grad=True))
    model.eval()  # dropout off: not the program that was captured
    with pytest.raises(torch.tpu.CaptureError, match="train/eval"):
        graphed(sample)


def test_debug_dump_writes_the_captured_program(tmp_path):
    x = torch.randn(4, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        y = x.pow(2) + 1
    g.replay()
    np.testing.assert_allclose(y.cpu(), x.cpu() ** 2 + 1, rtol=1e-6)
    g.debug_dump(str(tmp_path / "g.mlir"))
    assert "func.func" in (tmp_path / "g.mlir").read_text()


@pytest.mark.full  # a Dynamo-traced training step (~10 s)
def test_reduce_overhead_compiles_a_training_step_into_captured_programs(fresh_dynamo):
    def train(compile_mode):
        model = _net()
        opt = _adamw(model)

        def step(x, y):
            loss = torch.nn.functional.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 0.5)
            opt.step()
            return loss

        if compile_mode:
            step = torch.compile(step, backend="tpu", mode=compile_mode)
        losses, captures = [], []
        start = metrics.snapshot().get("captures", 0)
        for x, y in _batches(4):
            losses.append(step(x.to("tpu"), y.to("tpu")).item())
            captures.append(metrics.snapshot().get("captures", 0) - start)
        return losses, captures

    expected, _ = train(None)
    losses, captures = train("reduce-overhead")
    np.testing.assert_allclose(losses, expected, rtol=2e-6, atol=1e-7)
    # Captured at the first call; replayed (new batches, new .grad tensors) without capturing.
    assert captures[0] > 0 and captures[-1] == captures[0], captures


def test_reduce_overhead_replays_a_captured_graph(fresh_dynamo):
    @torch.compile(backend="tpu", mode="reduce-overhead")
    def f(x, w):
        return (x @ w).tanh().sum(-1)

    w = torch.randn(D_IN, 3, requires_grad=True)
    wt = w.detach().to("tpu").requires_grad_()
    captures = []
    for x, _ in _batches(3):
        before = metrics.snapshot().get("captures", 0)
        out = f(x.to("tpu"), wt)
        out.sum().backward()
        captures.append(metrics.snapshot().get("captures", 0) - before)
        expected = (x @ w).tanh().sum(-1)
        expected.sum().backward()
        np.testing.assert_allclose(out.detach().cpu(), expected.detach(), rtol=1e-5, atol=1e-6)
        np.testing.assert_allclose(wt.grad.cpu(), w.grad, rtol=1e-5, atol=1e-5)
    # The first call captures a forward and a backward; the others replay them.
    assert captures == [2, 0, 0], captures


def test_a_copy_of_a_value_the_capture_has_not_computed_is_recorded():
    # reshape of a transposed tensor is a clone, copy_ from a value the capture only recorded:
    # asking that value anything but its type would run it (a host read inside the capture).
    x_cpu = torch.randn(4, 6)
    x = x_cpu.to("tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = (x * 2).transpose(0, 1).reshape(-1) + 1
    g.replay()
    torch.testing.assert_close(out.cpu(), (x_cpu * 2).transpose(0, 1).reshape(-1) + 1)


def test_a_stream_context_is_entered_again_and_again_as_cudas_is():
    """SGLang's scheduler keeps ``torch.get_device_module(dev).stream(s)`` and enters it every
    step, and names ``StreamContext`` itself; CUDA's is reusable, so torch.tpu's must be."""
    s = torch.tpu.Stream()
    ctx = torch.tpu.stream(s)
    x = torch.ones(3, device="tpu")
    for _ in range(2):
        with ctx, torch.tpu.StreamContext(s):
            x = x + 1
    assert ctx.stream is s
    assert torch.equal(x.cpu(), torch.full((3,), 3.0))


def test_record_stream_takes_a_tpu_stream_as_fsdp_mixed_precision_does():
    """FSDP's mixed-precision parameters (verl's FSDP actor) call ``tensor.record_stream`` with
    the device module's current stream; torch's binding accepts only a ``torch.Stream``."""
    s = torch.tpu.current_stream()
    assert isinstance(s, torch.Stream) and s.device == torch.device("tpu", 0)
    x = torch.ones(3, device="tpu")
    x.record_stream(s)
    x.record_stream(torch.tpu.Stream())
    assert torch.equal((x + 1).cpu(), torch.full((3,), 2.0))
