"""One-line notices on stderr for the person watching a run: where the device is, and compiles
that take long.

- At the device's first op (``platform.local_device``), once: the platform and chip that
  "tpu" is here (``XLA:CPU``, a TPU target compiled for without a TPU, a real chip), as
  ``torch.tpu.get_device_name()`` says.
- A compile still running after ``TORCHTPU_SLOW_COMPILE_S`` seconds (default 10; a whole training
  step of a Llama-class model compiles for minutes on a chip): one line naming the program and
  the user's line that built it, and one more with its time when it is done.

They go to the ``torchtpu.notices`` logger, which writes to stderr. ``TORCHTPU_NOTICES=0`` turns
them all off (so does ``logging.getLogger("torchtpu.notices").setLevel(logging.WARNING)``);
``TORCHTPU_SLOW_COMPILE_S=0`` only the compile lines.

``user_line`` finds the user's line that built a program (outside torchtpu, JAX, torch and the
standard library), for these lines, the dump's headers and the TPU target's refusals.
"""

from __future__ import annotations

import dataclasses
import logging
import sys
import threading
import time
import traceback
from pathlib import Path

import jax
import torch

from torchtpu import settings

log = logging.getLogger("torchtpu.notices")


def _on() -> bool:
    return settings.NOTICES.get()


def _logger() -> logging.Logger:
    if not log.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("torchtpu: %(message)s"))
        log.addHandler(handler)
        log.propagate = False
        if log.level == logging.NOTSET:
            log.setLevel(logging.INFO)
    return log


_device_notes: list = []  # what the rooms above add to the device's line


def add_device_note(text: str) -> None:
    """Add text to the line saying where "tpu" runs (the TPU target hook names its target)."""
    if text not in _device_notes:
        _device_notes.append(text)


def device_started(device, platform: str) -> None:
    """Say once where "tpu" runs (called when the process's device is first chosen)."""
    if not _on():
        return
    kind = getattr(device, "device_kind", "unknown")
    where = f"XLA:{platform.upper()} ({kind})"
    if platform == "cpu":
        where += ", a CPU standing in for a TPU"
    also = "".join(f"; {note}" for note in _device_notes)
    processes = f", process {jax.process_index()} of {jax.process_count()}" \
        if jax.process_count() > 1 else ""
    _logger().info(f"device tpu:0 is {where}{processes}, JAX {jax.__version__}{also} "
                   f"({settings.NOTICES.name}=0 silences these lines)")


def slow_after() -> float | None:
    """Seconds after which a compile is announced (None: never)."""
    seconds = settings.SLOW_COMPILE_S.get()
    return seconds if seconds > 0 and _on() else None


@dataclasses.dataclass
class _Compile:
    name: str
    thread: int
    start: float
    line: str | None = None  # the user's line, read when announced
    announced: bool = False


def _for(line: str | None) -> str:
    return f" for {line}" if line else ""


class _Watch:
    """The compiles in flight, and one thread that announces those running past the limit."""

    def __init__(self, after: float) -> None:
        self.after = after
        self.cond = threading.Condition()
        self.running: dict[int, _Compile] = {}
        self.thread: threading.Thread | None = None

    def begin(self, name: str) -> _Compile:
        job = _Compile(name, threading.get_ident(), time.monotonic())
        with self.cond:
            self.running[id(job)] = job
            if self.thread is None:
                self.thread = threading.Thread(target=self._run, name="torchtpu-compile-notices",
                                               daemon=True)
                self.thread.start()
            self.cond.notify()
        return job

    def end(self, job: _Compile) -> None:
        with self.cond:
            self.running.pop(id(job), None)
            announced = job.announced
        if announced:
            _logger().info(f"compiled {job.name}{_for(job.line)} in "
                           f"{time.monotonic() - job.start:.1f} s")

    def _run(self) -> None:
        with self.cond:
            while True:
                now = time.monotonic()
                waiting = [j for j in self.running.values() if not j.announced]
                for job in waiting:
                    if now - job.start >= self.after:
                        job.announced = True
                        job.line = user_line(sys._current_frames().get(job.thread))
                        _logger().info(
                            f"compiling {job.name}{_for(job.line)}, "
                            f"{now - job.start:.0f} s so far (XLA compiles each new program "
                            f"once; {settings.SLOW_COMPILE_S.name}=0 silences this)")
                due = [j.start + self.after for j in waiting if not j.announced]
                self.cond.wait(timeout=max(0.001, min(due) - now) if due else None)


_SKIP = tuple(str(Path(m.__file__).resolve().parent) for m in (
    sys.modules["jax"], sys.modules["torchtpu"])) + (str(Path(threading.__file__).parent),)


def user_line(frame=None) -> str | None:
    """The innermost line outside torchtpu, JAX, torch and the standard library (of the stack
    at frame, another thread's; default: here)."""
    skip = (*_SKIP, str(Path(torch.__file__).resolve().parent))
    for entry in reversed(traceback.extract_stack(frame or sys._getframe(1))):
        path = str(Path(entry.filename).resolve()) if entry.filename[:1] != "<" else ""
        if path and not path.startswith(skip):
            return f"{entry.filename}:{entry.lineno}"
    return None


def install() -> None:
    """Watch every compile (JAX's ``compile_or_get_cached``, which each program reaches)."""
    after = slow_after()
    if after is None:
        return
    from jax._src import compiler
    from jax._src.interpreters import mlir

    watch = _Watch(after)
    original = compiler.compile_or_get_cached

    def compile_or_get_cached(backend, computation, devices, *args, **kwargs):
        name = mlir.ir.StringAttr(computation.operation.attributes["sym_name"]).value
        job = watch.begin(name)
        try:
            return original(backend, computation, devices, *args, **kwargs)
        finally:
            watch.end(job)

    compile_or_get_cached.__wrapped__ = original  # for whoever checks what JAX's compile is
    compiler.compile_or_get_cached = compile_or_get_cached
