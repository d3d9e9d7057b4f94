"""PyTorch/XLA's API on torchtpu (torchtpu/integrations/torch_xla/), compared with CPU.

In this process the layer is imported by its torchtpu name (``import torch_xla`` here would make
other libraries believe PyTorch/XLA is installed); scripts that ``import torch_xla`` run in
subprocesses with the installer's stub on their path.
"""

import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

import torchtpu.integrations.torch_xla as torch_xla
from torchtpu import metrics
from torchtpu.integrations.torch_xla import _autocast, install
from torchtpu.integrations.torch_xla.core import xla_model as xm
from torchtpu.integrations.torch_xla.debug import metrics as met
from torchtpu.integrations.torch_xla.distributed import parallel_loader as pl
from torchtpu.integrations.torch_xla.distributed import spmd as xs
from torchtpu.integrations.torch_xla.utils import utils as xu

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(autouse=True)
def _lazy():
    """Each test starts in PyTorch/XLA's lazy mode (DeferAndFuse) and leaves the mode it found."""
    before = torch.tpu.eager_mode
    torch.tpu.eager_mode = torch.tpu.EagerMode.DEFER_AND_FUSE
    yield
    torch.tpu.eager_mode = before


def _delta(before: dict, key: str) -> int:
    return metrics.snapshot()[key] - before[key]


class _Net(torch.nn.Module):
    def __init__(self):
        super().__init__()
        self.emb = torch.nn.Embedding(50, 16)
        self.fc1, self.fc2 = torch.nn.Linear(16, 32), torch.nn.Linear(32, 50)

    def forward(self, x):
        return self.fc2(torch.relu(self.fc1(self.emb(x))))


def _batches(n):
    g = torch.Generator().manual_seed(1)
    return [(torch.randint(0, 50, (4, 12), generator=g), torch.randint(0, 50, (4, 12), generator=g))
            for _ in range(n)]


def _now(closure, args):
    closure(*args)


def _train(device, step_wrap, loader_wrap, optimizer_step, batches, closure=_now):
    torch.manual_seed(0)
    model = _Net().to(device)
    opt = torch.optim.Adam(model.parameters(), lr=1e-2)

    def step_fn(data, target):
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(data).view(-1, 50), target.view(-1))
        loss.backward()
        optimizer_step(opt)
        return loss

    step = step_wrap(step_fn)
    losses, seen = [], []
    for data, target in loader_wrap(batches):
        seen.append(len(losses))
        loss = step(data, target)
        closure(lambda v: losses.append(v.item()), (loss,))
    return losses, seen, {k: v.detach().cpu() for k, v in model.state_dict().items()}


def test_training_loop_in_pytorch_xla_style_matches_cpu():
    batches = _batches(4)
    cpu_losses, _, cpu_state = _train("cpu", lambda f: f, lambda b: b, lambda o: o.step(),
                                      batches)
    before = metrics.snapshot()
    loader = pl.MpDeviceLoader(xu.SampleGenerator(batches[0], 1), torch_xla.device())
    assert len(loader) == 1
    losses, seen, state = _train(
        torch_xla.device(), lambda f: torch_xla.compile(f, full_graph=True, name="step"),
        lambda b: pl.MpDeviceLoader(b, torch_xla.device()), xm.optimizer_step, batches,
        closure=lambda f, args: xm.add_step_closure(f, args))
    # Each step's closure ran at the next step: the loader marks one before each batch and
    # after the last.
    assert seen == [0, 1, 2, 3] and len(losses) == 4
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu_losses), rtol=1e-4,
                               atol=1e-4)
    for k in cpu_state:
        torch.testing.assert_close(state[k], cpu_state[k], rtol=1e-4, atol=1e-4)
    # One program per step (plus moving the model): compile's region runs as one program.
    assert _delta(before, "executions") <= 4 + 2, metrics.snapshot()
    assert "executions" in met.metrics_report()
    assert met.metric_data("ExecuteTime")[0] == metrics.snapshot()["executions"]


