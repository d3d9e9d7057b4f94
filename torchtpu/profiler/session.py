"""One profiling window with ``ProfilerActivity.TPU``: the JAX trace and the launches seen.

``Window.start()`` starts a JAX profiler session (written to the ``TpuProfilerConfig``'s
directory, else to a temporary one) and sets the launch observer (``device/launch.py``), which
records each program launch (label, start and end on the wall clock, thread) and, when an XProf
run is written, wraps it in a JAX ``TraceAnnotation`` so the run shows torch op names.
``Window.stop()`` unsets the observer, stops the JAX session and reads the device's program runs
back from the ``.xplane.pb`` it wrote (``xplane.py``), each matched to the launch that ran it.
"""

from __future__ import annotations

import collections
import dataclasses
import glob
import itertools
import os
import shutil
import tempfile
import threading
import time

import jax
import torch
from jax.profiler import ProfileData, ProfileOptions, TraceAnnotation

from torchtpu.device.hooks import HOOKS
from torchtpu.profiler import xplane
from torchtpu.profiler.config import TpuProfilerConfig

_runs = itertools.count()
# Clock-sync annotations per window; the one whose wall-clock readings lie closest together
# (the thread was not preempted around it) aligns the clocks.
SYNC_SAMPLES = 8


@dataclasses.dataclass
class Launch:
    """One program launch on the host (wall-clock nanoseconds)."""

    label: str
    key: str
    start_ns: int
    end_ns: int
    tid: int


@dataclasses.dataclass
class DeviceTrace:
    """What one window saw: launches, program runs (wall clock) and the launch of each run."""

    launches: list
    programs: list          # xplane.Program, times moved onto the wall clock
    launched_by: dict       # index in programs -> index in launches
    xprof_run: str | None   # the XProf run directory, when one was kept


def label_of(label, fn) -> str:
    """The readable name of what a program runs: ``aten::mm``, ``compiled_forward_0``, ..."""
    if isinstance(label, torch._ops.OpOverload):
        return label.name()  # aten::mm, aten::le.Scalar
    if label is None:
        return getattr(fn, "__name__", type(fn).__name__)
    return str(label)


def _writable(directory: str) -> None:
    try:
        os.makedirs(directory, exist_ok=True)
        with tempfile.TemporaryFile(dir=directory):
            pass
    except OSError as e:
        raise type(e)(e.errno, "torchtpu.profiler: cannot write the XProf trace directory "
                      f"({e.strerror}); give TpuProfilerConfig(run_dir=...) a directory "
                      "you can write", directory) from None


class Window:
    """One profiler window: ``start()``, the profiled code, then ``stop()`` (or ``abort()``)."""

    def __init__(self, config: TpuProfilerConfig | None) -> None:
        self.config = config
        self.launches: list = []
        self._keys: dict = {}
        self._temporary = config is None
        # Torch names in the XProf run: only when one is kept (an annotation costs ~2 us).
        self._annotate = config is not None
        self._directory = None if config is None else config.directory()
        self._session = f"{time.strftime('%Y_%m_%d_%H_%M_%S')}_{os.getpid()}_{next(_runs)}"
        self._sync: list = []

    def _options(self) -> ProfileOptions:
        options = ProfileOptions()
        options.session_id = self._session
        options.python_tracer_level = 0
        if self.config is not None:
            options.host_tracer_level = self.config.host_tracer_level
            options.python_tracer_level = self.config.python_tracer_level
            if self.config.experimental_options:
                options.advanced_configuration = self.config.experimental_options
        return options

    def start(self) -> None:
        if self._temporary:
            self._directory = tempfile.mkdtemp(prefix="torchtpu_profile_")
        else:
            _writable(self._directory)
        try:
            jax.profiler.start_trace(self._directory, profiler_options=self._options())
        except RuntimeError as e:
            self._discard()
            raise RuntimeError("torchtpu.profiler: ProfilerActivity.TPU records through the JAX "
                               f"profiler, which could not start ({e}); stop any "
                               "jax.profiler trace running, or leave ProfilerActivity.TPU "
                               "out") from e
        self._sync = []
        for _ in range(SYNC_SAMPLES):
            before = time.time_ns()
            with TraceAnnotation(xplane.CLOCK_SYNC):
                pass
            self._sync.append((before, time.time_ns()))
        HOOKS.launch_observer = self._observe

    def _key(self, label, fn) -> tuple[str, str]:
        # Cached per program and label (the window holds both until it ends): launching the
        # same program again costs one lookup.
        hit = self._keys.get((fn, label))
        if hit is None:
            name = label_of(label, fn)
            hit = self._keys[(fn, label)] = (
                name, xplane.program_key(getattr(fn, "__name__", None) or name))
        return hit

    def _observe(self, label, fn, args: tuple):
        name, key = self._key(label, fn)
        start = time.time_ns()
        try:
            if self._annotate:
                with TraceAnnotation(name):
                    return fn(*args)
            return fn(*args)
        finally:
            # A plain tuple: a dataclass per launch would cost ~0.4 us more.
            self.launches.append((name, key, start, time.time_ns(), threading.get_native_id()))

    def stop(self) -> DeviceTrace:
        HOOKS.launch_observer = None
        jax.profiler.stop_trace()
        try:
            run = os.path.join(self._directory, "plugins", "profile", self._session)
            files = glob.glob(os.path.join(run, "*.xplane.pb"))
            if not files:
                raise RuntimeError(f"torchtpu.profiler: the JAX profiler wrote no .xplane.pb "
                                   f"under {run}")
            data = ProfileData.from_file(files[0])
            offset = xplane.clock_offset(data, self._sync)
            runs = []
            if self.config is None or self.config.device_tracer_level > 0:
                runs = xplane.programs(data)
            for p in runs:
                p.start_ns += offset
                p.end_ns += offset
                p.ops = [(n, s + offset, e + offset) for n, s, e in p.ops]
            launches = [Launch(*la) for la in self.launches]
            return DeviceTrace(launches, runs, _match(launches, runs),
                               None if self._temporary else run)
        finally:
            self._discard()

    def abort(self) -> None:
        """Stop without reading anything (the profiler failed to start)."""
        HOOKS.launch_observer = None
        try:
            jax.profiler.stop_trace()
        finally:
            self._discard()

    def _discard(self) -> None:
        if self._temporary and self._directory is not None:
            shutil.rmtree(self._directory, ignore_errors=True)


# How far a run may seem to start before its launch: the clock alignment's error.
ALIGNMENT_SLACK_NS = 1000


def _match(launches: list, runs: list) -> dict:
    """Each program run's launch: the earliest not yet matched launch of the same program (a
    device runs one program's launches in order) that began before the run. A run that starts
    before any such launch was launched before the window (work still queued when profiling
    began) and has none."""
    waiting: dict = collections.defaultdict(collections.deque)
    for k in sorted(range(len(launches)), key=lambda k: launches[k].start_ns):
        waiting[launches[k].key].append(k)
    matched = {}
    for i, run in enumerate(runs):
        queue = waiting.get(xplane.program_key(run.module))
        if queue and launches[queue[0]].start_ns <= run.start_ns + ALIGNMENT_SLACK_NS:
            matched[i] = queue.popleft()
    return matched
