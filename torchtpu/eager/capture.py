"""Captured steps: one run of eager code recorded into one XLA program, then replayed.

A capture makes the process's executor record instead of run, as DeferAndFuse does
(``eager/defer.py``), into a recording of its own that is never flushed: nothing runs while
capturing. The device layer tells the capture of every storage an op reads or writes
(``HOOKS.capture``) and of every random key drawn (``HOOKS.on_draw``). ``Capture.finish``
turns the recording into a ``Captured`` program:
- its inputs are the arrays the storages held when the capture first touched them (a parameter,
  a gradient, an optimizer moment, a static input), the key data of each random draw, inputs fed
  by a function at replay (``Capture.feed``: a learning rate), and constants (Python numbers,
  host data copied in during the capture);
- its outputs are the values the capture left in storages (an updated parameter, a new
  gradient, the loss).
Each storage then gets back the array it held before the capture (nothing ran); a storage the
capture created holds zeros until the first replay.

``Captured.replay()`` reads the same storages, draws new keys from the same generators, calls the
one program, and rebinds each written storage to its new array. A storage both read and written
is donated, so parameters and optimizer state are updated in place. No per-op Python, no
autograd engine: one program call.

Inside a capture, whatever needs a value on the host (``.item()``, ``.cpu()``, printing,
``torch.tpu.synchronize()``, an op whose result shape depends on values, an op that runs on the
CPU) raises ``CaptureError`` naming the user's line: a replay could not repeat it.

Collectives of the XLA transport are recorded too (``record_spanning``): the capture then spans
the processes of their group, and its replay is one SPMD program per rank over the group's mesh
(``eager/spanning.py``).
"""

from __future__ import annotations

import collections
import contextlib
import weakref
from collections.abc import Callable

import jax
import numpy as np
import torch
from torch.utils._python_dispatch import is_traceable_wrapper_subclass

from torchtpu import metrics
from torchtpu.cache import warm, warm_keys
from torchtpu.device import constants, launch, ownership, storage, tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.eager import executor, facts, fed_pack, fused_program, read_forms, spanning
from torchtpu.eager.defer import RECORDER, Pending, Recorder, _identity
from torchtpu.eager.program import Spec, program
from torchtpu.eager.replay_io import CONST, FED, KEY, STORAGE, CaptureError, ReplayIO
from torchtpu.lowering.registry import Lowering

# Called after an aborted capture gave every storage back what it held: Python state that the
# aborted code advanced around those storages is rolled back by its owner (FSDP2's per-step
# state, ``distributed/fsdp_capture.py``), or the step run after it would read the capture's
# placeholder arrays as if they were gathered parameters.
ON_ABORT: list[Callable[[], None]] = []


def _at(what: str) -> CaptureError:
    return CaptureError(
        f"torchtpu.capture: {what} inside a graph capture, {executor.user_location()}: a capture "
        "records "
        "device work without running it, so no value exists yet and a replay could not repeat "
        "what the host did with it. Move it out of the captured region (read results after "
        "g.replay()), or run this code eagerly.")


def storage_of(t: torch.Tensor) -> torch.UntypedStorage:
    """The storage holding t's data: for a tensor subclass wrapping one tensor (a DTensor, whose
    own storage is a placeholder), the wrapped tensor's."""
    if is_traceable_wrapper_subclass(t):
        names, _ = t.__tensor_flatten__()  # a DTensor's: its local tensor, its mesh
        inner = [x for x in (getattr(t, n) for n in names) if isinstance(x, torch.Tensor)]
        if len(inner) == 1:
            return storage_of(inner[0])
    return t.untyped_storage()


class _Recording(Recorder):
    """A capture's recording: unbounded, and never flushed (a flush would be a host read)."""

    max_ops = float("inf")

    def __init__(self) -> None:
        super().__init__()
        # Result shapes per (program, input signature) are facts, not state: every capture
        # shares DeferAndFuse's, so capturing again (a recapture, a backward) traces nothing new.
        self._shapes = RECORDER._shapes
        self.closed = False

    def flush(self) -> None:
        if self.closed:
            raise RuntimeError("torchtpu.capture: this value was computed inside a graph capture "
                               "and "
                               "exists only in the captured program's storages; read it "
                               "through a tensor after replay()")
        raise _at("a host read of a device value (.item(), .cpu(), print, bool, ...)")