def test_mark_step_runs_what_defer_and_fuse_holds():
    x = torch.arange(8.0, device=xm.xla_device())
    before = metrics.snapshot()
    y = (x * 2 + 1).sin()
    assert not torch.tpu.is_materialized(y)
    order = []
    xm.add_step_closure(lambda: order.append("first"))
    xm.add_step_closure(lambda v: order.append(torch.tpu.is_materialized(v)), args=(y,))
    xm.mark_step()
    assert _delta(before, "executions") == 1
    assert order == ["first", True]  # in order, after the step's program ran
    torch.testing.assert_close(y.cpu(), (torch.arange(8.0) * 2 + 1).sin())
    done = []
    xm.add_step_closure(lambda: done.append(1), run_async=True)
    torch_xla.sync()
    xm.wait_device_ops()
    assert done == [1]
    xm.add_step_closure(lambda: 1 / 0, run_async=True)
    torch_xla.sync()
    with pytest.raises(ZeroDivisionError):
        xm.wait_device_ops()


def test_compile_full_graph_and_graph_limit():
    x = torch.ones(4, device="tpu")

    @torch_xla.compile(full_graph=True)
    def reads(t):
        return (t * 2).sum().item()

    with pytest.raises(RuntimeError, match=r"torchtpu.compile: .*'reads', full_graph=True\) ran "):
        reads(x)
    torch_xla.experimental.eager_mode(True)
    assert torch_xla.experimental.is_eager_mode()
    with torch_xla.compile():  # a region runs lazily even in eager mode, one program at its end
        before = metrics.snapshot()
        y = x + 3
        assert not torch.tpu.is_materialized(y)
    assert torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_NEVER
    assert _delta(before, "executions") == 1 and y.sum().item() == 16
    # The second shape's program is built already (by another region): a different program
    # all the same, whichever cache held it.
    torch_xla.compile(lambda t: t * 5 - 1)(torch.ones(5, 7, device="tpu"))
    limited = torch_xla.compile(lambda t: t * 5 - 1, max_different_graphs=1)
    for _ in range(2):
        limited(torch.ones(3, device="tpu"))
    with pytest.raises(RuntimeError, match="ended in 2 different programs, over "
                                           "max_different_graphs=1"):
        limited(torch.ones(5, 7, device="tpu"))
    with pytest.raises(NotImplementedError, match="torchtpu.unsupported: .*custom_compile"):
        torch_xla.compile(custom_compile_options={"xla_x": 1})


def test_unmapped_names_raise_naming_the_torchtpu_way(tmp_path):
    with pytest.raises(AttributeError, match=r"torchtpu.unsupported: torch_xla.core.xla_model."
                                             r"get_stablehlo .*torch.tpu.pending_hlo"):
        xm.get_stablehlo()
    assert not hasattr(torch_xla, "no_such_thing")
    with pytest.raises(ValueError, match="torchtpu.argument: reduce_type 'avg'"):
        xm.all_reduce("avg", torch.ones(2, device="tpu"))
    with pytest.raises(IndexError, match="torchtpu.device: xla_device\\(1\\)"):
        xm.xla_device(1)
    with pytest.raises(ValueError, match="torchtpu.argument: xmp.spawn\\(nprocs=3\\)"):
        torch_xla.distributed.xla_multiprocessing.spawn(print, nprocs=3)


def test_single_process_ordinals_collectives_and_save(tmp_path):
    assert xm.xrt_world_size() == 1 and torch_xla.runtime.global_ordinal() == 0
    assert xm.is_master_ordinal() and xm.is_master_ordinal(local=False)
    assert torch_xla.runtime.device_type() == "CPU" == xm.xla_device_hw(torch_xla.device())
    x = torch.arange(6.0, device="tpu").view(2, 3)
    r = xm.all_reduce(xm.REDUCE_SUM, x, scale=0.5)  # one replica: a copy, as in PyTorch/XLA
    assert r is not x and torch.equal(r.cpu(), x.cpu())
    torch.testing.assert_close(xm.all_gather(x, dim=1).cpu(), x.cpu())
    torch.testing.assert_close(xm.reduce_scatter(xm.REDUCE_SUM, x, 2.0, 1, 1).cpu(), x.cpu() * 2)
    xm.save({"w": x, "n": 3}, tmp_path / "ckpt.pt")
    loaded = torch.load(tmp_path / "ckpt.pt")
    assert loaded["w"].device.type == "cpu" and torch.equal(loaded["w"], x.cpu())
    assert xm.rendezvous("t", b"p") == [b"p"]
    assert xm.mesh_reduce("m", torch.tensor(2.0), lambda v: sum(v)) == torch.tensor(2.0)


