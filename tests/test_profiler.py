"""torch.profiler on device "tpu": the Chrome trace and the XProf run are written, read back and
checked (device programs present, named after their ops, in launch order, inside the host window
that waited for them)."""

import contextlib
import glob
import gzip
import json
import os

import pytest
import torch
from jax.profiler import ProfileData
from torch.profiler import (
    ProfilerActivity,
    profile,
    record_function,
    schedule,
    tensorboard_trace_handler,
)

from torchtpu.device.hooks import HOOKS

ACTIVITIES = [ProfilerActivity.CPU, ProfilerActivity.TPU]


def _events(path):
    with open(path) as f:
        return json.load(f)["traceEvents"]


def _programs(events):
    return sorted((e for e in events if e.get("cat") == "tpu_program"), key=lambda e: e["ts"])


def _step(x, w):
    loss = torch.relu(x @ w).sum()
    loss.backward()
    return loss.item()


def test_chrome_trace_holds_device_programs_aligned_with_host(tmp_path):
    x = torch.randn(8, 8, device="tpu")
    w = torch.randn(8, 8, device="tpu", requires_grad=True)
    _step(x, w)  # compiled before the window
    w.grad = None
    torch.tpu.synchronize()  # the warm-up's backward runs must not fall inside the window
    assert ProfilerActivity.TPU is ProfilerActivity.PrivateUse1
    with profile(activities=ACTIVITIES) as prof:
        with record_function("train_step"):
            value = _step(x, w)
    assert HOOKS.launch_observer is None
    xc, wc = x.cpu(), w.detach().cpu().requires_grad_()
    assert value == pytest.approx(_step(xc, wc), rel=1e-5)
    torch.testing.assert_close(w.grad.cpu(), wc.grad)

    path = str(tmp_path / "trace.json")
    prof.export_chrome_trace(path)
    events = _events(path)
    programs = _programs(events)
    names = [e["name"] for e in programs]
    assert names.index("aten::mm") < names.index("aten::sum"), names
    assert names.count("aten::mm") == 2  # forward, and the weight gradient
    assert all(e["pid"] == 0 and e["tid"] == 0 for e in programs)
    assert any(e.get("ph") == "M" and e["name"] == "process_name" and e["pid"] == 0
               and e["args"]["name"].startswith("tpu:0") for e in events)
    assert any(e.get("cat") == "cpu_op" and e["name"] == "aten::mm" for e in events)
    # The forward's chain of dependent programs runs in launch order (XLA:CPU may run an
    # independent program, a backward one that needs no forward value, ahead of them).
    # (Strict holds the comparison with a number, and since strict9 the where over it too:
    # backward's program reading the where computes both.)
    chain = ["aten::mm", "aten::sum"]
    firsts = [next(e for e in programs if e["name"] == n) for n in chain]
    assert [e["args"]["correlation"] for e in firsts] == sorted(
        e["args"]["correlation"] for e in firsts)
    assert [e["ts"] for e in firsts] == sorted(e["ts"] for e in firsts)
    # Aligned: each run starts after its launch, inside the profiled window; the forward's runs
    # end inside the range whose .item() waited for them (backward's may end later).
    (step,) = [e for e in events if e.get("cat") == "user_annotation"]
    (window,) = [e for e in events if e.get("cat") == "Trace"]
    launches = {e["args"]["correlation"]: e for e in events if e.get("cat") == "tpu_runtime"}
    matched = [e for e in programs if "correlation" in e["args"]]
    assert len(matched) >= len(programs) - 1 and matched
    for e in matched:
        la = launches[e["args"]["correlation"]]
        assert la["name"] == "launch " + e["name"]
        assert step["ts"] <= la["ts"] <= e["ts"] + 1.0
        assert e["ts"] + e["dur"] <= window["ts"] + window["dur"]
    (total,) = [e for e in matched if e["name"] == "aten::sum"]
    assert total["ts"] + total["dur"] <= step["ts"] + step["dur"]
    # The record_function range again on the device track, over the runs launched inside it by
    # its thread (backward's launches come from the autograd thread).
    (ranged,) = [e for e in events if e.get("cat") == "tpu_user_annotation"]
    assert ranged["name"] == "train_step" and ranged["pid"] == 0
    own = [e for e in matched if launches[e["args"]["correlation"]]["tid"] == step["tid"]]
    assert ranged["ts"] == own[0]["ts"] and ranged["args"]["programs"] == len(own) < len(matched)
    flows = [e for e in events if e.get("cat") == "ac2g"]
    assert len(flows) == 2 * len(matched)
    assert torch.tpu.profiler.device_trace(prof).programs
    _check_device_times(prof, programs, matched)


