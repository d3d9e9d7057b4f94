"""DeferAndFuse: ops are recorded, not run, and a flush runs the recording as one jitted program.

While the executor is active, each op's jitted program (``eager/program.py``) and each view
read/write and conversion (``device/tensors.call``) is appended to a recording instead of run, and
its results are ``Pending`` values: they know their shape and dtype, and a storage holds one in
place of its array. A flush replays the recording inside one ``jax.jit`` (the per-op programs
inline into it), runs it, and hands each pending value that is still referenced its array.

Flushes happen at host reads (any device value converted to NumPy on the thread that entered the
mode: ``.item()``, ``.cpu()``, printing, ``bool()``, also of a value already run), before the
first op recorded after an optimizer step (``torch.optim``'s global step hook), before a call
whose output shape depends on values (``x[mask]``, not ``x[idx]``: see ``data_dependent_shape``
in ``lowering/registry.py``), at ``torch.tpu.synchronize()``, when the recording reaches
``MAX_OPS`` ops and when the mode is left; also at backward's start (``Recorder._split``), so the
device runs the forward while the host records the rest (``TORCHTPU_DEFER_SPLIT=0``: not).
The fused program is cached by the recording's structure (programs called and how their values
connect), which outputs are still alive and which inputs are donated; JAX adds the input shapes.
A new process finds it by the same facts in the persistent cache, without tracing or lowering
it (``fused_program.keyed``).
A training loop therefore records the same structure each step and reuses one program: provided
each step's recording starts at the same op. The size bound cuts wherever it falls, so a loop
whose flushes are not at its step's ends would be cut at a different op every step (a new program
each step, for ever); host reads and optimizer steps end the recording, so a loop that reads its
loss, or steps an optimizer, starts each step afresh. ``MAX_OPS`` bounds compile time (XLA's
grows faster than linearly with a program's length: a chain of 4000 elementwise ops took 24 s
to compile on XLA:CPU, 2000 took 6 s); a 12-layer Llama training step is ~1,900 ops, its first
(AdamW creating its moments) ~2,400: one program each, two loaded in all, where a bound of 2000
cut the first step and loaded four.

Inputs that no storage or pending value holds any more (a parameter's old value once the optimizer
has written a new one) are donated to the program, so in-place updates reuse their buffers. So are
the buffers of earlier results that died before this flush (a loop's previous output, last step's
activations): the recorder keeps the last flush's results of ``SPARE_MIN_BYTES`` or more, and
each one nothing else holds by the next flush is handed to that program, unused, for an output of
its shape to be written into. Smaller results are not kept: allocating them costs nothing, and
they are what a loop hands its user (a loss, a norm), who may hold last step's one step longer
(a logging line, a profiled step): the program, which takes the spares as parameters, would then
be another one, compiled again (~1 min for a 12-layer Llama step on the chip).
Fresh buffers cost more than their writes on XLA:CPU (the host zeroes new pages on first touch:
a 32 MB RMSNorm ran 2.4x faster into a reused buffer); on TPU and GPU reuse saves allocation.
Leaving the mode drops what is kept.

Python's garbage collector is told when a loop reached its steady state (``frozen.py``).
The executor that records into this module's ``RECORDER`` is ``defer_executor.DeferAndFuse``.
"""

from __future__ import annotations

import math
import threading
import warnings
import weakref

import jax
import numpy as np
import torch
from jax._src.array import ArrayImpl

from torchtpu import metrics, settings
from torchtpu.cache import warm_keys
from torchtpu.device import launch, ownership, tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.eager import defer_split, frozen, fused_program, numbers, read_forms
from torchtpu.eager.defer_signatures import abstract as _abstract
from torchtpu.eager.defer_signatures import outputs as _outputs
from torchtpu.eager.defer_signatures import signature as _signature

MAX_OPS = 4000
# Split at backward's start (``Recorder._split``) after this many calls outside it: the v5e chip
# ran the 12-block Llama step in 93.1 ms split, 116.4 ms as one program (bench/RESULTS.md, session
# 35). ``TORCHTPU_DEFER_SPLIT=0``: never (one program a step, fewer live buffers between them).
SPLIT_CALLS = 64
SPLIT_MIN_OPS = SPLIT_CALLS if settings.DEFER_SPLIT.get() else math.inf  # read at import
SPARE_MIN_BYTES = 1 << 16
_NUMBERS = (float, int, bool)
_SEQUENCES = (list, tuple)
_graph_task_id = torch._C._current_graph_task_id


