"""Compiled graphs inside a graph capture (``compile/backend.CompiledGraph._recorded``): a
``torch.compile``'d block called inside ``torch.tpu.graph`` (or a whole-step ``torch.compile``,
as a TorchTitan model compiled per block runs inside a captured FSDP2 step) is recorded into the
capture like an eager op, its forward and backward graphs inside the one captured program."""

import pytest
import torch
from torch import nn

from torchtpu import metrics
from torchtpu.device.hooks import HOOKS
from torchtpu.eager.capture import CaptureError

STEPS = 5


def _net(device: str, compiled: bool) -> nn.Sequential:
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 16), nn.Tanh(),
                        nn.Linear(16, 3)).to(device)
    if compiled:  # the middle block compiled, the rest eager: both inside the capture
        net[2] = torch.compile(net[2], backend="tpu")
    return net


def _batches() -> list:
    gen = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 6, generator=gen), torch.randn(8, 3, generator=gen))
            for _ in range(STEPS)]


def _cpu_losses() -> list:
    net = _net("cpu", compiled=False)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05)
    losses = []
    for x, y in _batches():
        loss = nn.functional.mse_loss(net(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        losses.append(loss.item())
    return losses


def test_a_compiled_block_inside_a_capture_is_part_of_the_one_program():
    net = _net("tpu", compiled=True)
    opt = torch.optim.AdamW(net.parameters(), lr=0.05, capturable=True)
    batches = _batches()
    sx, sy = (t.to("tpu") for t in batches[0])

    def step():
        loss = nn.functional.mse_loss(net(sx), sy)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=False)
        return loss

    losses = [step().item()]  # warm-up: the optimizer's state, the compiled graphs
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        static_loss = step()
    launched: list = []
    for x, y in batches[1:]:
        sx.copy_(x)
        sy.copy_(y)
        runs = metrics.snapshot().get("executions", 0)
        HOOKS.launch_observer = lambda label, fn, args: (launched.append(str(label)), fn(*args))[1]
        try:
            g.replay()
        finally:
            HOOKS.launch_observer = None
        # One program per replay: the compiled block's forward and backward programs are not
        # launched on their own.
        assert metrics.snapshot().get("executions", 0) - runs == 1
        losses.append(static_loss.item())
    assert [label.split("[")[0] for label in launched] == ["captured_graph"] * (STEPS - 1)
    torch.testing.assert_close(losses, _cpu_losses(), rtol=1e-5, atol=1e-6)


def test_a_dynamic_compiled_graph_inside_a_capture_raises_a_clear_error():
    block = torch.compile(nn.Linear(4, 4).to("tpu"), backend="tpu", dynamic=True)
    for n in (3, 5):  # sizes seen to vary: its graph is padded to size buckets
        block(torch.randn(n, 4, device="tpu"))
    x = torch.randn(6, 4, device="tpu")
    with pytest.raises(CaptureError, match="compiled inference graph with dynamic sizes inside a "
                                           "graph capture"), torch.no_grad():
        with torch.tpu.graph(torch.tpu.TPUGraph()):
            block(x)