def _check_device_times(prof, programs, runs):
    """key_averages() as for CUDA: each op's self device time is that of the programs it
    launched, its total adds its children's, and each program is an event on the device."""
    averages = {e.key: e for e in prof.key_averages()}
    mm_runs = [e["dur"] for e in runs if e["name"] == "aten::mm"]
    mm = averages["aten::mm"]
    assert mm.count == 2 and mm.self_device_time_total == pytest.approx(sum(mm_runs), abs=0.01)
    matmul = averages["aten::matmul"]  # x @ w: matmul calls mm, which launches
    assert matmul.self_device_time_total == 0
    assert matmul.device_time_total == pytest.approx(mm_runs[0], abs=0.01)
    module = next(e["args"]["program"] for e in runs if e["name"] == "aten::mm")
    assert averages[module].device_type == torch.autograd.DeviceType.PrivateUse1
    runs_of_module = [e["dur"] for e in programs if e["args"]["program"] == module]
    assert averages[module].count == len(runs_of_module) >= 2
    assert averages[module].self_device_time_total == pytest.approx(sum(runs_of_module), abs=0.01)
    assert averages[module].cpu_time_total == 0
    table = prof.key_averages().table(sort_by="self_device_time_total", row_limit=-1)
    assert "Self TPU" in table and "TPU total" in table
    assert "Self TPU time total" in table


def test_xprof_run_with_torch_names_deferred_and_compiled(tmp_path, fresh_dynamo):
    x = torch.randn(8, 8, device="tpu")
    fn = torch.compile(lambda a: torch.sin(a) * 2, backend="tpu")
    fn(x)
    graph = torch.tpu.TPUGraph()
    with torch.tpu.graph(graph):
        captured = torch.cos(x) + 1
    config = torch.tpu.profiler.TpuProfilerConfig(run_dir=str(tmp_path / "logs"))
    with profile(activities=ACTIVITIES, experimental_config=config) as prof:
        y = (x @ x).sum()
        z = fn(x)
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            d = (x + 1) * x
        values = y.item(), z.cpu(), d.cpu()
        graph.replay()
        torch.testing.assert_close(captured.cpu(), torch.cos(x.cpu()) + 1)
    torch.testing.assert_close(values[1], torch.sin(x.cpu()) * 2)
    torch.testing.assert_close(values[2], (x.cpu() + 1) * x.cpu())

    (xplane,) = glob.glob(str(tmp_path / "logs" / "plugins" / "profile" / "*" / "*.xplane.pb"))
    data = ProfileData.from_file(xplane)
    names = {e.name for plane in data.planes for line in plane.lines for e in line.events}
    assert {"aten::mm", "aten::sum"} <= names  # the TraceAnnotations around launches
    assert any(n.startswith("compiled_inference_") for n in names)
    assert any(n.startswith("defer_and_fuse[") for n in names)
    modules = {dict(e.stats).get("hlo_module") for plane in data.planes
               for line in plane.lines for e in line.events}
    assert {"jit_aten_mm_default", "jit_compiled_inference", "jit_defer_and_fuse"} <= modules

    path = str(tmp_path / "trace.json.gz")
    prof.export_chrome_trace(path)
    with gzip.open(path) as f:
        trace = json.load(f)
    assert trace["tpuXprofRun"] == os.path.dirname(xplane)
    names = [e["name"] for e in _programs(trace["traceEvents"])]
    assert names[:2] == ["aten::mm", "aten::sum"]
    assert any(n.startswith("compiled_inference_") for n in names)
    assert any(n.startswith("defer_and_fuse[2 ops]") for n in names), names
    assert names[-1] == "captured_graph[2 ops]", names


def test_schedule_and_tensorboard_handler_write_one_trace_per_cycle(tmp_path):
    x = torch.randn(4, 4, device="tpu")
    (x * 3).sum().item()
    with profile(activities=ACTIVITIES, schedule=schedule(wait=1, warmup=1, active=1, repeat=2),
                 on_trace_ready=tensorboard_trace_handler(str(tmp_path), worker_name="w")) as p:
        for _ in range(6):
            (x * 3).sum().item()
            p.step()
    files = sorted(glob.glob(str(tmp_path / "w.*.pt.trace.json")))
    assert len(files) == 2
    windows = []
    for f in files:
        programs = _programs(_events(f))
        # One step's programs: the sum's, which computes the multiply by a Python number Strict
        # held, after the multiply's own where the sum's call read it computed (seen in the
        # full suite), under the name Strict gives it launched at once.
        names = [e["name"] for e in programs]
        assert names in (["aten::sum"], ["aten::mul.Tensor", "aten::sum"]), names
        windows.append((programs[0]["ts"], programs[-1]["ts"]))
    assert windows[0][1] < windows[1][0]


