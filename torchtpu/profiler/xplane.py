"""Reading a JAX profile (XSpace, ``*.xplane.pb``): the device programs that ran, and their ops.

Where the device has its own plane (TPU, GPU: ``/device:<KIND>:<n>``), its ``XLA Modules`` line
holds one event per program run and ``XLA Ops`` the HLO ops inside. On XLA:CPU the program runs
on host threads: each HLO op is an event carrying ``hlo_module`` and ``run_id`` stats, and one run
of a program is the span of the ops sharing a ``run_id``. Times are in the profile's own clock
(``clock_offset`` maps them onto the wall clock PyTorch's trace uses).
"""

from __future__ import annotations

import dataclasses
import re

from jax.profiler import ProfileData

from torchtpu.device import control

CLOCK_SYNC = "torchtpu.clock_sync"


@dataclasses.dataclass
class Program:
    """One run of one program on one device (nanoseconds, in the profile's clock)."""

    module: str
    device: int
    start_ns: float
    end_ns: float
    ops: list = dataclasses.field(default_factory=list)   # (name, start_ns, end_ns)


def program_key(name: str) -> str:
    """What a program's XLA module name and the function it was jitted from have in common:
    ``jit_aten_mm_default(12)`` and ``aten_mm_default`` both give ``atenmmdefault``; a trailing
    ``_<n>`` (a graph's number) is dropped, so is JAX's ``jit_`` prefix."""
    name = re.sub(r"\(\d+\)$", "", name)
    if name.startswith("jit_"):
        name = name[4:]
    name = re.sub(r"_\d+$", "", name)
    return re.sub(r"[^0-9a-z]", "", name.lower())


_BARRIER = program_key(control.torchtpu_synchronize.__name__)


def _stats(event) -> dict:
    return dict(event.stats)


def _device_planes(data: ProfileData) -> list:
    found = []
    for plane in data.planes:
        m = re.match(r"/device:[A-Z]+:(\d+)$", plane.name)
        if m:
            found.append((int(m.group(1)), plane))
    return found


def _from_device_planes(planes: list) -> list[Program]:
    programs = []
    for device, plane in planes:
        lines = {line.name: list(line.events) for line in plane.lines}
        runs = [Program(e.name, device, e.start_ns, e.end_ns)
                for e in lines.get("XLA Modules", [])]
        runs.sort(key=lambda p: p.start_ns)
        ops = sorted(lines.get("XLA Ops", []), key=lambda e: e.start_ns)
        k = 0
        for op in ops:
            while k < len(runs) and runs[k].end_ns < op.start_ns:
                k += 1
            if k < len(runs) and runs[k].start_ns <= op.start_ns:
                runs[k].ops.append((op.name, op.start_ns, op.end_ns))
        programs += runs
    return programs


def _from_host_threads(data: ProfileData) -> list[Program]:
    runs: dict = {}
    for plane in data.planes:
        if not plane.name.startswith("/host:"):
            continue
        for line in plane.lines:
            for e in line.events:
                stats = _stats(e)
                module, run_id = stats.get("hlo_module"), stats.get("run_id")
                if module is None or run_id is None:
                    continue
                key = (module, run_id, stats.get("device_ordinal", 0))
                run = runs.get(key)
                if run is None:
                    run = runs[key] = Program(module, int(key[2]), e.start_ns, e.end_ns)
                run.start_ns = min(run.start_ns, e.start_ns)
                run.end_ns = max(run.end_ns, e.end_ns)
                run.ops.append((e.name, e.start_ns, e.end_ns))
    for run in runs.values():
        run.ops.sort(key=lambda op: op[1])
    return list(runs.values())


def programs(data: ProfileData) -> list[Program]:
    """Every program run in the profile, in start order."""
    planes = _device_planes(data)
    found = _from_device_planes(planes) if planes else _from_host_threads(data)
    # ``torch.tpu.synchronize``'s barrier is a wait, not work (as CUDA's synchronize is no kernel).
    return sorted((p for p in found if program_key(p.module) != _BARRIER),
                  key=lambda p: p.start_ns)


def clock_offset(data: ProfileData, readings: list) -> float:
    """Nanoseconds to add to the profile's times to get wall-clock times. ``readings``: the
    wall clock just before and after each ``CLOCK_SYNC`` annotation, in order; the tightest
    pair decides."""
    syncs = sorted((e.start_ns, e.end_ns) for plane in data.planes
                   if plane.name.startswith("/host:") for line in plane.lines
                   for e in line.events if e.name == CLOCK_SYNC)
    if len(syncs) != len(readings):
        raise RuntimeError("torchtpu.profiler: the JAX profile holds "
                           f"{len(syncs)} clock-sync annotations, not {len(readings)}; was host "
                           "tracing turned off?")
    (before, after), (start, end) = min(zip(readings, syncs, strict=True),
                                        key=lambda pair: pair[0][1] - pair[0][0])
    return (before + after) / 2 - (start + end) / 2
