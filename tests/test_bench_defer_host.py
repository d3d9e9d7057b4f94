"""bench/defer_host.py (DeferAndFuse's host CPU per step, split, beside the whole step's) runs on
XLA:CPU at tiny dims, in a child process (its split wraps torchtpu's functions for good): steady
steps load nothing, and the split's parts are inside the host's. Its thread clocks count another
thread's CPU where ``/proc/<tid>/schedstat`` is missing (gVisor, the chip host's sandbox)."""

import builtins
import gc
import importlib.util
import json
import os
import subprocess
import sys
import threading
import time

import pytest

_ROOT = os.path.join(os.path.dirname(os.path.abspath(__file__)), os.pardir)
_spec = importlib.util.spec_from_file_location(
    "bench_defer_host", os.path.join(_ROOT, "bench", "defer_host.py"))
defer_host = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(defer_host)


def test_thread_cpu_counts_another_thread_without_schedstat(monkeypatch):
    real_open = builtins.open

    def open_without_schedstat(path, *args, **kwargs):
        if str(path).endswith("/schedstat"):
            raise FileNotFoundError(path)
        return real_open(path, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", open_without_schedstat)
    (started, spun, go, end), tid = (threading.Event() for _ in range(4)), []

    def spin():
        tid.append(threading.get_native_id())
        started.set()
        go.wait()
        t = time.thread_time()
        while time.thread_time() - t < 0.05:
            pass
        spun.set()
        end.wait()  # alive while its clock is read

    worker = threading.Thread(target=spin, daemon=True)
    worker.start()
    started.wait()
    before = defer_host._cpu_of(tid)
    go.set()
    spun.wait()
    after = defer_host._cpu_of(tid)
    end.set()
    worker.join()
    assert after - before >= 0.04  # the worker's CPU, not this thread's (which only waited)


def test_gc_clock_counts_collections_inside_its_block():
    with defer_host.GcClock() as clock:
        gc.collect()
        gc.collect(0)
    assert clock.counts[2] >= 1 and clock.counts[0] >= 1 and clock.ms > 0
    gc.collect()
    assert clock.counts[2] in (1, 2) and clock._observe not in gc.callbacks


@pytest.mark.full  # compiles the fused step and the whole step (~10 s each on XLA:CPU)
def test_defer_host_splits_a_steady_step(tmp_path):
    path = tmp_path / "h.json"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([_ROOT, os.environ.get("PYTHONPATH", "")]))
    subprocess.run([sys.executable, os.path.join(_ROOT, "bench", "defer_host.py"), "--small",
                    "--layers", "1", "--rounds", "2", "--steps", "1", "--split",
                    "--json", str(path)], check=True, env=env, timeout=600)
    out = json.loads(path.read_text())
    defer, whole = out["defer"]["median"], out["whole"]["median"]
    assert defer["loads"] == 0 and whole["loads"] == 0
    assert defer["executions"] == 1 and defer["deferred_ops"] > 100
    assert defer["host_us_per_op"] > 0 and whole["host_cpu_ms"] > 0
    # The op path and the flush's parts are within what the recording threads spent.
    assert 0 < defer["op_path.record"] < defer["op_path"] < defer["host_cpu_ms"]
    assert defer["flush.key_lookup"] > 0 and defer["flush"] <= defer["read_cpu_ms"] + 1


def _defer_chip():
    spec = importlib.util.spec_from_file_location(
        "bench_defer_chip", os.path.join(_ROOT, "bench", "defer_chip.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_host_clock_keeps_the_thread_listing_out_of_its_clocks(monkeypatch):
    """On the chip host each listing reads /proc once a thread (many, under gVisor): a step's
    wall and CPU are the step's alone."""
    defer_chip = _defer_chip()
    listings = defer_host._autograd_threads

    def slow_listing():
        t = time.thread_time()
        while time.thread_time() - t < 0.05:  # as a slow /proc would, in CPU and in wall
            pass
        return listings()

    monkeypatch.setattr(defer_host, "_autograd_threads", slow_listing)
    monkeypatch.setattr(defer_chip, "defer_host", defer_host)
    with defer_chip.HostClock() as clock:
        pass
    assert clock.wall_ms < 20 and clock.ms < 20


def test_clock_check_reads_the_busy_loop_and_the_threads():
    check = _defer_chip().clock_check(busy_s=0.05)
    assert check["threads"] >= 1 and check["listing_ms"] > 0
    assert 0 < check["busy_cpu_per_wall"] <= 1.05


def test_count_calls_charges_each_call_to_its_outermost_tpu_entry():
    import torch

    x, y = torch.ones(3, 4, device="tpu"), torch.full((3, 4), 2.0, device="tpu")
    w = torch.ones(4, 4, device="tpu", requires_grad=True)

    def step(a, b):
        loss = (a @ w * b).sum()
        loss.backward()  # backward's thread counted too, from the loss's node on
        return loss

    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        out = defer_host.count_calls(step, x, y, 20)
    assert out["loss"] == 96.0
    top = {label: (calls, entries) for calls, entries, _, label in out["top"]}
    assert top["kernel aten.mm.default"][1] >= 2  # the forward's and the weight gradient's
    assert top["kernel aten.mul.Tensor"][1] >= 2
    assert out["total"] == sum(calls for calls, _, _, _ in out["top"])
    assert out["in_tpu_entries"] == sum(entries for _, entries, _, _ in out["top"])
