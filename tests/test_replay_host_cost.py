"""The short paths of a replay's host work (``eager/replay_io.py``, ``tpu_graph.Guards``) give way
whenever what they skip could have changed: a storage written between replays is read anew, a
storage holding another shape raises, a program handing an input back gets a copy, and every
guarded optimizer change raises after the guard snapshot exists (two replays in)."""

import contextlib
import types

import jax.numpy as jnp
import numpy as np
import pytest
import torch

from torchtpu.eager.replay_io import STORAGE, ReplayIO


def _model(device: str) -> torch.nn.Module:
    torch.manual_seed(5)
    return torch.nn.Sequential(torch.nn.Linear(6, 5), torch.nn.Tanh(),
                               torch.nn.Linear(5, 3)).to(device)


def _step(model, opt, x, y):
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    opt.step()
    return loss


def _graph(model, opt, static_x, static_y):
    for _ in range(2):  # warm-up: the optimizer's state exists before the capture
        opt.zero_grad(set_to_none=True)
        _step(model, opt, static_x, static_y)
    opt.zero_grad(set_to_none=True)
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        loss = _step(model, opt, static_x, static_y)
    return g, loss


def _momentum(model):
    return torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9)


@pytest.mark.parametrize("mode", ["strict", "defer"])
def test_writes_between_replays_are_read_by_the_next_replay(mode):
    """A parameter changed eagerly and a static input refilled between replays: each replay
    reads them (the short path trusts only the arrays the previous replay left), also when
    DeferAndFuse still holds the write pending."""
    with (torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE) if mode == "defer"
          else contextlib.nullcontext()):
        _writes_between_replays()


def _writes_between_replays():
    gen = torch.Generator().manual_seed(1)
    batches = [(torch.randn(4, 6, generator=gen), torch.randn(4, 3, generator=gen))
               for _ in range(6)]
    cpu, tpu = _model("cpu"), _model("tpu")
    cpu_opt, tpu_opt = _momentum(cpu), _momentum(tpu)
    static_x, static_y = batches[0][0].to("tpu"), batches[0][1].to("tpu")
    g, static_loss = _graph(tpu, tpu_opt, static_x, static_y)
    for _ in range(2):
        cpu_opt.zero_grad(set_to_none=True)
        _step(cpu, cpu_opt, *batches[0])
    expected, got = [], []
    for i, (x, y) in enumerate(batches):
        if i in (2, 4):
            with torch.no_grad():
                for model in (cpu, tpu):
                    model[0].weight.mul_(0.5)  # eager, between two replays
        cpu_opt.zero_grad(set_to_none=True)
        expected.append(_step(cpu, cpu_opt, x, y).item())
        static_x.copy_(x)
        static_y.copy_(y)
        g.replay()
        got.append(static_loss.item())
    np.testing.assert_allclose(got, expected, rtol=1e-5, atol=1e-6)
    for p, q in zip(tpu.parameters(), cpu.parameters(), strict=True):
        torch.testing.assert_close(p.detach().cpu(), q.detach(), rtol=1e-5, atol=1e-6)


def test_a_storage_holding_another_shape_raises_after_replays():
    x = torch.randn(8, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        out = x * 2
    for _ in range(2):
        g.replay()
    torch.testing.assert_close(out.cpu(), x.cpu() * 2)
    x.untyped_storage()._tpu_array = jnp.zeros(3, jnp.float32)  # 12 bytes where 32 were
    with pytest.raises(torch.tpu.CaptureError, match="captured shape and dtype"):
        g.replay()


def test_a_program_handing_an_input_back_gives_the_storage_a_copy():
    """Whether results share an argument's buffer is learnt at the first replay: a program
    that does so keeps getting copies, so no two storages share a buffer a donation deletes."""
    read = types.SimpleNamespace(_tpu_array=jnp.arange(4, dtype=jnp.float32))
    written = types.SimpleNamespace(_tpu_array=None)
    io = ReplayIO([(STORAGE, read, ((4,), np.dtype(np.float32)))], [[written]],
                  [((4,), np.dtype(np.float32))])
    for _ in range(3):
        args = io.arguments()
        io.store(args, [args[0]])  # the program's output is its input, the same array
        assert written._tpu_array is not read._tpu_array
        np.testing.assert_array_equal(written._tpu_array, read._tpu_array)


@pytest.mark.parametrize("change", ["state", "data", "grad", "hyperparameter", "group"])
def test_every_guarded_change_raises_once_the_snapshot_exists(change):
    model = _model("tpu")
    opt = _momentum(model)
    static_x, static_y = torch.randn(4, 6, device="tpu"), torch.randn(4, 3, device="tpu")
    g, _ = _graph(model, opt, static_x, static_y)
    for _ in range(3):  # the first replay's full check takes the snapshot; later ones use it
        g.replay()
    p = model[0].weight
    if change == "state":
        opt.state[p]["momentum_buffer"] = opt.state[p]["momentum_buffer"].clone()
    elif change == "data":
        p.data = p.data.clone()
    elif change == "grad":
        p.grad = p.grad.clone()
    elif change == "hyperparameter":
        opt.param_groups[0]["momentum"] = 0.8
    else:
        opt.add_param_group({"params": [torch.zeros(2, device="tpu", requires_grad=True)]})
    with pytest.raises(torch.tpu.CaptureError, match="capture again"):
        g.replay()


def test_a_restored_hyperparameter_replays_again_through_the_short_path():
    """A value changed and changed back (a new float object) passes the full check, which
    takes a new snapshot: replays go on, with the same results as before."""
    model = _model("tpu")
    opt = _momentum(model)
    static_x, static_y = torch.randn(4, 6, device="tpu"), torch.randn(4, 3, device="tpu")
    g, loss = _graph(model, opt, static_x, static_y)
    g.replay()
    opt.param_groups[0]["momentum"] = 0.8
    with pytest.raises(torch.tpu.CaptureError):
        g.replay()
    opt.param_groups[0]["momentum"] = 0.9
    for _ in range(2):
        g.replay()
    assert np.isfinite(loss.item())