def test_spmd_mesh_on_one_device_and_its_dtensor_meaning():
    from torch.distributed.tensor import Replicate, Shard

    mesh = xs.Mesh(torch.arange(1).numpy(), (1, 1), ("fsdp", "model"))
    xs.set_global_mesh(mesh)
    w = torch.ones(8, 4, device="tpu")
    sharded = xs.mark_sharding(w, mesh, ("fsdp", None))
    assert sharded.global_tensor is w and sharded.sharding_spec == "{replicated}"
    assert xs.placements(mesh, (None, ("fsdp", "model"))) == [Shard(1), Shard(1)]
    assert xs.placements(mesh, ("model", None)) == [Replicate(), Shard(0)]
    assert torch_xla._XLAC._get_xla_sharding_spec(w) == "{replicated}"
    param = torch.nn.Parameter(w)  # the spec belongs to the data, as in PyTorch/XLA
    assert xs.wrap_if_sharded(param).partition_spec == ("fsdp", None)
    assert xs.mark_sharding_with_gradients(w, None, (None, "model")) is w
    with pytest.raises(ValueError, match="partition spec .* 1 entries for a tensor of 2"):
        xs.mark_sharding(w, mesh, ("fsdp",))
    with pytest.raises(ValueError, match="mesh axis 'data' is not one of"):
        xs.mark_sharding(w, mesh, ("data", None))
    with pytest.raises(ValueError, match="Mesh over 2 devices, but the job has 1"):
        xs.Mesh(torch.arange(2).numpy(), (2, 1))
    spec = xs.ShardingSpec(mesh, ("fsdp", None))
    batch = [(torch.ones(2, 3),)]
    assert [b[0].device.type for b in pl.MpDeviceLoader(batch, "tpu", input_sharding=spec)] == [
        "tpu"]
    assert xs.clear_sharding(w) is w and xs.wrap_if_sharded(w) is w


SPAWNED = """
import os, sys
import torch
import torch_xla
import torch_xla.core.xla_model as xm
import torch_xla.runtime as xr


def _mp_fn(index, out):
    x = torch.arange(8.0, device=torch_xla.device()).view(2, 4) + index * 10
    got = {
        "ordinal": (xm.get_ordinal(), xr.world_size(), xm.is_master_ordinal()),
        "sum": xm.all_reduce(xm.REDUCE_SUM, x, scale=0.5).cpu(),
        "max": xm.all_reduce("max", x).cpu(),
        "gather": xm.all_gather(x, dim=1).cpu(),
        "scatter": xm.reduce_scatter(xm.REDUCE_SUM, x, 1.0, scatter_dim=1, shard_count=2).cpu(),
        "groups": xm.all_reduce(xm.REDUCE_SUM, x, groups=[[0], [1]]).cpu(),
        "payloads": xm.rendezvous("tag", f"r{index}".encode()),
    }
    listed = [x.clone(), torch.ones(3, device="tpu", dtype=torch.int64) * (index + 1)]
    xm.all_reduce(xm.REDUCE_SUM, listed)
    got["inplace"] = [t.cpu() for t in listed]
    lin = torch.nn.Linear(4, 1).to(torch_xla.device())
    torch.nn.init.ones_(lin.weight)
    torch.nn.init.zeros_(lin.bias)
    opt = torch.optim.SGD(lin.parameters(), lr=1.0)
    lin(torch.full((1, 4), float(index + 1), device="tpu")).sum().backward()
    xm.optimizer_step(opt, barrier=True)
    got["weight"] = lin.weight.detach().cpu()
    xm.save(got, os.path.join(out, f"rank{index}.pt"), master_only=False)


if __name__ == "__main__":
    try:
        import torch_xla.amp
    except ImportError as e:
        print("refused:", e)
    torch_xla.launch(_mp_fn, args=(sys.argv[1],))
"""