@jax.jit
def _identity(x):
    return x


_astypes: dict = {}


def _astype(dtype):
    fn = _astypes.get(dtype)
    if fn is None:
        fn = _astypes[dtype] = warm_keys.named(jax.jit(lambda x: x.astype(dtype)), "astype", dtype)
    return fn


class Pending(ownership.Deferred):
    """One output of a recorded call: its shape and dtype now, its array after the flush."""

    __slots__ = ("shape", "dtype", "weak_type", "_sig", "_trace", "_node", "_leaf", "_value",
                 "_error", "__weakref__")
    whole_is_itself = True

    def __init__(self, out: tuple, trace, node: int, leaf: int) -> None:
        # out: (shape, dtype, weak_type, signature number), as ``_outputs`` keeps it per call.
        self.shape, self.dtype, self.weak_type, self._sig = out
        self._trace = trace
        self._node = node
        self._leaf = leaf
        self._value = None
        self._error = None

    @property
    def ndim(self) -> int:
        return len(self.shape)

    def resolve(self):
        if self._value is not None:
            return self._value
        if self._error is not None:
            raise RuntimeError("torchtpu.deferred: this value was lost because the deferred "
                               "program that "
                               f"computes it failed: {self._error!r}") from self._error
        return self

    def materialize(self) -> jax.Array:
        """The array, flushing the recording if it is still pending."""
        value = self.resolve()
        if value is self:
            self._trace.recorder.flush()
            value = self.resolve()
        return value

    def _recorder(self) -> Recorder:
        return self._trace.recorder if self.resolve() is self else HOOKS.deferrer or RECORDER

    def copy(self):
        # A storage never shares its array with another, so a copy is a distinct output.
        return self._recorder().record(_identity, (self,))

    def astype(self, dtype):
        return self._recorder().record(_astype(np.dtype(dtype)), (self,))

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        return np.array(self.materialize(), dtype=dtype)  # a copy: buffers may be donated later

    def __jax_array__(self) -> jax.Array:
        return self.materialize()

    def __getattr__(self, name: str):
        # Anything else a pending value is asked for is answered by its array.
        if name.startswith("__"):
            raise AttributeError(name)
        return getattr(self.materialize(), name)

    def __repr__(self) -> str:
        state = "pending" if self.resolve() is self else "materialized"
        return f"Pending({state}, shape={self.shape}, dtype={self.dtype})"


def _now(fn, args: tuple):
    """fn(*args) run at once, its pending arguments computed first (``Recorder.making``)."""
    args = jax.tree_util.tree_map(
        lambda a: a.materialize() if a.__class__ is Pending else a, args)
    return launch.run(None, fn, args)


class _Trace:
    """One recording: calls, their inputs from outside, and weak references to their outputs."""

    def __init__(self, recorder: Recorder, start: int = 0) -> None:
        self.recorder = recorder
        self.start = start       # its first call's place in the step (``Recorder.split``)
        self.carried = 0         # calls at its head that a split recomputes (``defer_split``)
        self.outside = 0         # calls recorded outside backward since the last inside it
        self.nodes: list = []    # (fn, args treedef or None, refs)
        self.outs: list = []     # per node, weakrefs to its Pending outputs
        self.inputs: list = []   # arrays and numbers from outside the recording
        self._array_ids: dict = {}

    def input(self, x) -> int:
        # The same array used twice is one input; numbers and host arrays are never merged,
        # so the recording's structure does not depend on which equal numbers Python shares.
        if x.__class__ is ArrayImpl or isinstance(x, jax.Array):
            i = self._array_ids.get(id(x))
            if i is not None:
                return i
            self._array_ids[id(x)] = len(self.inputs)
        self.inputs.append(x)
        return len(self.inputs) - 1

    def refs(self, items: list) -> tuple:
        """Where each of a list call's items comes from: a pending one's (node, leaf), else
        its ``input`` position (its common case, a computed array, inline: an optimizer's
        lists bring ~900 a step)."""
        ids, inputs, out = self._array_ids, self.inputs, []
        for a in items:
            kind = a.__class__
            if kind is Pending:
                out.append((a._node, a._leaf))
            elif kind is ArrayImpl:
                i = ids.get(id(a))
                if i is None:
                    i = ids[id(a)] = len(inputs)
                    inputs.append(a)
                out.append(i)
            else:
                out.append(self.input(a))
        return tuple(out)


