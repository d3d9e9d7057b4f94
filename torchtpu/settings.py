"""Every ``TORCHTPU_*`` environment variable, declared once: its name, type, default and meaning.

The rest of torchtpu reads these variables only through their declarations
(``settings.CPU_FALLBACK.get()``), never from ``os.environ`` itself, so each is parsed one way
and a bad value fails with one message naming the variable and what it accepts. A value is read
from the environment at each ``get()`` (tests and users set variables while a process runs); a
module that reads one at import says so where it does.

Rules every declaration shares: surrounding blanks are ignored and a variable set to the empty
string reads as unset (its default). A switch (``Flag``) takes ``1``/``0`` (also ``on``/``off``,
``true``/``false``, ``yes``/``no``); a choice takes its listed words in any case.

Two ways to change a value without the user's environment:

- ``overridden(value)``: a block of this process reads ``value`` (how a tool passes an option to
  the layer that reads the setting, ``with settings.CPU_FALLBACK.overridden("error"):``). Per
  process, not per thread; child processes do not see it.
- ``export(value)`` / ``exported(value)`` / ``child_env({...})``: the variable set for child
  processes (and this one, for the first two). Only a declaration marked ``set_by_torchtpu``
  may be written: those are the variables torchtpu hands to processes it starts.

docs/reference.md's settings table is ``reference_markdown()`` (``tests/test_settings.py``).
This module imports nothing from torchtpu: any module can read a setting.
"""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator, Mapping
from typing import Any, Generic, TypeVar

T = TypeVar("T")

_declared: dict[str, Setting] = {}
# name -> ((token, value), ...), innermost last; replaced, never changed in place, so that get()
# reads one without the lock
_overrides: dict[str, tuple] = {}
_lock = threading.Lock()


class Setting(Generic[T]):
    """One ``TORCHTPU_*`` variable. Subclasses say how its text reads as a value (``parse``)."""

    kind = "text"  # the type docs/reference.md shows
    accepted = "text"  # what a value must be, in words ("an integer")

    def __init__(self, name: str, default: T, meaning: str, *, shown_default: str | None = None,
                 set_by_torchtpu: bool = False) -> None:
        if not name.startswith("TORCHTPU_") or name in _declared:
            raise ValueError(f"torchtpu.config: {name} is not a new TORCHTPU_ name")
        self.name, self.default, self.meaning = name, default, meaning
        self.shown_default = shown_default  # the default in words, where it is not one value
        self.set_by_torchtpu = set_by_torchtpu
        _declared[name] = self

    def __repr__(self) -> str:
        return f"<setting {self.name}>"

    def get(self) -> T:
        """The value now: an active ``overridden`` block's, else the environment's, else the
        default."""
        stack = _overrides.get(self.name)
        if stack:
            return stack[-1][1]
        return self.parse(os.environ.get(self.name, ""))

    def is_set(self) -> bool:
        """Whether the environment gives this variable a value (not unset, not empty)."""
        return bool(os.environ.get(self.name, "").strip())

    def parse(self, text: str) -> T:
        """text (as the environment holds it) as this setting's value; a ``ValueError`` naming
        the variable and what it accepts when it is none."""
        text = text.strip()
        return self.default if not text else self._read(text)

    def _read(self, text: str) -> T:
        return text  # type: ignore[return-value]

    def text(self, value: T) -> str:
        """value as the environment would hold it (checked as ``parse`` reads it back)."""
        out = self._write(value)
        if self.parse(out) != value:
            raise ValueError(f"torchtpu.config: {value!r} is not a value of {self.name}")
        return out

    def _write(self, value: T) -> str:
        return "" if value is None else str(value)

    def _bad(self, text: str) -> ValueError:
        return ValueError(f"torchtpu.config: {self.name}={text!r} is not {self.accepted}")

    @contextlib.contextmanager
    def overridden(self, value: T) -> Iterator[None]:
        """Inside the block this process reads value (over the environment; per process)."""
        self.text(value)  # the value must be one the variable could give
        token = object()
        with _lock:
            _overrides[self.name] = (*_overrides.get(self.name, ()), (token, value))
        try:
            yield
        finally:
            with _lock:
                left = tuple(e for e in _overrides[self.name] if e[0] is not token)
                if left:
                    _overrides[self.name] = left
                else:
                    del _overrides[self.name]

    def export(self, value: T) -> None:
        """Set the variable in this process's environment, for it and the processes it starts."""
        os.environ[self.name] = self._exported_text(value)

    @contextlib.contextmanager
    def exported(self, value: T) -> Iterator[None]:
        """``export(value)`` while the block runs; the variable as it was after."""
        before = os.environ.get(self.name)
        self.export(value)
        try:
            yield
        finally:
            if before is None:
                os.environ.pop(self.name, None)
            else:
                os.environ[self.name] = before

    def _exported_text(self, value: T) -> str:
        if not self.set_by_torchtpu:
            raise ValueError(f"torchtpu.config: {self.name} is the user's to set; torchtpu "
                             "does not write it (declare it set_by_torchtpu)")
        return self.text(value)

    def shown_type(self) -> str:
        return self.kind

    def shown(self) -> str:
        """The default as docs/reference.md shows it."""
        if self.shown_default is not None:
            return self.shown_default
        return "unset" if self.default is None else f"`{self._write(self.default)}`"