class _Capturing(executor.Strict):
    """The executor while a capture is in progress: every op is recorded into the capture."""

    name = "capture"

    def __init__(self, capture: Capture) -> None:
        self._capture = capture

    def run(self, lowering: Lowering, spec: Spec, dyn: tuple):
        return self._capture.recording.record(program(lowering, spec), dyn)

    def run_concrete(self, lowering: Lowering, spec: Spec, dyn: tuple):
        raise _at(f"{lowering.op}, whose result shape depends on values,")

    def flush(self) -> None:
        raise _at("torch.tpu.synchronize()")

    def enter(self) -> None:
        HOOKS.deferrer = self._capture.recording
        HOOKS.capture = self._capture
        HOOKS.on_draw = self._capture.drew

    def leave(self) -> None:
        HOOKS.deferrer = None
        HOOKS.capture = None
        HOOKS.on_draw = None



class Capture:
    """One capture in progress: ``begin()``, run the code, ``finish()`` (or ``abort()``)."""

    def __init__(self) -> None:
        self.recording = _Recording()
        self._storages: dict = {}   # id -> (weakref to a storage, its array when first touched)
        self._draws: dict = {}      # id(key data) -> (generator, key data)
        self._fed: dict = {}        # id(array) -> (function giving its value at replay, array)
        self._previous = None
        self._spmd = None           # the mesh and check of the collectives recorded, if any
        self._collectives: list = []  # their descriptions, in order (the ranks compare them)
        self._outside: dict = {}    # id -> storage made while paused, read as made before
        self._phase = metrics.Phase("capture")  # begin() to the program built, as warm-ups split

    # ---- called by the device layer while capturing

    def seen(self, st) -> None:
        """st is about to be read or written: remember what it holds first."""
        entry = self._storages.get(id(st))
        # Weak: a temporary's storage dies during the capture and is no output of the program
        # (a dead entry's id may be a new storage's).
        if entry is None or entry[0]() is not st:
            # A new storage goes last, also where it reuses a dead one's id: the program's
            # outputs follow this order, which must not depend on memory addresses, or the
            # same step would be a new program (a persistent-cache miss) in every process.
            self._storages.pop(id(st), None)
            self._storages[id(st)] = (weakref.ref(st), st._tpu_array)

    def recorded(self, value):
        """A concrete array stored during the capture becomes a recorded value too."""
        if isinstance(value, jax.Array):
            return self.recording.record(_identity, (value,))
        return value

    def drew(self, generator, data) -> None:
        self._draws[id(data)] = (generator, data)

    def host_read(self) -> None:
        raise _at("a host read of a device value (.item(), .cpu(), print, bool, ...)")

    def record_spanning(self, spmd, description: str, fn, args: tuple):
        """Record fn(*args), a collective over spmd's mesh axis (``distributed/xla.py``): the
        replay becomes one SPMD program over that mesh, whose first run checks with the other
        ranks that theirs recorded the same collectives (each one's ``description``)."""
        joined = spanning.join(self._spmd, spmd)
        if joined is None:
            raise _at("a collective on a process group that is no dim of the 2-D mesh of the "
                      "groups before it (one captured program spans one group's devices, or "
                      "two groups of one DeviceMesh)")
        self._spmd = joined
        self._collectives.append(description)
        return self.recording.record(fn, args)

    # ---- called by the capturing code

    def feed(self, st, fn: Callable[[], object], packed: bool = False,
             rows: int | None = None) -> None:
        """At replay, storage st's input is fn()'s value instead of what st holds.

        ``packed``: fn returns a host array of st's element count (any shape; a buffer its
        owner may rewrite once the replay has been launched), which travels with the other
        packed feeds' values in one transfer (``eager/fed_pack.py``). ``rows`` (packed only):
        fn gives st's first rows only, and the program reads zeros past them (for a buffer
        of which the captured code reads that many rows)."""
        if rows is not None and (not packed or not 0 < rows <= st._tpu_array.shape[0]):
            raise ValueError(f"torchtpu.capture: feed rows={rows} needs packed=True and a count "
                             f"within the storage's {st._tpu_array.shape[0]} rows")
        self._fed[id(st._tpu_array)] = (fn, st._tpu_array, packed, rows)  # st may die first

    def created(self, st) -> bool:
        """Whether storage st was made inside this capture (storage addresses only grow)."""
        return storage.made_since(self._first_address, st.data_ptr()) and id(st) not in \
            self._outside

    def made_outside(self, st) -> None:
        """Storage st, made while the capture was paused, holds a value from before the capture
        (a buffer of values moved out of other storages): each replay reads it, as a storage
        made before the capture, rather than baking in its value."""
        self._outside[id(st)] = st

    @contextlib.contextmanager
    def paused(self):
        """Run the block eagerly, outside the recording (to make a tensor the capture reads)."""
        executor.set_current(self._previous)
        try:
            yield
        finally:
            executor.set_current(self._capturing)

    def begin(self) -> None:
        if executor.current().name == "capture":
            raise CaptureError("torchtpu.capture: a graph capture is already in progress; captures "
                               "do not nest")
        executor.flush()  # DeferAndFuse's pending work runs first: it is not part of the capture
        self._phase.start()
        self._first_address = storage.mark()
        self._previous = executor.current()
        self._capturing = _Capturing(self)
        executor.set_current(self._capturing)

    def _end(self) -> None:
        executor.set_current(self._previous)
        self.recording.closed = True

    def _live(self) -> list:
        """(storage, what it held first) for each storage touched and still alive."""
        live = []
        for ref, start in self._storages.values():
            st = ref()
            if st is not None:
                live.append((st, start))
        return live

    def abort(self) -> None:
        """Leave the capture and give every storage back what it held."""
        self._end()
        self._phase.stop()
        for st, start in self._live():
            st._tpu_array = start
        for hook in ON_ABORT:
            hook()

    def finish(self) -> Captured:
        """Leave the capture; the recording as one program over the storages it touched."""
        try:
            return self._finish()
        finally:
            self._phase.stop()

    def _finish(self) -> Captured:
        self._end()
        trace = self.recording._trace
        live = self._live()
        outputs: dict = {}   # (node, leaf) -> storages holding that value
        for st, _ in live:
            value = st._tpu_array
            if isinstance(value, Pending) and value.resolve() is value and value._trace is trace:
                outputs.setdefault((value._node, value._leaf), []).append(st)
        sources = self._sources(trace.inputs, live)
        wanted = _in_input_order(tuple(outputs), outputs, sources)
        targets = [outputs[w] for w in wanted]
        avals = [_aval(targets[i][0]._tpu_array) for i in range(len(wanted))]
        written = {id(st) for sts in targets for st in sts}
        read_forms.apply(trace.nodes)
        build = spanning.replay if self._spmd is not None else fused_program.replay
        run = build(tuple(trace.nodes), wanted)
        replay, baked, sources = _baked(run, sources)
        replay, packed, sources = fed_pack.pack(replay, sources, allowed=self._spmd is None)
        donate = _donations(sources, written, avals)
        for st, start in live:
            value = st._tpu_array
            if start is None and isinstance(value, Pending):
                # Created by the capture: zeros until a replay writes it, so that a later
                # capture (a backward after a forward) reads it as an input of its shape.
                start = constants.zeros(tuple(value.shape), np.dtype(value.dtype))
            if isinstance(start, jax.Array) and not start.committed:
                # The program's outputs are committed to the device: an uncommitted input
                # (from jnp.zeros, say) would make the second replay compile again.
                start = jax.device_put(start, next(iter(start.devices())))
            st._tpu_array = start
        if self._spmd is not None:
            fn = spanning.Spanning(self._spmd, replay, donate, self._collectives)
        else:
            # Keyed by what was recorded, so that a new process loads the executable without
            # tracing or lowering the program (cache/warm.py); its signature adds the shapes.
            key = warm_keys.key_of("captured", trace.nodes, wanted, donate, baked,
                              *((packed,) if packed else ()))
            fn = _program(replay, donate, key)
        facts.save()
        metrics.count("captures")
        return Captured(fn, ReplayIO(sources, targets, avals), len(trace.nodes), donate)

    def _sources(self, inputs: list, live: list) -> list:
        by_array = {id(start): st for st, start in live if isinstance(start, jax.Array)}
        sources = []
        for x in inputs:
            st = by_array.get(id(x)) if isinstance(x, jax.Array) else None
            if isinstance(x, jax.Array) and id(x) in self._fed:
                fn, _, packed, rows = self._fed[id(x)]
                sources.append((FED, fn, (x.shape, x.dtype, rows) if packed else None))
            elif st is not None and not self.created(st):
                sources.append((STORAGE, st, (x.shape, x.dtype)))
            elif isinstance(x, np.ndarray) and id(x) in self._draws:
                sources.append((KEY, self._draws[id(x)][0], None))
            else:
                # A storage made inside the capture was read before it was written: its value
                # then is no earlier step's but the zeros it was made with, the same every replay.
                sources.append((CONST, x, None))
        return sources


