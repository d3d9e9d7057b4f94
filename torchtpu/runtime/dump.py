"""``TORCHTPU_DUMP=dir``: every program torchtpu builds, written out as XLA sees it.

Each program's StableHLO (what torchtpu hands XLA) and optimized HLO (what XLA made of it, read
back from the executable, so programs found in the persistent cache are dumped too) go to
``dir/<n>-<program>.stablehlo.mlir`` and ``dir/<n>-<program>.hlo.txt``. ``<program>`` is the name
torchtpu gave the jitted function (``jit_aten_mm_default`` for an op, ``jit_compiled_forward``,
``_backward`` or ``_inference`` for a compiled graph, ``jit_captured_...`` / ``jit_replay_...``
for captured steps, ``jit__replay_...`` for a DeferAndFuse run); ``<n>`` numbers the programs in
the order this process built them, and each file's first line names the user line that built
it. Every program reaches XLA through JAX's ``compile_or_get_cached``, so wrapping it once here
covers every executor, the compiled path, captures, kernels and collectives. Unset, nothing is
wrapped. ``torch.tpu._set_dump_on_cache_miss`` writes the same files for the programs the
compile cache did not have (``cache/cache_policy.py`` sets the directory, ``dump_misses_to``, and
names each miss, ``note_miss``).

XLA's own switches pass through ``XLA_FLAGS`` as with any JAX program (for example
``--xla_dump_to=dir --xla_dump_hlo_pass_re=.*`` for every pass, ``--xla_cpu_enable_fast_math``,
``--xla_force_host_platform_device_count=N`` for N CPU devices).
"""

from __future__ import annotations

import itertools
import threading
from pathlib import Path

from jax._src import compiler
from jax._src.interpreters import mlir

from torchtpu import settings
from torchtpu.runtime import notices

_lock = threading.Lock()
_count = itertools.count()
_installed: list = []
_every: list = []  # TORCHTPU_DUMP's directory
_misses: list = []  # [the directory of the programs the compile cache missed], while set
_miss = threading.local()  # set by note_miss(), read by the compile that follows (this thread)


def install() -> None:
    """Wrap JAX's compile once if ``TORCHTPU_DUMP`` names a directory (made if missing)."""
    raw = settings.DUMP.get()
    if not raw or _every:
        return
    out = Path(raw).expanduser()
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise RuntimeError(f"torchtpu.config: {settings.DUMP.name}={raw!r} cannot be made a "
                           "directory: "
                           f"{e.strerror}") from None
    _every.append(out)
    install_wrapper()


def active() -> bool:
    """Whether ``TORCHTPU_DUMP`` writes programs out in this process."""
    return bool(_every)


def dump_misses_to(directory: Path | None) -> None:
    """Write each program the compile cache misses to directory (None: stop); the cache says
    which through ``note_miss`` (``cache/cache_policy.py``)."""
    if directory is not None:
        install_wrapper()
    with _lock:
        _misses[:] = [] if directory is None else [directory]


def misses_directory() -> Path | None:
    """Where the programs the compile cache misses are written (None: nowhere)."""
    return (_misses or [None])[0]


def note_miss(key: str) -> None:
    """The compile cache had no entry for key: the compile under way on this thread is a miss."""
    _miss.key = key


def take_miss() -> str | None:
    """The key this thread's last cache read missed (cleared)."""
    key = getattr(_miss, "key", None)
    _miss.key = None
    return key


def install_wrapper() -> None:
    """Wrap JAX's compile once: every program goes to ``TORCHTPU_DUMP``'s directory, and those
    the compile cache missed to ``misses_directory()`` (when set)."""
    with _lock:
        if _installed:
            return
        _installed.append(True)
    original = compiler.compile_or_get_cached

    def compile_or_get_cached(backend, computation, devices, *args, **kwargs):
        every, misses = (_every or [None])[0], misses_directory()
        if every is None and misses is None:
            return original(backend, computation, devices, *args, **kwargs)
        name = mlir.ir.StringAttr(computation.operation.attributes["sym_name"]).value
        stablehlo = mlir.module_to_string(computation)
        take_miss()
        executable = original(backend, computation, devices, *args, **kwargs)
        missed = take_miss() is not None
        for out in (every, misses if missed else None):
            if out is not None:
                _write(out, name, backend, stablehlo, executable)
        return executable

    compiler.compile_or_get_cached = compile_or_get_cached


def _write(out: Path, name: str, backend, stablehlo: str, executable) -> None:
    with _lock:
        stem = out / f"{next(_count):05d}-{name}"
    header = f"// built at {notices.user_line() or '?'} on {backend.platform}\n"
    stem.with_suffix(".stablehlo.mlir").write_text(header + stablehlo)
    try:
        hlo = "\n".join(m.to_string() for m in executable.hlo_modules())
    except Exception as e:  # noqa: BLE001 (a runtime that cannot give its HLO back)
        hlo = f"// the executable gave no HLO: {e}"
    stem.with_suffix(".hlo.txt").write_text(header + hlo)
