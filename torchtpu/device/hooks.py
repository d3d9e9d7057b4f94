"""Where the lower layers call up: the one typed interface the executors, the compiled path and
the tools implement.

Data flows down (compile -> eager -> lowering -> device -> runtime), but a few answers live
above the layer that asks: whether DeferAndFuse is recording, which capture is in progress, how
the compiled path reads a view of varying geometry or runs a call of growing sizes, whether
Strict casts lazily, who watches host reads and random draws, who runs a program launch or
explains its failure. ``HOOKS`` holds one field per such question, each None while nothing
above listens. An upper layer sets the field it implements (and puts None back); nothing writes
another module's functions or globals, and reading ``HOOKS`` shows every way the device can be
redirected.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol


class _Steady:
    """``Hooks.growing``'s answer for a call to run as usual while its epoch stays."""

    def __repr__(self) -> str:
        return "STEADY"


STEADY = _Steady()


class _Autograd:
    """``Hooks.growing``'s answer for a call to run as usual because autograd's engine runs it:
    every call it runs is answered so, at any epoch, while the same hook is installed."""

    def __repr__(self) -> str:
        return "AUTOGRAD"


AUTOGRAD = _Autograd()


class Recorder(Protocol):
    """DeferAndFuse's recorder (``eager/defer.py``), or a capture's recording."""

    def record(self, fn: Callable, args: tuple) -> Any: ...

    def host_read(self) -> None: ...

    def precision_changed(self) -> None: ...


# What ``Replay.repeat`` returns for a call it does not replay (an in-place call's own result is
# None).
MISS = object()


class Replay(Protocol):
    """DeferAndFuse's replay of calls repeating kept ones (``eager/defer_replay.py``)."""

    def repeat(self, op: Any, args: tuple, kwargs: dict) -> Any: ...

    def mark(self, op: Any, args: tuple) -> Any: ...

    def keep(self, op: Any, args: tuple, kwargs: dict, out: Any, mark: Any) -> None: ...


class Capture(Protocol):
    """A graph capture in progress (``eager/capture.py``)."""

    recording: Recorder

    def seen(self, storage: Any) -> None: ...

    def recorded(self, array: Any) -> Any: ...

    def host_read(self) -> None: ...

    def record_spanning(self, spmd: Any, description: str, fn: Callable, args: tuple) -> Any: ...


@dataclasses.dataclass(slots=True)
class Hooks:
    # While DeferAndFuse or a capture records: view reads and writes are recorded into the
    # pending program instead of run at once (``tensors.call``).
    deferrer: Recorder | None = None
    # The capture in progress: told of every storage read or written and every host read, so
    # that replaying it can read and rebind the same storages.
    capture: Capture | None = None
    # ``view_reader(t, array, geometry)``: t's value read without a program per geometry, or
    # None to read it as usual (``compile/eager_buckets.py``, views whose geometry varies).
    view_reader: Callable[[Any, Any, Any], Any] | None = None
    # ``host_read_watcher(nbytes, seconds)`` after every host read (``torchtpu.tools``); while
    # None a read pays no clock.
    host_read_watcher: Callable[[int, float], None] | None = None
    # ``on_draw(generator, key_data)`` for every random draw while a capture is in progress:
    # replaying it draws again from the same generators.
    on_draw: Callable[[Any, Any], None] | None = None
    # ``growing(lowering, spec, values, dyn, views)``: the arrays of a call whose sizes vary
    # between calls, or None to run it as usual (``compile/eager_buckets.py``); or ``STEADY``:
    # run it as usual, and a call of the same spec and views will be answered so again while
    # ``growing_epoch``, which the hook's owner moves whenever what it answers from changes,
    # stays (a remembered call answered so skips asking: ``eager/calls.run_seen``); or
    # ``AUTOGRAD``: run it as usual, and so every call while autograd's engine runs it (a
    # remembered call answered so skips asking while autograd's engine runs it).
    growing: Callable[..., Any] | None = None
    growing_epoch: int = 0
    # ``padded_inputs(lowering, spec, values, writes)``: the arrays of a call that may read
    # storages holding padded values, before they are read (which cuts them), or None;
    # ``writes``: its results are written into tensors, so they must be plain arrays.
    padded_inputs: Callable[..., Any] | None = None
    # ``lazy_cast(t, array, dtype, view=None)`` while Strict is the executor: a value (a
    # ``Deferred``) for t, whose storage array is ``array`` (read through the Geometry ``view``
    # where t is a view of it: a copy of the view), converted to the float dtype ``dtype``, that
    # its consumers' programs compute themselves (``eager/lazy_casts.py``); None to do it now.
    lazy_cast: Callable[..., Any] | None = None
    # ``settle_readers(array)`` while Strict is the executor: its held values still reading
    # array (``eager/lazy_casts.py``) computed now, so that they lend it no more (a donating
    # call is about to take its buffer: ``ownership.still_lent``).
    settle_readers: Callable[[Any], None] | None = None
    # Whether host reads wait for the device, where not the platform's answer (None): a step
    # census (``testing/step_census.py``) counts them as waits on XLA:CPU too.
    host_reads_stall: bool | None = None
    # ``launch_observer(label, fn, args)`` runs every device program in place of ``launch.run``
    # (the profiler, the memory limit, a step census); ``launch_refused(label, fn, args, error)``
    # makes the error for a launch the runtime refused for memory; ``peer_lost(error)`` the error
    # for a failure a dead peer process caused, or None (``device/launch.py``).
    launch_observer: Callable[[Any, Callable, tuple], Any] | None = None
    launch_refused: Callable[[Any, Callable, tuple, Exception], Exception] | None = None
    peer_lost: Callable[[Exception], Exception | None] | None = None
    # While DeferAndFuse records, asked at every op call reaching the dispatcher:
    # ``replay.repeat(op, args, kwargs)``, the result of a call that repeats a kept one, or
    # ``MISS``; then ``replay.mark(op, args)`` before the op path and ``replay.keep(op, args,
    # kwargs, out, mark)`` after it (``eager/defer_replay.py``).
    replay: Replay | None = None


HOOKS = Hooks()