# The programs of recent captures by what they recorded: capturing the same step again (a whole
# step's first call and its second, a recapture after a guard) reuses the compiled program
# rather than compiling it again.
_PROGRAMS: collections.OrderedDict = collections.OrderedDict()
_KEEP = 8


def _program(replay: Callable, donate: tuple, key: str | None) -> warm.Program:
    fn = _PROGRAMS.get(key) if key is not None else None
    if fn is None:
        fn = warm.Program(jax.jit(replay, donate_argnums=donate), key)
        if key is not None:
            _PROGRAMS[key] = fn
            while len(_PROGRAMS) > _KEEP:
                _PROGRAMS.popitem(last=False)
    else:
        _PROGRAMS.move_to_end(key)
        metrics.count("capture_programs_reused")
    return fn


def _in_input_order(wanted: tuple, outputs: dict, sources: list) -> tuple:
    """The outputs, those that are a storage input's new value first and in input order.

    ``jax.jit`` pairs each donated input with the first unused output of its shape: in this
    order that is its own storage's new value. In any other order the donated buffer would hold
    another storage's value while its own was still being read, and XLA would copy around that
    (about 170 copies in the TinyGPT step)."""
    position = {id(st): w for w in wanted for st in outputs[w]}
    first = []
    for kind, st, _ in sources:
        w = position.get(id(st)) if kind is STORAGE else None
        if w is not None and w not in first:
            first.append(w)
    chosen = set(first)
    return (*first, *(w for w in wanted if w not in chosen))


