"""XLA compiler options for every program torchtpu builds: ``TORCH_TPU_INTERNAL_XLA_OPTIONS``.

The reference's format: a space-separated list of ``key=value`` pairs, for example
``TORCH_TPU_INTERNAL_XLA_OPTIONS="xla_optimization_level=O1 xla_cpu_enable_fast_math=true"``.
Two keys are optimization levels, not XLA debug options: ``xla_optimization_level`` (how hard
XLA works on run time) and ``xla_memory_fitting_level`` (how hard it works to fit in memory),
each ``O0``..``O3`` (JAX's ``optimization_level`` / ``memory_fitting_level`` are the same;
``exec_time_optimization_effort`` / ``memory_fitting_effort`` take a float in [-1, 1]). Every
other key is one of XLA's compile options (the ``xla_*`` fields of its ``DebugOptions``, the
names ``XLA_FLAGS`` takes without the ``--``), passed to each compile as JAX's
``compiler_options`` are. ``true`` / ``false`` in any case are booleans.

In a program, ``custom_compiler_options({...})`` (``torch.tpu.custom_compiler_options``) adds
options for what compiles inside it (the inner of nested ones wins); the variable wins over
both, as in the reference. Options of a jitted call's own (``.compile(compiler_options=)``) win
over all of these.

Every program reaches XLA through JAX's ``get_compile_options`` (``pxla`` asks it for each
program it compiles, and the TPU target, ``tpu_target.py``, for each program it compiles for the
chip), so ``install()`` wraps it once: eager per-op programs, DeferAndFuse runs, compiled graphs,
captured steps, kernels and the TPU target all get the options. A ``xla_tpu_*`` / ``xla_jf_*``
option is one libtpu alone knows: it goes to TPU compiles only (XLA:CPU and XLA:GPU refuse the
name). A name the host compiler does not know, or a value it cannot parse, is refused where it is
set (a ``torchtpu.compile:`` error with XLA's words; the variable's at the first compile).

Keys: JAX's persistent cache hashes the compile options, so a program compiled under other
options is another entry; torchtpu's warm-start index adds ``key()``; and since JAX's in-memory
executable caches know nothing of this setting, changing it in a running process clears them
(``jax.clear_caches()``: every program compiles again, found in the persistent cache when it was
built under these options before).

``XLA_FLAGS`` passes through to XLA as for any JAX program (read once, at the first device use;
part of every key). The ones that matter here: ``--xla_dump_to=DIR`` (with
``--xla_dump_hlo_as_text``, ``--xla_dump_hlo_pass_re=.*``) for every pass's HLO,
``--xla_force_host_platform_device_count=N`` for N CPU devices, ``--xla_cpu_enable_fast_math``,
``--xla_backend_optimization_level=N`` and ``--xla_llvm_disable_expensive_passes`` for compile
time against run time on XLA:CPU; on a TPU ``LIBTPU_INIT_ARGS`` carries libtpu's own flags.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import threading
from collections.abc import Iterator, Mapping

ENV = "TORCH_TPU_INTERNAL_XLA_OPTIONS"
_LEVELS = {"xla_optimization_level": "optimization_level",
           "xla_memory_fitting_level": "memory_fitting_level",
           "optimization_level": "optimization_level",
           "memory_fitting_level": "memory_fitting_level"}
_EFFORTS = ("exec_time_optimization_effort", "memory_fitting_effort")
_TPU_ONLY = ("xla_tpu_", "xla_jf_", "xla_sc_")

_lock = threading.Lock()
_stack: list[dict] = []          # custom_compiler_options contexts, outermost first
_env: list = []                  # [parsed ENV], read once: at the first current() or install
_valid: set = set()              # option sets the host compiler took
_installed: list = []
_unchecked: list = []            # ENV's options, until the first compile has checked them
generation = 0                   # bumped at each change: warm programs look again


def parse(text: str, source: str = ENV) -> dict:
    """``"k1=v1 k2=v2"`` as {name: value}, each value as the compiler takes it."""
    options = {}
    for item in text.split():
        name, sep, value = item.partition("=")
        if not sep or not name or not value:
            raise ValueError(f"torchtpu.compile: {source}: {item!r} is not key=value "
                             f"(the format is space-separated key=value pairs, "
                             f"e.g. 'xla_optimization_level=O1')")
        options[name] = value
    return normalize(options, source)


def normalize(options: Mapping, source: str = "custom_compiler_options") -> dict:
    """options with levels as XLA's effort numbers, efforts as floats, true/false as bools."""
    from jax._src import config

    out = {}
    for name, value in options.items():
        if not isinstance(name, str) or not name:
            raise ValueError(f"torchtpu.compile: {source}: option name {name!r} is not a "
                             "non-empty string")
        if name in _LEVELS:
            if isinstance(value, int) and not isinstance(value, bool):  # normalized already
                value = {e.value: e.name for e in config.EffortLevel}.get(value, value)
            level = str(value).strip().upper()
            if level not in ("O0", "O1", "O2", "O3"):
                raise ValueError(f"torchtpu.compile: {source}: {name}={value!r} is not one of "
                                 "O0, O1, O2, O3")
            out[_LEVELS[name]] = config.EffortLevel[level].value
        elif name in _EFFORTS:
            try:
                effort = float(value)
            except (TypeError, ValueError):
                effort = None
            if effort is None or not -1.0 <= effort <= 1.0:
                raise ValueError(f"torchtpu.compile: {source}: {name}={value!r} is not a "
                                 "number in [-1, 1]")
            out[name] = effort
        elif isinstance(value, str) and value.strip().lower() in ("true", "false"):
            out[name] = value.strip().lower() == "true"
        elif isinstance(value, (bool, int, float, str)):
            out[name] = value
        else:
            raise ValueError(f"torchtpu.compile: {source}: {name}={value!r}: a value is a "
                             "str, bool, int or float")
    return out


