"""Merging a window's device trace into the Chrome trace PyTorch's profiler wrote.

PyTorch writes host events with ``ts`` in microseconds since ``baseTimeNanoseconds`` on the wall
clock; the device trace's times are wall-clock nanoseconds already (``session.py``). Added:
- each launch, on the host thread that made it (``cat: tpu_runtime``), as a CUDA trace shows
  ``cudaLaunchKernel``;
- each program run on the device's track (``pid`` = the device's ordinal, as PyTorch does for
  GPUs; ``cat: tpu_program``), named after what it ran, and its HLO ops on a second thread
  (``cat: tpu_op``);
- a flow arrow from each launch to its run (``cat: ac2g``, PyTorch's name for these);
- each ``record_function`` range again on the device track, over the runs launched inside it.
"""

from __future__ import annotations

import json
import os

from torchtpu.profiler.session import DeviceTrace

PROGRAMS_TID = 0
OPS_TID = 1
RANGES_TID = 2


def _metadata(pid: int, device: int, platform: str, local: int) -> list:
    # This process drives one XLA device as torch's "tpu:0"; any other device is named as such.
    name = f"tpu:0 (XLA {platform}:{device})" if device == local else f"XLA {platform}:{device}"
    return [
        {"ph": "M", "name": "process_name", "pid": pid, "tid": 0, "args": {"name": name}},
        {"ph": "M", "name": "process_labels", "pid": pid, "tid": 0,
         "args": {"labels": f"TPU {device}"}},
        {"ph": "M", "name": "process_sort_index", "pid": pid, "tid": 0,
         "args": {"sort_index": 1000 + device}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": PROGRAMS_TID,
         "args": {"name": "programs"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": OPS_TID,
         "args": {"name": "XLA ops"}},
        {"ph": "M", "name": "thread_name", "pid": pid, "tid": RANGES_TID,
         "args": {"name": "record_function ranges"}},
    ]


def device_ranges(host_events: list, added: list) -> list:
    """Each host ``record_function`` range (and ``ProfilerStep#n``) again on the device track,
    spanning the runs of the programs launched inside it, as PyTorch shows
    ``gpu_user_annotation`` ranges for CUDA. ``added``: ``device_events``' events."""
    launches = {e["args"]["correlation"]: e for e in added if e.get("cat") == "tpu_runtime"}
    runs = [(launches[e["args"]["correlation"]], e) for e in added
            if e.get("cat") == "tpu_program" and "correlation" in e["args"]]
    ranges = []
    for e in host_events:
        if e.get("cat") != "user_annotation" or e.get("ph") != "X":
            continue
        start, end = e["ts"], e["ts"] + e.get("dur", 0)
        inside = [r for la, r in runs if la["tid"] == e.get("tid") and start <= la["ts"] <= end]
        if not inside:
            continue
        first = min(r["ts"] for r in inside)
        last = max(r["ts"] + r["dur"] for r in inside)
        ranges.append({"ph": "X", "cat": "tpu_user_annotation", "name": e["name"],
                       "pid": inside[0]["pid"], "tid": RANGES_TID, "ts": first,
                       "dur": round(last - first, 3), "args": {"programs": len(inside)}})
    return ranges


def device_events(trace: DeviceTrace, base_ns: int, platform: str, local: int) -> list:
    """The Chrome trace events of one window, ``ts`` relative to base_ns."""
    def us(ns: float) -> float:
        return round((ns - base_ns) / 1000, 3)

    def dur(start: float, end: float) -> float:
        return round((end - start) / 1000, 3)

    host = os.getpid()
    events = []
    for i, la in enumerate(trace.launches):
        events.append({"ph": "X", "cat": "tpu_runtime", "name": f"launch {la.label}",
                       "pid": host, "tid": la.tid, "ts": us(la.start_ns),
                       "dur": dur(la.start_ns, la.end_ns), "args": {"correlation": i}})
    for device in sorted({p.device for p in trace.programs}):
        events += _metadata(device, device, platform, local)
    for i, p in enumerate(trace.programs):
        k = trace.launched_by.get(i)
        name = trace.launches[k].label if k is not None else p.module
        args = {"program": p.module, "xla_device": p.device, "ops": len(p.ops)}
        if k is not None:
            args["correlation"] = k
        events.append({"ph": "X", "cat": "tpu_program", "name": name, "pid": p.device,
                       "tid": PROGRAMS_TID, "ts": us(p.start_ns),
                       "dur": dur(p.start_ns, p.end_ns), "args": args})
        for op, start, end in p.ops:
            events.append({"ph": "X", "cat": "tpu_op", "name": op, "pid": p.device,
                           "tid": OPS_TID, "ts": us(start), "dur": dur(start, end),
                           "args": {"program": name}})
        if k is not None:
            la = trace.launches[k]
            events.append({"ph": "s", "cat": "ac2g", "name": "ac2g", "id": k, "pid": host,
                           "tid": la.tid, "ts": us(la.start_ns)})
            events.append({"ph": "f", "cat": "ac2g", "name": "ac2g", "id": k, "bp": "e",
                           "pid": p.device, "tid": PROGRAMS_TID, "ts": us(p.start_ns)})
    return events


def merge(path: str, trace: DeviceTrace, platform: str, local: int) -> None:
    """Add trace's events to the Chrome trace file PyTorch wrote at path."""
    with open(path) as f:
        data = json.load(f)
    base = int(data.get("baseTimeNanoseconds", 0))
    ours = {p.device for p in trace.programs}
    # PyTorch labels pids 0-15 "GPU <n>" ahead of any device; the device's pids are ours.
    events = [e for e in data.get("traceEvents", [])
              if not (e.get("ph") == "M" and e.get("pid") in ours)]
    added = device_events(trace, base, platform, local)
    data["traceEvents"] = events + added + device_ranges(events, added)
    if trace.xprof_run is not None:
        data["tpuXprofRun"] = trace.xprof_run
    with open(path, "w") as f:
        json.dump(data, f)
