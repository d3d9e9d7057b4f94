"""A device-memory limit, and the out-of-memory error: ``torchtpu.memory: ...``.

A user sets the limit with ``TORCHTPU_MEMORY_LIMIT`` (bytes, or with a K/M/G/T suffix: ``512M``,
``1.5G``, ``2GiB``; a number below 1 without a suffix is a fraction of the device's memory, and
one such as ``1.5``, neither whole bytes nor a fraction, is an error) or with
``torch.tpu.set_per_process_memory_fraction(f)`` (CUDA's call: a fraction of
``torch.tpu.get_device_properties().total_memory``), and lifts it with ``set_limit(None)`` or a
fraction of 1. XLA:CPU has no limit of its own (its buffers are host memory), so a limit is how a
test or a user on a host finds out whether a step fits a chip's memory before renting one.

While a limit is set, every device program launch (the one hook every executor, DeferAndFuse,
compiled graphs, captures and collectives call, ``device/launch.py``) first adds the bytes the
program asks for (its outputs and temporaries less what donation lets it reuse, from XLA's memory
analysis of the compiled program, once per program and argument signature) to the bytes live on
the device (a compiled graph's program is analysed as it is, compiled already); a copy from
the host (``admit``) adds its bytes. Over the limit, nothing runs and nothing is donated: a
``torch.OutOfMemoryError`` (``torch.cuda.OutOfMemoryError`` is the same class) names the program
or the copy, the user's line that ran it, the bytes it asked for, the bytes in use, and the
largest live tensors, with the Python stack that made each while memory history records
(``torch.tpu.memory._record_memory_history()``).
The process can free them (``del``) and go on.

With or without a limit, a launch the runtime itself refuses for want of memory (XLA's
``RESOURCE_EXHAUSTED`` / "Out of memory" on a TPU or GPU, or on XLA:CPU an allocation past what
the host can map) is the same error: ``install`` makes ``refusal`` the launch hook's handler
(``device/launch.py``), which names the program, its line, the bytes the runtime was asked for
(from its message, else XLA's memory analysis of the program) and the largest live tensors.

The check scans the live arrays at each launch: it costs milliseconds per program, for finding
what fits, not for speed. ``torch.profiler`` with ``ProfilerActivity.TPU`` replaces this launch
observer with its own: from its start the limit is not checked until it is set again.
"""

from __future__ import annotations

import functools
import operator
import re

import jax
import torch

from torchtpu import settings
from torchtpu.device.hooks import HOOKS
from torchtpu.runtime import notices, platform

_SIZE = re.compile(r"^(\d+(?:\.\d*)?|\.\d+)\s*(?:([kmgt])i?b?|(b))?$")
_SHIFT = {"": 0, "k": 10, "m": 20, "g": 30, "t": 40}

_state: dict = {"limit": None, "previous": None}
_asked: dict = {}  # (program, argument signature) -> bytes it allocates


def parse_size(text: str, source: str = settings.MEMORY_LIMIT.name) -> int | float | None:
    """``"512M"`` / ``"1.5G"`` / ``"2GiB"`` / ``"1048576"`` / ``"4096B"`` as bytes (an int); a
    number below 1 without a unit as that fraction of the device's memory (a float); ``""``,
    zero and ``"off"`` as no limit. Anything else (``"1.5"``: neither whole bytes nor a fraction
    below 1) is a ``torchtpu.config`` error."""
    raw = text.strip().lower()
    if raw in ("", "off", "none"):
        return None
    found = _SIZE.match(raw)
    if found is None:
        raise ValueError(f"torchtpu.config: {source}={text!r} is not a size (bytes, or with a "
                         "K/M/G/T suffix such as 512M or 2GiB, or a fraction below 1)")
    digits, unit, in_bytes = found.groups()
    number = float(digits)
    if number == 0:
        return None
    if unit:
        return max(1, int(number * (1 << _SHIFT[unit])))
    if number < 1 and not in_bytes:
        return number
    if "." in digits:
        raise ValueError(f"torchtpu.config: {source}={text!r} is neither a whole number of bytes "
                         "nor a fraction below 1 of the device's memory (such as 0.5); for "
                         f"{digits} GiB write {digits}G")
    return int(digits)


# Whether a limit is set: ``limit() is not None`` without a Python frame (a C call giving the
# limit as set, a fraction not yet resolved included; a held call asks, ~520 a step).
limit_as_set = functools.partial(operator.getitem, _state, "limit")


def limit() -> int | None:
    """The limit in bytes, or None."""
    cap = _state["limit"]
    if isinstance(cap, float):  # a fraction, resolved at the first launch (see install)
        from torchtpu.device import memory

        cap = _state["limit"] = max(1, int(cap * memory.total_memory()))
    return cap


def set_limit(nbytes: int | None) -> None:
    """Refuse launches that would take the device's live bytes over nbytes (None: no limit)."""
    if nbytes is not None and (isinstance(nbytes, bool) or not isinstance(nbytes, int)
                               or nbytes < 1):
        raise ValueError(f"torchtpu.argument: a memory limit is a positive number of bytes or "
                         f"None, not {nbytes!r}")
    _arm(nbytes)


def _arm(nbytes: int | float | None) -> None:
    _state["limit"] = nbytes
    if nbytes is not None and HOOKS.launch_observer is not _guard:
        _state["previous"] = HOOKS.launch_observer
        HOOKS.launch_observer = _guard
    elif nbytes is None and HOOKS.launch_observer is _guard:
        HOOKS.launch_observer = _state["previous"]