def _run(args, env, timeout=240):
    proc = subprocess.Popen(args, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # the launcher and the ranks it started
        out, _ = proc.communicate()
        raise AssertionError(f"timed out:\n{out}") from None
    return proc.returncode, out


def test_installed_alias_runs_a_script_with_collectives_under_launch(tmp_path):
    site = tmp_path / "site"
    assert install.main(["--target", str(site)]) == 0
    script = tmp_path / "spawned.py"
    script.write_text(SPAWNED)
    env = {**os.environ, "CPU_NUM_DEVICES": "2", "PYTHONPATH": os.pathsep.join(
        [str(site), str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    rc, out = _run([sys.executable, str(script), str(tmp_path)], env)
    assert rc == 0, out
    assert "refused: torchtpu.unsupported: torch_xla.amp" in out
    r0, r1 = (torch.load(tmp_path / f"rank{i}.pt", weights_only=False) for i in range(2))
    x0 = torch.arange(8.0).view(2, 4)
    x1 = x0 + 10
    assert r0["ordinal"] == (0, 2, True) and r1["ordinal"] == (1, 2, False)
    for r in (r0, r1):
        torch.testing.assert_close(r["sum"], (x0 + x1) * 0.5)
        torch.testing.assert_close(r["max"], x1)
        torch.testing.assert_close(r["gather"], torch.cat([x0, x1], dim=1))
        torch.testing.assert_close(r["inplace"][0], x0 + x1)
        assert r["inplace"][1].tolist() == [3, 3, 3]
        assert r["payloads"] == [b"r0", b"r1"]
        # Gradients averaged over the replicas (inputs 1 and 2: mean 1.5) before the step.
        torch.testing.assert_close(r["weight"], torch.full((1, 4), 1 - 1.5))
    torch.testing.assert_close(r0["scatter"], (x0 + x1)[:, :2])
    torch.testing.assert_close(r1["scatter"], (x0 + x1)[:, 2:])
    torch.testing.assert_close(r0["groups"], x0)
    torch.testing.assert_close(r1["groups"], x1)
    assert install.main(["--target", str(site), "--uninstall"]) == 0
    assert not (site / "torch_xla").exists()


def test_installer_refuses_to_sit_beside_a_real_torch_xla(tmp_path, capsys):
    real = tmp_path / "real"
    (real / "torch_xla").mkdir(parents=True)
    (real / "torch_xla" / "__init__.py").write_text("# a real PyTorch/XLA\n")
    code = textwrap.dedent(f"""
        import sys
        from torchtpu.integrations.torch_xla import _autocast, install
        sys.exit(install.main(["--target", {str(tmp_path / "site")!r}]))
        """)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(real), str(ROOT)])}
    rc, out = _run([sys.executable, "-c", code], env, timeout=120)
    assert rc == 2 and "torchtpu.tool: a real PyTorch/XLA is installed" in out, out
    assert "Traceback" not in out and not (tmp_path / "site" / "torch_xla").exists()
    assert install.main(["--target", str(real), "--uninstall"]) == 2
    assert "is not torchtpu's stub" in capsys.readouterr().err
    assert (real / "torch_xla" / "__init__.py").exists()


def test_autocast_xla_is_autocast_on_the_device():
    # What ``import torch_xla`` installs (alias.take_over): PyTorch/XLA scripts' autocast("xla")
    # would otherwise arm the XLA key's autocast, which tpu tensors never reach (float32 steps).
    _autocast.install()
    a, b = torch.randn(4, 8), torch.randn(8, 3)
    with torch.autocast("xla", dtype=torch.bfloat16):
        out = a.to("tpu") @ b.to("tpu")
        assert torch.is_autocast_enabled("xla")
        assert torch.get_autocast_dtype("xla") == torch.bfloat16
    assert not torch.is_autocast_enabled("xla")
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = a @ b
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.cpu(), expected)