class Recorder:
    """The process's recording; thread-safe, since backward runs on PyTorch's autograd thread."""

    max_ops = MAX_OPS
    split_min_ops = SPLIT_MIN_OPS  # math.inf: never split at backward's start

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._trace = _Trace(self)
        self._shapes: dict = {}
        self._programs: dict = {}
        self._spares: list = []  # the last flush's results, whose buffers a next flush may reuse
        self._step_over = False  # an optimizer step ended since the last flush
        self.freezer = frozen.Freezer()
        self.owner: int | None = None  # the thread that entered the mode (its loop reads)
        # The thread making an optimizer's state (``DeferAndFuse.adopt``), or 0: its calls run
        # at once, as with no recorder; the other threads' record.
        self.making = 0
        self._warned_threads = False

    def set_making(self, thread: int) -> None:
        """thread (0: none) makes an optimizer's state (``DeferAndFuse.adopt``)."""
        self.making = thread

    def _warn_other_thread(self) -> None:
        """Once: ops of a thread other than the owner (outside backward, which PyTorch's
        autograd thread runs for every thread) interleave in the owner's recording, whose
        structure then differs at every flush (issue 37: 4 threads compiled 144 programs)."""
        self._warned_threads = True
        warnings.warn(
            f"torchtpu.unsupported: DeferAndFuse records thread "
            f"{threading.current_thread().name!r}'s ops into the one recording of the process, "
            "with the other threads' ops: each flush holds another mix, so programs compile "
            "again and again. Run DeferAndFuse on one thread (the other threads in processes of "
            "their own), or use Strict (the default) with threads", stacklevel=4)

    def record(self, fn, args: tuple):
        """Append fn(*args) to the recording; its outputs as Pending values, in fn's structure."""
        # Every op of a deferred step comes here (~1,700 a 12-layer Llama step): its steps are
        # the fewest that keep the key exact.
        if self.making and self.making == threading.get_ident():
            return _now(fn, args)
        tree = None
        for a in args:
            if a.__class__ in _SEQUENCES:
                args, tree = jax.tree_util.tree_flatten(args)
                break
        # (Backward's ops, on PyTorch's autograd thread, are in a graph task: no call.)
        inside = _graph_task_id() != -1
        if self.owner is not None and not self._warned_threads \
                and threading.get_ident() != self.owner and not inside:
            self._warn_other_thread()
        with self._lock:
            self._begin(inside)
            trace = self._trace
            trace.outside = 0 if inside else trace.outside + 1
            refs, sig = [], []
            for a in args:
                if a.__class__ is Pending:
                    if a._value is None and a._error is None:  # still pending
                        if a._trace is not trace:
                            raise RuntimeError("torchtpu.deferred: a pending value outlived its "
                                               "recording")
                        refs.append((a._node, a._leaf))
                        sig.append(a._sig)
                        continue
                    a = a.resolve()
                refs.append(trace.input(a))
                sig.append(_signature(a))
            sig = tuple(sig)
            key = (fn, tree, sig)
            shapes = self._shapes.get(key)
            if shapes is None:
                abstract = [_abstract(n) for n in sig]
                call_args = tree.unflatten(abstract) if tree is not None else abstract
                # Most ops have one plain output (single): handed back without a pytree trip.
                shapes = self._shapes[key] = _outputs(fn, tree, sig, call_args)
            outs, out_tree, single = shapes
            node = len(trace.nodes)
            trace.nodes.append((fn, tree, tuple(refs)))
            if single:
                p = Pending(outs[0], trace, node, 0)
                trace.outs.append((weakref.ref(p),))
                if node + 1 >= self.max_ops:
                    self.flush()
                return p
            ps = [Pending(out, trace, node, i) for i, out in enumerate(outs)]
            trace.outs.append([weakref.ref(p) for p in ps])
            if node + 1 >= self.max_ops:
                self.flush()
            return out_tree.unflatten(ps)

    def in_order(self) -> bool:
        """Whether a call on this thread records without the warning of ``record`` (the mode's
        thread, or backward's, or a thread warned of already)."""
        return self.owner is None or self._warned_threads \
            or threading.get_ident() == self.owner or _graph_task_id() != -1

    def append(self, trace: _Trace, fn, items: list, out: tuple) -> Pending | None:
        """``record`` of a call whose output is known (``defer_replay``): fn over items (each
        a value pending in trace, an array or a number), its one output ``out`` as ``_outputs``
        gives it; None where trace is no longer the recording (a flush in between or due)."""
        with self._lock:
            # (``_node``, inline: every replayed call comes here, ~1,500 a 12-layer Llama step.)
            inside = _graph_task_id() != -1
            if self._trace is not trace or self._step_over \
                    or inside and trace.outside >= self.split_min_ops:
                return None
            trace.outside = 0 if inside else trace.outside + 1
            nodes = trace.nodes
            node = len(nodes)
            nodes.append((fn, None, trace.refs(items)))
            p = Pending(out, trace, node, 0)
            trace.outs.append((weakref.ref(p),))
            if node + 1 >= self.max_ops:
                self.flush()
            return p

    def append_many(self, trace: _Trace, fn, tree, items: list, outs: tuple) -> list | None:
        """``append`` of a call over lists (``defer_replay_lists``): fn over items flattened as
        tree, its outputs ``outs``; their pending values, or None as ``append``'s."""
        with self._lock:
            node = self._node(trace, fn, tree, items)
            if node is None:
                return None
            ps = [Pending(out, trace, node, i) for i, out in enumerate(outs)]
            trace.outs.append([weakref.ref(p) for p in ps])
            if node + 1 >= self.max_ops:
                self.flush()
            return ps

    def _node(self, trace: _Trace, fn, tree, items: list) -> int | None:
        inside = _graph_task_id() != -1
        if self._trace is not trace or self._step_over \
                or inside and trace.outside >= self.split_min_ops:
            return None
        trace.outside = 0 if inside else trace.outside + 1
        trace.nodes.append((fn, tree, trace.refs(items)))
        return len(trace.nodes) - 1

    def begin(self) -> None:
        """The flush due before this thread's next recorded call, if any (``record``'s)."""
        with self._lock:
            self._begin(_graph_task_id() != -1)

    def _begin(self, inside: bool) -> None:
        # inside: the call is backward's (in an autograd graph task)
        if self._step_over:
            self.flush()
        elif inside and self._trace.outside >= self.split_min_ops:
            self._split()

    def place(self) -> int:
        """The next recorded call's place: calls since the last flush other than a split."""
        trace = self._trace
        return 0 if self._step_over else trace.start + len(trace.nodes)

    def _split(self) -> None:
        """Backward's first call after ``split_min_ops`` calls outside it: the device runs the
        forward while the host records the rest of the step (a loop reading its loss waits for
        the forward alone); its cheap live values are recomputed by the rest (``defer_split``).
        The same call every step: the same two programs. An unbounded recording
        (``torch_xla.compile``'s, a capture's) is one program. Places go on."""
        trace = self._trace
        if math.isinf(self.max_ops):
            trace.outside = 0
            return
        defer_split.split(self, trace, Pending)
        metrics.count("deferred_splits")

    def _alive(self, trace: _Trace) -> tuple[list, tuple]:
        targets, wanted = [], []
        for n, refs in enumerate(trace.outs):
            for leaf, ref in enumerate(refs):
                p = ref()
                if p is not None:
                    targets.append(p)
                    wanted.append((n, leaf))
        return targets, tuple(wanted)

    def flush(self) -> None:
        """Run the recording as one program and give each live pending value its array."""
        with self._lock:
            self._step_over = False
            trace = self._trace
            if not trace.nodes:
                return
            self._trace = _Trace(self)
            targets, wanted = self._alive(trace)
            metrics.count("deferred_ops", len(trace.nodes))
            # Python numbers enter as kept device arrays (``numbers.py``), each otherwise a
            # host-to-device transfer at every launch (AdamW's lists: ~2 a parameter a step).
            inputs, placed = fused_program.committed(trace.inputs)
            inputs = [numbers.cached(x) if x.__class__ in _NUMBERS else x for x in inputs]
            trace.inputs = None
            n_inputs = len(inputs)
            # A result the recording reads is an input (donated there if nothing else holds it).
            spares = [x for x in self._spares if id(x) not in trace._array_ids]
            self._spares = []
            if not targets:
                return
            donate = fused_program.donatable(inputs, targets, spares, placed)
            spares = None  # the spares no output reuses are freed before the program runs
            key = (tuple(trace.nodes), wanted, donate)
            entry = self._programs.get(key)
            if entry is None:
                order = (fused_program.in_place_order(key[0], wanted, targets, inputs, donate)
                         if donate else range(len(targets)))
                # The forms its calls' readers ask of them (``read_forms``), as a capture's; once
                # a program: the key is the recording as made.
                nodes = list(key[0])
                read_forms.apply(nodes)
                entry = self._programs[key] = (fused_program.keyed(
                    tuple(nodes), tuple(wanted[j] for j in order), donate), order)
            else:
                self.freezer.steady(len(key[0]))
            fused, order = entry
            targets = [targets[j] for j in order]
            metrics.count("executions")
            metrics.count("donated_inputs", len(donate))
            metrics.count("reused_buffers", len(inputs) - n_inputs)
            try:
                results = launch.run(f"defer_and_fuse[{len(trace.nodes)} ops]", fused, inputs)
            except BaseException as e:
                for p in targets:
                    p._error, p._trace = e, None
                raise
            seen = {id(x) for x in inputs}
            for p, r in zip(targets, results, strict=True):
                if id(r) in seen:  # a program may hand an input back; storages never share one
                    r = tensors.copy_buffer(r)
                seen.add(id(r))
                p._value, p._trace = r, None
                # The pending value's shape and dtype are r's: JAX's ``nbytes`` takes ~4 us (NumPy's
                # size protocol), ~1.4 ms a flush of a 12-layer step's 334 results.
                if math.prod(p.shape) * p.dtype.itemsize >= SPARE_MIN_BYTES:
                    self._spares.append(r)

    def own(self) -> None:
        """The calling thread entered the mode: its host reads flush, other threads' ops warn."""
        self.owner = threading.get_ident()

    def unfreeze(self) -> None:
        with self._lock:
            self.freezer.release()

    def host_read(self) -> None:
        """A device value is read on the host: on the thread that entered the mode, the recording
        ends here, also when the value read was run before (a loss a size-bound flush computed;
        the rest of its step would otherwise open the next step's recording, cutting each step at
        another op). A read on another thread (a step closure's worker reading a finished step
        while this one records the next) leaves the recording alone."""
        if threading.get_ident() == self.owner and not self.making:
            self.flush()

    def precision_changed(self) -> None:
        """The matmul precision is about to change (``torch.tpu.set_precision``, ``precision``):
        a program computes at the precision current where it is traced, the flush's, so what
        was recorded runs now, at its own (a product recorded inside ``precision(HIGHEST)`` ran
        at the default after the block). An unbounded recording (a ``torch_xla.compile``
        region's, a capture's) is one program: its owner's precision is the one at its end."""
        if not math.isinf(self.max_ops):
            self.flush()

    def step_ended(self) -> None:
        """An optimizer step ended: a bounded recording flushes before the next op it records
        (an unbounded one, a ``torch_xla.compile`` region's, only where its owner says). Not at
        once: ``zero_grad(set_to_none=True)`` usually follows, and gradients dead by the flush
        are not written out."""
        if not math.isinf(self.max_ops):
            self._step_over = True

    def release_spares(self) -> None:
        """Drop the kept results (their buffers are freed once nothing else holds them)."""
        with self._lock:
            self._spares = []

    def pending_key(self) -> tuple | None:
        """What names the program the pending recording will run (its calls, how they are wired
        and the signatures of its inputs), None when nothing is pending: equal keys, one program."""
        with self._lock:
            trace = self._trace
            if not trace.nodes:
                return None
            return tuple(trace.nodes), tuple(_signature(x) for x in trace.inputs)

    def pending_hlo(self) -> str:
        """The pending recording as StableHLO text (empty when nothing is pending)."""
        with self._lock:
            trace = self._trace
            if not trace.nodes:
                return ""
            _, wanted = self._alive(trace)
            fused = jax.jit(fused_program.replay(tuple(trace.nodes), wanted))
            return fused.lower(*trace.inputs).as_text()


RECORDER = Recorder()


def pending_hlo() -> str:
    """The computation DeferAndFuse holds pending, as StableHLO text, without running it."""
    return RECORDER.pending_hlo()
