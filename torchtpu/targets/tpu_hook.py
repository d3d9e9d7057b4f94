"""Every program torchtpu builds, also compiled for the TPU target (``TORCHTPU_TPU_TARGET``).

The one place every program reaches is JAX's compile of it: ``compile_or_get_cached``, which each
``jax.jit`` calls once per program and process (a miss of its in-memory cache, a hit of the
persistent one too). So per-op programs (Strict, Debug), DeferAndFuse's fused runs,
``torch.compile`` graphs, captured and whole-step programs, ``jax_op`` and Pallas kernels and
``tpu_dist``'s XLA collectives all get here without knowing of it. When a target is set,
``install()`` (run once as the platform starts: ``runtime/hooks.at_start``) wraps that function:
after the host compile, the program's StableHLO is handed to one background thread that compiles
it for the target (``tpu_target.compile_module``) over as many of its chips as the host program
spans devices, so the host run waits for no TPU compile. Unset, nothing is wrapped: the host
pays nothing.

A program the TPU compiler refuses is a ``torchtpu.tpu`` error naming the program, the user's
line that built it and the compiler's message: raised at the next program the process compiles,
or at ``wait()`` (``TORCHTPU_TPU_TARGET_ON_ERROR=warn`` warns instead). ``reports()`` lists what
was compiled; at exit the thread finishes the compile under way (libtpu must not be torn down
under it) and, unless a caller took the reports, a one-line summary goes to stderr.
"""

from __future__ import annotations

import atexit
import hashlib
import queue
import sys
import threading
import warnings

from torchtpu import settings
from torchtpu.runtime import hooks, notices
from torchtpu.targets import tpu_target

_EXIT_WAIT_SECONDS = 60.0  # a large program compiles in tens of seconds on a loaded host


class TpuCompileError(RuntimeError):
    """The TPU target's compiler refused a program torchtpu built."""


class _State:
    def __init__(self, name: str, on_error: str) -> None:
        self.name = name
        self.on_error = on_error
        self.lock = threading.Lock()
        self.reports: list = []
        self.failed: list = []           # refusals not yet raised
        self.queue: queue.Queue = queue.Queue()
        self.taken = False               # a caller read the reports: no summary at exit
        self.thread = threading.Thread(target=self._work, name="torchtpu-tpu-target",
                                       daemon=True)
        self.thread.start()

    def _work(self) -> None:
        while True:
            job = self.queue.get()
            try:
                if job is None:
                    return
                data, name, module, n, line = job
                try:
                    report = tpu_target.compile_module(data, name=name, kind=_kind(name), n=n,
                                                       target_name=self.name, line=line)
                except tpu_target.TargetError as e:
                    report = tpu_target.Report(name=name, kind=_kind(name), target=self.name,
                                               devices=n, error=str(e), line=line)
                report.module = module
                with self.lock:
                    self.reports.append(report)
                    if not report.compiles:
                        self.failed.append(report)
            finally:
                self.queue.task_done()


_state: _State | None = None
_original = None


def active() -> bool:
    """Whether programs are being compiled for a TPU target."""
    return _state is not None


def install(name: str | None = None, on_error: str | None = None) -> None:
    """Compile every program for the target name (default ``TORCHTPU_TPU_TARGET``; nothing
    when neither is given) too, from now on. ``on_error``: "raise", "warn" (default
    ``TORCHTPU_TPU_TARGET_ON_ERROR``, else raise) or "keep" (only in the reports)."""
    global _state, _original
    name = tpu_target.check_name(name) if name is not None else tpu_target.target_name()
    if name is None:
        return
    if _state is not None:
        if _state.name != name:
            raise tpu_target.TargetError(
                f"torchtpu.tpu: this process compiles for {_state.name} already; one target "
                f"per process (asked for {name})")
        if on_error is not None:
            _state.on_error = on_error
        return
    on_error = on_error or settings.TPU_TARGET_ON_ERROR.get()
    if on_error not in settings.TPU_TARGET_ON_ERROR.choices:
        raise ValueError(f"torchtpu.argument: on_error={on_error!r} is not raise, warn or keep")
    tpu_target.target(name)  # a bad name or libtpu fails here, at import, not in a thread
    from jax._src import compiler

    _original = compiler.compile_or_get_cached
    _state = _State(name, on_error)

    def compile_or_get_cached(backend, computation, devices, *args, **kwargs):
        if getattr(backend, "platform", "") != "tpu":
            # A program over several processes' devices (tpu_dist's XLA collectives) is one
            # SPMD program over that many chips of the target, as JAX compiles it on a slice.
            _submit(computation, int(devices.size))
        return _original(backend, computation, devices, *args, **kwargs)

    compiler.compile_or_get_cached = compile_or_get_cached
    atexit.register(_at_exit)
    # A program loaded by key would skip the compile this hook sees (``cache/warm.py``).
    hooks.watch_every_compile("tpu_hook")
    notices.add_device_note(f"every program is also compiled for the TPU target {name}")