class Text(Setting[Any]):
    """A value torchtpu takes as written (a path, a topology, a size its owner parses); kind
    names what it holds."""

    def __init__(self, name: str, meaning: str, *, kind: str = "text", **options: Any) -> None:
        super().__init__(name, None, meaning, **options)
        self.kind = kind


class Flag(Setting[Any]):
    """A switch: True, False, or None where the default is 'unset' (the caller decides)."""

    kind = "switch"
    accepted = "0 or 1 (nor on/off, true/false, yes/no)"
    _WORDS = {"1": True, "on": True, "true": True, "yes": True,
              "0": False, "off": False, "false": False, "no": False}

    def _read(self, text: str) -> bool:
        value = self._WORDS.get(text.lower())
        if value is None:
            raise self._bad(text)
        return value

    def _write(self, value: Any) -> str:
        return "" if value is None else "1" if value else "0"

    def shown_type(self) -> str:
        return "`0` \\| `1`"


class _Number(Setting[Any]):
    convert: Any = None  # int or float: the text's reading

    def _read(self, text: str) -> Any:
        try:
            return type(self).convert(text)
        except ValueError:
            raise self._bad(text) from None


class Int(_Number):
    kind = "integer"
    accepted = "an integer"
    convert = int


class Float(_Number):
    kind = "seconds"
    accepted = "a number of seconds"
    convert = float

    def _write(self, value: Any) -> str:
        return "" if value is None else f"{value:g}"


class Choice(Setting[Any]):
    """One of a few words (read in any case)."""

    def __init__(self, name: str, choices: tuple[str, ...], default: str | None, meaning: str,
                 **options: Any) -> None:
        self.choices = choices
        self.accepted = f"one of {', '.join(choices)}"
        super().__init__(name, default, meaning, **options)

    def _read(self, text: str) -> str:
        if text.lower() not in self.choices:
            raise self._bad(text)
        return text.lower()

    def shown_type(self) -> str:
        return " \\| ".join(f"`{c}`" for c in self.choices)


def declared() -> tuple[Setting, ...]:
    """Every declaration, in the order of this module."""
    return tuple(_declared.values())


def named(name: str) -> Setting:
    """The declaration of variable name (a ``KeyError`` for a name torchtpu does not read)."""
    return _declared[name]


def child_env(values: Mapping[Setting, Any]) -> dict[str, str]:
    """Environment entries for a child process: each setting (``set_by_torchtpu``) as text."""
    return {setting.name: setting._exported_text(value) for setting, value in values.items()}


def active_overrides() -> dict[str, Any]:
    """The ``overridden`` values in force: name -> innermost value."""
    with _lock:
        return {name: stack[-1][1] for name, stack in _overrides.items()}


def reference_markdown() -> str:
    """The settings table of docs/reference.md: one row per declaration."""
    rows = ["| variable | type | default | meaning | set by torchtpu |",
            "| --- | --- | --- | --- | --- |"]
    rows += [f"| `{s.name}` | {s.shown_type()} | {s.shown()} | {s.meaning} | "
             f"{'yes' if s.set_by_torchtpu else ''} |" for s in declared()]
    return "\n".join(rows)


# ---------------------------------------------------------------- the device and its processes

PLATFORM = Choice(
    "TORCHTPU_PLATFORM", ("tpu", "gpu", "cpu"), None,
    "Which PJRT platform device \"tpu\" runs on.",
    shown_default="TPU, else GPU, else CPU", set_by_torchtpu=True)
LOCAL_DEVICE = Int(
    "TORCHTPU_LOCAL_DEVICE", None,
    "Which of the host's devices this process drives, one process per device as in PyTorch (a "
    "process that sees one device drives it); Ray Serve replicas and vLLM's workers set it.",
    shown_default="torchrun's `LOCAL_RANK`, else 0", set_by_torchtpu=True)