def set_per_process_memory_fraction(fraction: float, device=None) -> None:
    """CUDA's call: limit this process to ``fraction`` (0 < f <= 1) of the device's memory."""
    from torchtpu.device import memory

    if isinstance(fraction, bool) or not isinstance(fraction, (int, float)) \
            or not 0 < fraction <= 1:
        raise ValueError(f"torchtpu.argument: set_per_process_memory_fraction takes a fraction "
                         f"in (0, 1], not {fraction!r}")
    set_limit(None if fraction == 1 else max(1, int(fraction * memory.total_memory())))


def admit(nbytes: int, what: str) -> None:
    """Refuse a copy of nbytes onto the device (``what``) that would take it over the limit, as
    a launch over it is refused. Costs one read when no limit is set."""
    if _state["limit"] is None:
        return
    cap, in_use = limit(), _in_use()
    if in_use + nbytes > cap:
        raise torch.OutOfMemoryError(_message(what, nbytes, in_use, cap))


def install() -> None:
    """Turn the runtime's refusals for memory into ``torch.OutOfMemoryError`` and set the limit
    ``TORCHTPU_MEMORY_LIMIT`` names, if any. (A fraction is resolved at the first launch: asking
    the device's size now would start JAX's backends at import, before
    jax.distributed.initialize can run.)"""
    HOOKS.launch_refused = refusal
    cap = parse_size(settings.MEMORY_LIMIT.get() or "")
    if cap is not None:
        _arm(cap)


# ---------------------------------------------------------------------------- the check


def _signature(args) -> tuple:
    return tuple((tuple(a.shape), str(a.dtype)) if hasattr(a, "shape") else type(a).__name__
                 for a in jax.tree_util.tree_leaves(args))


def _asks(fn, args) -> int:
    """Bytes fn allocates when run on args (0 when it is no jitted program)."""
    key = (fn, _signature(args))
    found = _asked.get(key)
    if found is None:
        try:
            stats = _analysis(fn, args)
            found = max(0, stats.output_size_in_bytes - stats.alias_size_in_bytes
                        + stats.temp_size_in_bytes)
        except Exception:  # noqa: BLE001 (not a jitted function, or no analysis on this runtime)
            found = 0
        _asked[key] = found
    return found


def _analysis(fn, args):
    """XLA's memory analysis of the program fn runs on args."""
    if hasattr(fn, "memory_analysis"):  # compiled already: a compiled graph's, an SPMD runner
        return fn.memory_analysis()
    jitted = getattr(fn, "jitted", fn)  # a warm.Program's function
    return jitted.lower(*args).compile().memory_analysis()


def _in_use() -> int:
    device = platform.local_device()
    return sum(a.nbytes for a in jax.live_arrays() if not a.is_deleted() and device in a.devices())


def _guard(label, fn, args: tuple):
    cap = limit()
    if cap is not None:
        asked = _asks(fn, args)
        in_use = _in_use()
        if asked and in_use + asked > cap:
            raise torch.OutOfMemoryError(_message(_running(label, fn), asked, in_use, cap))
    previous = _state["previous"]
    return fn(*args) if previous is None else previous(label, fn, args)


_ASKED = re.compile(r"allocat\w*\s+(\d+)\s*bytes", re.I)  # XLA's "Out of memory allocating N bytes"


def refusal(label, fn, args: tuple, error: Exception) -> torch.OutOfMemoryError:
    """The error for a launch the runtime refused for memory (``HOOKS.launch_refused``)."""
    found = _ASKED.search(str(error))
    asked = int(found.group(1)) if found else _asks(fn, args) or None
    runtime = (str(error).strip().splitlines() or [type(error).__name__])[0][:300]
    return torch.OutOfMemoryError(_message(_running(label, fn), asked, _in_use(), limit(),
                                           runtime))


def _running(label, fn) -> str:
    name = str(label) if label is not None else getattr(fn, "__name__", type(fn).__name__)
    return f"running {name}"


def _message(what: str, asked: int | None, in_use: int, cap: int | None,
             runtime: str | None = None) -> str:
    line = notices.user_line()
    head = f"torchtpu.memory: out of device memory {what}"
    head += f" (at {line})" if line else ""
    if runtime is None:
        head += (f": it asks for {asked:,} bytes with {in_use:,} in use, over the limit of "
                 f"{cap:,} ({settings.MEMORY_LIMIT.name} / "
                 "torch.tpu.set_per_process_memory_fraction)")
    else:
        wanted = f" of {asked:,} bytes" if asked else ""
        head += (f": the runtime refused an allocation{wanted} with {in_use:,} bytes in use "
                 f"({runtime})")
    return "\n".join([head + ".", *largest_lines(),
                      "Free what you no longer need (del the tensors, drop references to them) "
                      "and go on, or lower the batch size."])


def largest_lines(n: int = 5) -> list[str]:
    """The n largest live tensors: recorded allocations with their user line while memory
    history records, else the live device arrays by shape and dtype."""
    from torchtpu.device import memory_history

    recorded = memory_history.largest(n)
    if recorded:
        lines = ["Largest live tensors (with the line that made each):"]
        for block in recorded:
            frames = block["frames"]
            where = " <- ".join(f"{f['filename']}:{f['line']} in {f['name']}"
                                for f in frames[:2]) or "?"
            lines.append(f"  {block['size']:>14,} B  {where}")
        return lines
    device = platform.local_device()
    arrays = sorted((a for a in jax.live_arrays() if not a.is_deleted()
                     and device in a.devices()), key=lambda a: -a.nbytes)[:n]
    return ["Largest live tensors (record memory history for their stacks):",
            *(f"  {a.nbytes:>14,} B  {a.dtype}{list(a.shape)}" for a in arrays)]