def _variable() -> dict:
    """The variable's options. Read at its first use, which may come before the device's
    start (``key()`` asked right after ``import torch``), not only at install()."""
    if not _env:
        text = os.environ.get(ENV, "")
        _env.append(parse(text) if text.strip() else {})  # (parse imports JAX)
    return _env[0]


def current() -> dict:
    """The options every compile gets now (contexts, then the variable over them)."""
    merged: dict = {}
    for layer in _stack:
        merged.update(layer)
    merged.update(_variable())
    return merged


def for_platform(platform: str) -> dict:
    """current() less the options a compiler of ``platform`` does not know."""
    options = current()
    if platform == "tpu":
        return options
    return {k: v for k, v in options.items() if not k.startswith(_TPU_ONLY)}


def key() -> str:
    """Stable text of current(), for keys of programs compiled under it ('' when none)."""
    options = current()
    return " ".join(f"{k}={options[k]!r}" for k in sorted(options))


def check(options: dict, source: str) -> None:
    """Compile a tiny program on the host with options; a refusal is a torchtpu.compile error."""
    import jax
    import jax.numpy as jnp

    host = {k: v for k, v in options.items() if not k.startswith(_TPU_ONLY)}
    frozen = frozenset((k, repr(v)) for k, v in host.items())
    if not host or frozen in _valid:
        return
    # (lowered from a shape: making an array would compile, under the options being checked)
    probe = jax.jit(lambda a: a + 1).lower(jax.ShapeDtypeStruct((2,), jnp.float32))
    try:
        probe.compile(compiler_options=host)
    except Exception as e:  # noqa: BLE001 (XLA's refusal: a JaxRuntimeError, or a TypeError)
        words = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise ValueError(f"torchtpu.compile: {source}: XLA refused the compiler options "
                         f"{host}: {words}. Option names are XLA's (the xla_* names XLA_FLAGS "
                         "takes, without '--'), plus xla_optimization_level and "
                         "xla_memory_fitting_level (O0-O3)") from None
    _valid.add(frozen)


def _changed() -> None:
    global generation
    import jax

    generation += 1
    jax.clear_caches()  # JAX's in-memory executables were compiled under the old options


@contextlib.contextmanager
def custom_compiler_options(options: Mapping) -> Iterator[None]:
    """Compile what compiles inside with ``options`` added (see the module doc)."""
    layer = normalize(dict(options))
    check({**current(), **layer}, "custom_compiler_options")
    with _lock:
        _stack.append(layer)
    if layer:
        _changed()
    try:
        yield
    finally:
        with _lock:
            _stack.remove(layer)
        if layer:
            _changed()


def install() -> None:
    """Read ``TORCH_TPU_INTERNAL_XLA_OPTIONS`` and wrap JAX's compile options once."""
    if _installed:
        return
    from jax._src import compiler

    variable = _variable()
    original = compiler.get_compile_options

    signature = inspect.signature(original)

    def get_compile_options(*args, **kwargs):
        if not (_stack or variable):
            return original(*args, **kwargs)
        if _unchecked:
            _check_env()
        call = signature.bind(*args, **kwargs)
        ours = for_platform(getattr(call.arguments.get("backend"), "platform", ""))
        if ours:
            asked = call.arguments.get("env_options_overrides") or {}
            call.arguments["env_options_overrides"] = {**ours, **asked}
        return original(*call.args, **call.kwargs)

    compiler.get_compile_options = get_compile_options
    _installed.append(original)
    if variable:
        _unchecked.append(ENV)


def _check_env() -> None:
    # At the first compile, not at install: compiling at import would start JAX's backends
    # before jax.distributed.initialize can run. (The probe's own compile comes back here
    # with nothing left to check.)
    _unchecked.clear()
    try:
        check(_variable(), ENV)
    except ValueError:
        _unchecked.append(ENV)
        raise