CHIP_BINDING = Flag(
    "TORCHTPU_CHIP_BINDING", True,
    "On a multi-chip TPU host, give each torchrun process its chips through libtpu's "
    "per-process variables (Distributed, \"One process per chip\"); `0` leaves them unset.")
TPU_HOST_CHIPS = Text(
    "TORCHTPU_TPU_HOST_CHIPS",
    "This host's TPU chips as a box such as `2,4,1`, where the PCI scan cannot tell (and for "
    "tests describing a host).", kind="box", shown_default="the PCI scan's")
TPU_PROCESS_PORT = Int(
    "TORCHTPU_TPU_PROCESS_PORT", 8476,
    "The first port of the per-process libtpu servers on a multi-chip host.")
DIST_TRANSPORT = Choice(
    "TORCHTPU_DIST_TRANSPORT", ("xla", "host"), None,
    "tpu_dist's transport: XLA collective programs (which start JAX's multi-process runtime at "
    "`init_process_group`) or host memory through gloo.",
    shown_default="`xla` on TPU and GPU, `host` on XLA:CPU", set_by_torchtpu=True)

# ----------------------------------------------------------------------------- eager and compile

CPU_FALLBACK = Choice(
    "TORCHTPU_CPU_FALLBACK", ("warn", "error", "silent"), "warn",
    "What an op without a lowering does: run on CPU with a warning, raise, or run on CPU "
    "quietly (always counted in `torchtpu.metrics`).")
EAGER_BUCKETS = Flag(
    "TORCHTPU_EAGER_BUCKETS", True,
    "Eager calls whose sizes keep growing at one line of code run padded to size buckets "
    "instead of compiling per size (`compile/eager_buckets.py`; read at startup).")
FUSED_STEPS = Flag(
    "TORCHTPU_FUSED_STEPS", True,
    "In Strict, an optimizer's `step()` runs as one program per step "
    "(`compile/optimizer_steps.py`; read at startup); `0`: op by op.")
DEFER_SPLIT = Flag(
    "TORCHTPU_DEFER_SPLIT", True,
    "In DeferAndFuse, a recording's forward runs as its own program at backward's start, two "
    "programs a training step (`eager/defer.py`; read at import; below); `0`: one program.")
GC_FREEZE = Flag(
    "TORCHTPU_GC_FREEZE", True,
    "In Strict, a loop's steady state freezes Python's heap from the garbage collector "
    "(`eager/frozen.py`; read at import); `0` leaves the collector as it is.")
DEBUG = Flag(
    "TORCHTPU_DEBUG", False,
    "An error raised by an op keeps torchtpu's frames and names the error torchtpu met first as "
    "its cause (default: the traceback CPU shows, your frames and one message).")
DEBUG_NANS = Flag(
    "TORCHTPU_DEBUG_NANS", False,
    "In Debug mode, raise at the first op that produces NaN or Inf.")
PALLAS_INTERPRET = Choice(
    "TORCHTPU_PALLAS_INTERPRET", ("auto", "on", "off", "tpu"), "auto",
    "Pallas kernels in jax_ops: compiled on TPU and interpreted elsewhere (`auto`), always "
    "interpreted (`on`), never (`off`), or JAX's TPU-simulating interpreter (`tpu`, CPU "
    "platform only).")

# ------------------------------------------------------------------------ programs and the cache

CACHE_DIR = Text(
    "TORCHTPU_CACHE_DIR",
    "The persistent compile cache's directory; `off` turns the cache off (below).",
    kind="path or `off`", shown_default="`~/.cache/torchtpu`")
CACHE_MAX_BYTES = Text(
    "TORCHTPU_CACHE_MAX_BYTES",
    "Cap on the compile cache directory (bytes, or `512M`, `2G`; `0`: no cap): the least "
    "recently used entries are evicted, safely across processes.",
    kind="size", shown_default="`1G`")
LOAD_AHEAD = Flag(
    "TORCHTPU_LOAD_AHEAD", True,
    "With a private cache directory, a process loads on a background thread the programs the "
    "last process of the same command line used, in its order (`cache/warm_ahead.py`; below).")
DUMP = Text(
    "TORCHTPU_DUMP",
    "Write every program torchtpu builds to this directory as StableHLO and optimized HLO, each "
    "headed by the user line that built it (below).", kind="path")
PLACED_INDUCTOR_CACHE_DIR = Text(
    "TORCHTPU_PLACED_INDUCTOR_CACHE_DIR",
    "Where torchtpu pointed `TORCHINDUCTOR_CACHE_DIR` (set by torchtpu, so that a child process "
    "tells torchtpu's value from the user's).", kind="path", set_by_torchtpu=True)