def _submit(computation, n: int) -> None:
    """Queue computation for the target, and give the host program a name of its own.

    Programs of one op at other shapes share a name (``jit_aten_mm_default``); a profile of the
    host run tells them apart only by name, so each gets a suffix from its content (the same in
    every process, so JAX's persistent cache keys stay stable; a trailing ``_<n>`` is what
    ``profiler/xplane.program_key`` drops).
    """
    from jax._src.interpreters import mlir

    state = _state
    _raise_failed(state)
    name = mlir.ir.StringAttr(computation.operation.attributes["sym_name"]).value
    # The bytes are taken here: an MLIR module belongs to the thread that built it.
    if name in _renamed:  # JAX compiles a lowering it keeps again: named and queued before
        return
    data = mlir.module_to_bytecode(computation)
    module = f"{name}_{int.from_bytes(hashlib.sha256(data).digest()[:4], 'big')}"
    computation.operation.attributes["sym_name"] = mlir.ir.StringAttr.get(
        module, context=computation.context)
    _renamed[module] = name
    state.queue.put((data, name, module, n, notices.user_line()))


_renamed: dict = {}  # the names given here -> the builder's


def _raise_failed(state: _State) -> None:
    with state.lock:
        failed, state.failed = state.failed, []
    for report in failed:
        text = _refusal(report)
        if state.on_error == "keep":
            continue
        if state.on_error == "warn":
            warnings.warn(text, RuntimeWarning, stacklevel=4)
        else:
            raise TpuCompileError(text)


def _refusal(report) -> str:
    where = f" (built at {report.line})" if report.line else ""
    error = report.error or ""
    if error.startswith("torchtpu.tpu: "):
        error = error[len("torchtpu.tpu: "):]
    return (f"torchtpu.tpu: the {report.target} compiler refused {report.kind} "
            f"{report.name!r}{where}: {error}")


def _kind(name: str) -> str:
    """What built a program, from the name its builder gave the jitted function."""
    bare = name[4:] if name.startswith("jit_") else name
    if bare.startswith(("aten_", "prims_", "torchtpu_")):
        return "op"
    for prefix, kind in (("_replay", "fused"), ("replay", "capture"), ("captured", "step"),
                         ("graph", "graph"), ("merged", "graph"), ("step", "step"),
                         ("body", "collective"), ("shmap_body", "collective")):
        if bare.startswith(prefix):
            return kind
    return "program"


def wait(timeout: float | None = None) -> list:
    """Wait for every program submitted so far; their reports, in order. A refusal raises (or
    warns, by ``TORCHTPU_TPU_TARGET_ON_ERROR``) here."""
    state = _state
    if state is None:
        return []
    if timeout is None:
        state.queue.join()
    else:
        _join(state.queue, timeout)
    _raise_failed(state)
    return reports()


def _join(q: queue.Queue, timeout: float) -> bool:
    with q.all_tasks_done:
        return q.all_tasks_done.wait_for(lambda: q.unfinished_tasks == 0, timeout)


def reports() -> list:
    """The reports of the programs compiled for the target so far (the caller takes them)."""
    state = _state
    if state is None:
        return []
    with state.lock:
        state.taken = True
        return list(state.reports)


def _at_exit() -> None:
    state = _state
    if state is None:
        return
    # Programs not started yet are dropped; the one under way finishes (bounded).
    dropped = 0
    while True:
        try:
            state.queue.get_nowait()
        except queue.Empty:
            break
        state.queue.task_done()
        dropped += 1
    state.queue.put(None)
    state.thread.join(_EXIT_WAIT_SECONDS)
    if not state.taken:
        with state.lock:
            done = list(state.reports)
        refused = [r for r in done if not r.compiles]
        line = (f"torchtpu.tpu: {len(done)} programs compiled for {state.name}, "
                f"{len(refused)} refused" + (f", {dropped} not compiled (the process exited "
                                             "first)" if dropped else ""))
        print(line + "".join(f"\n  {_refusal(r)}" for r in refused[:5]), file=sys.stderr)


hooks.at_start(install)  # when the platform starts, or now if it has (the target's variable)