def _baked(replay: Callable, sources: list) -> tuple[Callable, dict, list]:
    """replay with the capture's scalar constants (Python numbers: betas, eps, a clipping norm)
    built into the program, where XLA folds them, rather than passed in at every replay; those
    constants by source position; and the sources left to pass."""
    baked = {i: x for i, (kind, x, _) in enumerate(sources)
             if kind is CONST and (isinstance(x, (int, float, np.generic))
                                   or (isinstance(x, np.ndarray) and x.ndim == 0))}
    if not baked:
        return replay, baked, sources
    n = len(sources)

    def captured_step(*passed):
        rest = iter(passed)
        return replay(*[baked[i] if i in baked else next(rest) for i in range(n)])

    return captured_step, baked, [s for i, s in enumerate(sources) if i not in baked]


def _aval(p: Pending) -> tuple:
    return (tuple(p.shape), np.dtype(p.dtype))


def _donations(sources: list, written: set, avals: list) -> tuple:
    """Storage inputs the program overwrites, each with an output of its shape to reuse."""
    free: dict = {}
    for a in avals:
        free[a] = free.get(a, 0) + 1
    donate = []
    for i, (kind, st, sig) in enumerate(sources):
        if kind is STORAGE and id(st) in written:
            k = (tuple(sig[0]), np.dtype(sig[1]))
            if free.get(k):
                free[k] -= 1
                donate.append(i)
    return tuple(donate)


def _copy_lent(args: list, donate: tuple) -> None:
    """A copy in place of each donated argument whose buffer is lent (``ownership.lend``: the
    source of a value computed later, a lazy cast's or a held product's of a parameter): the
    lender reads it after the replay, which would have deleted it."""
    for i in donate:
        if id(args[i]) in ownership.lent:
            args[i] = tensors.fresh_copy(args[i])


class Captured:
    """A captured program bound to the storages it reads and writes."""

    def __init__(self, fn, io: ReplayIO, ops: int, donate: tuple = ()) -> None:
        self._fn = fn
        self._io = io
        self._donate = donate  # the argument positions whose buffers the program reuses
        self.ops = ops  # recorded calls in the program
        self._label = f"captured_graph[{ops} ops]"

    def storages_read(self) -> list:
        return [st for kind, st, _ in self._io.sources if kind is STORAGE]

    def storages_written(self) -> list:
        return list(self._io._flat_targets)

    def replay(self, bind: dict | None = None) -> None:
        """Run the program once: read the storages, rebind the written ones.

        ``bind`` maps ``id(storage)`` to an array to use instead of what that storage holds.
        """
        if HOOKS.capture is not None:
            raise CaptureError("torchtpu.capture: replay() inside a graph capture; captures do "
                               "not nest")
        # What a recording in progress (DeferAndFuse's) read runs first, as at a host read: its
        # inputs may be the storages' arrays this program donates. (Strict's held values and
        # collectives lend what they read: ``_copy_lent``.)
        executor.flush()
        args = self._io.arguments(bind)
        if ownership.lent:
            _copy_lent(args, self._donate)
        metrics.count("executions")
        if self._io.fed:
            metrics.count("fed_transfers", self._io.fed)
        self._io.store(args, launch.run(self._label, self._fn, args))

    def hlo(self) -> str:
        """The captured program as StableHLO text."""
        args = self._io.arguments()
        if isinstance(self._fn, spanning.Spanning):
            return self._fn.hlo(tuple(args))
        return self._fn.jitted.lower(*args).as_text()