def test_a_held_call_computed_later_is_named_after_its_op(tmp_path):
    # Strict holds ``x * 3`` (a pointwise call of one tensor) for its reader's program; a reader
    # that cannot compute it (a host read) launches its program alone, under the op's name,
    # as Strict names the same program launched at once.
    x = torch.randn(4, 4, device="tpu")
    names = []
    for lazy in (True, False):
        (x * 3).cpu()  # compiled before the window
        with profile(activities=ACTIVITIES) as prof, _lazy_ops(lazy):
            y = x * 3
            torch.testing.assert_close(y.cpu(), x.cpu() * 3)
        path = str(tmp_path / f"lazy_{lazy}.json")
        prof.export_chrome_trace(path)
        names.append([e["name"] for e in _programs(_events(path))])
    assert names == [["aten::mul.Tensor"], ["aten::mul.Tensor"]], names


@contextlib.contextmanager
def _lazy_ops(on: bool):
    from torchtpu.eager.executor import Strict

    held = Strict.lazy_ops
    Strict.lazy_ops = on
    try:
        yield
    finally:
        Strict.lazy_ops = held


def test_unwritable_trace_directory_names_the_path(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    bad = str(blocker / "logs")
    config = torch.tpu.profiler.TpuProfilerConfig(run_dir=bad)
    x = torch.randn(4, 4, device="tpu")
    with pytest.raises(OSError, match="cannot write the XProf trace directory") as info:
        with profile(activities=ACTIVITIES, experimental_config=config):
            x.sum()
    assert bad in str(info.value)
    assert HOOKS.launch_observer is None
    # Nothing was left running: the next profile works.
    with profile(activities=ACTIVITIES) as prof:
        x.sum().item()
    with pytest.raises(OSError, match="cannot write the Chrome trace") as info:
        prof.export_chrome_trace(str(blocker / "trace.json"))
    assert str(blocker / "trace.json") in str(info.value)


def test_config_rejects_bad_levels():
    with pytest.raises(ValueError, match="host_tracer_level"):
        torch.tpu.profiler.TpuProfilerConfig(host_tracer_level=0)
    with pytest.raises(ValueError, match="device_tracer_level"):
        torch.tpu.profiler.TpuProfilerConfig(device_tracer_level=2)
    with pytest.raises(TypeError, match="run_dir"):
        torch.tpu.profiler.TpuProfilerConfig(run_dir=3)


def test_legacy_profiler_without_kineto_says_what_to_do():
    with pytest.raises(RuntimeError, match="use_kineto=True"):
        with torch.autograd.profiler.profile(use_device="tpu"):
            pass
    assert HOOKS.launch_observer is None


# Run by a Python that has XProf (TORCHTPU_XPROF_PYTHON): its trace viewer's view of the run.
_XPROF_READ = """
import sys
from xprof.convert import raw_to_tool_data
data, _ = raw_to_tool_data.xspace_to_tool_data([sys.argv[1]], "trace_viewer", {})
sys.stdout.write(data if isinstance(data, str) else data.decode())
"""


@pytest.mark.skipif(not os.environ.get("TORCHTPU_XPROF_PYTHON"),
                    reason="set TORCHTPU_XPROF_PYTHON to a Python with the xprof extra "
                           "(xprof==2.24.2, pyproject.toml) to open the run with XProf")
def test_xprof_opens_the_run(tmp_path):
    import subprocess

    x = torch.randn(8, 8, device="tpu")
    config = torch.tpu.profiler.TpuProfilerConfig(run_dir=str(tmp_path))
    with profile(activities=ACTIVITIES, experimental_config=config):
        (x @ x).sum().item()
    (xplane,) = glob.glob(str(tmp_path / "plugins" / "profile" / "*" / "*.xplane.pb"))
    out = subprocess.run([os.environ["TORCHTPU_XPROF_PYTHON"], "-c", _XPROF_READ, xplane],
                         capture_output=True, text=True, timeout=120, check=True).stdout
    trace = json.loads(out)
    names = {e.get("name") for e in trace["traceEvents"]}
    assert {"aten::mm", "aten::sum"} <= names
    assert "jit_aten_mm_default" in out  # the program's module, on its ops' events