MEMORY_LIMIT = Text(
    "TORCHTPU_MEMORY_LIMIT",
    "A device-memory limit: a launch or a copy from the host that would exceed it raises "
    "`torch.OutOfMemoryError` (below).", kind="size or fraction", shown_default="none")
NOTICES = Flag(
    "TORCHTPU_NOTICES", True,
    "`torchtpu:` lines on stderr through the `torchtpu.notices` logger: what \"tpu\" is here at "
    "the first op, and slow compiles; `0` silences them.")
SLOW_COMPILE_S = Float(
    "TORCHTPU_SLOW_COMPILE_S", 10.0,
    "A compile still running after this many seconds prints a line naming the program and the "
    "user's line that built it, and one with its time when done; `0`: never.")

# ------------------------------------------------------------------------------- TPU targets

TPU_TARGET = Text(
    "TORCHTPU_TPU_TARGET",
    "Also compile every program for this TPU topology (`v5e:2x2`, ...) with libtpu, "
    "compile-only; unset or `off`: nothing is wrapped.", kind="topology", set_by_torchtpu=True)
TPU_TARGET_ON_ERROR = Choice(
    "TORCHTPU_TPU_TARGET_ON_ERROR", ("raise", "warn", "keep"), "raise",
    "A program the TPU target refuses raises `torchtpu.tpu:` at the next compile, warns, or is "
    "only kept in the reports.", set_by_torchtpu=True)
TPU_DUMP = Text(
    "TORCHTPU_TPU_DUMP",
    "Each program compiled for the TPU target also writes its optimized HLO to this directory "
    "(to diff against another's); a kept verdict is then not reused.", kind="path")
AOT_TIMEOUT = Float(
    "TORCHTPU_AOT_TIMEOUT", 1800.0,
    "How long `python -m torchtpu.aot --world N` waits for its ranks' host steps and TPU "
    "compiles.")

# ------------------------------------------------------------------------------ integrations

VLLM = Flag(
    "TORCHTPU_VLLM", None,
    "vLLM runs on device \"tpu\" (torchtpu's platform plugin, `1`) or on its own platforms "
    "(`0`).", shown_default="\"tpu\" where `python -m torchtpu.integrations.vllm.install` ran",
    set_by_torchtpu=True)
VLLM_CAPTURE = Choice(
    "TORCHTPU_VLLM_CAPTURE", ("startup", "lazy"), "startup",
    "When a vLLM engine on \"tpu\" captures and compiles its step shapes: all before it serves, "
    "or each when a step first meets it (TRL's colocated engine starts `lazy`).",
    set_by_torchtpu=True)
VLLM_STACK = Choice(
    "TORCHTPU_VLLM_STACK", ("vectors", "1", "0"), "vectors",
    "Which per-layer weights a vLLM engine on \"tpu\" stacks into one storage each: norms and "
    "biases, all, or none.")
VLLM_TOKENS_ONLY = Flag(
    "TORCHTPU_VLLM_TOKENS_ONLY", True,
    "An all-greedy vLLM decode step without logprobs or logits processors runs its bucket's "
    "tokens-only program; `0`: every step writes its logits.")
VLLM_PAGED = Choice(
    "TORCHTPU_VLLM_PAGED", ("auto", "on", "off"), "auto",
    "vLLM's attention through the paged attention kernel: on a TPU where the heads allow it, "
    "always (densely in XLA off a TPU), or never (the gathered path).")
VLLM_ASYNC = Flag(
    "TORCHTPU_VLLM_ASYNC", True,
    "vLLM's async scheduling on \"tpu\" as vLLM resolves it, where torchtpu can prepare the "
    "steps on the host; `0` turns it off.")
VLLM_PARENT_PID = Int(
    "TORCHTPU_VLLM_PARENT_PID", None,
    "Set by a Ray Serve vLLM replica for its engine's processes: the process they exit after.",
    set_by_torchtpu=True)
VISIBLE_DEVICES = Text(
    "TORCHTPU_VISIBLE_DEVICES",
    "vLLM's device-control variable for the \"tpu\" platform (vLLM sets it for its workers; "
    "torchtpu does not read it).", kind="device list")
SGLANG = Flag(
    "TORCHTPU_SGLANG", None,
    "SGLang runs on device \"tpu\" (`1`) or on its own platforms (`0`).",
    shown_default="\"tpu\" where `python -m torchtpu.integrations.sglang.install` ran",
    set_by_torchtpu=True)
TRL_DEFER = Flag(
    "TORCHTPU_TRL_DEFER", True,
    "TRL's `GRPOTrainer.train` with vLLM colocated on tpu runs in DeferAndFuse where the "
    "process is in Strict (`integrations/trl.py`); `0` keeps Strict.")
