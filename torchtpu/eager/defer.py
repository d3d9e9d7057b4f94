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
``MAX_OPS`` ops and when the mode is left.
The fused program is cached by the recording's structure (programs called and how their values
connect), which outputs are still alive and which inputs are donated; JAX adds the input shapes.
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

from torchtpu import metrics
from torchtpu.device import launch, ownership, tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.eager import facts, frozen, fused_program, numbers
from torchtpu.runtime import warm

MAX_OPS = 4000
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
        fn = _astypes[dtype] = warm.named(jax.jit(lambda x: x.astype(dtype)), "astype", dtype)
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


class _Trace:
    """One recording: calls, their inputs from outside, and weak references to their outputs."""

    def __init__(self, recorder: Recorder) -> None:
        self.recorder = recorder
        self.nodes: list = []    # (fn, args treedef or None, refs)
        self.outs: list = []     # per node, weakrefs to its Pending outputs
        self.inputs: list = []   # arrays and numbers from outside the recording
        self._array_ids: dict = {}

    def input(self, x) -> int:
        # The same array used twice is one input; numbers and host arrays are never merged,
        # so the recording's structure does not depend on which equal numbers Python shares.
        if isinstance(x, jax.Array):
            i = self._array_ids.get(id(x))
            if i is not None:
                return i
            self._array_ids[id(x)] = len(self.inputs)
        self.inputs.append(x)
        return len(self.inputs) - 1


# Argument signatures (a shape, dtype and weak type; a Python number's type) by number: a
# recorded call's key holds small ints, cheap to hash, where tuples of NumPy dtypes were hashed
# at every op. Facts, shared by every recorder (captures too).
_SIG_NUMBERS: dict = {}
_SIGS: list = []
_sig_lock = threading.Lock()


def _number_of(sig) -> int:
    n = _SIG_NUMBERS.get(sig)
    if n is None:
        with _sig_lock:
            n = _SIG_NUMBERS.get(sig)
            if n is None:
                n = _SIG_NUMBERS[sig] = len(_SIGS)
                _SIGS.append(sig)
    return n


def _signature(x) -> int:
    if x.__class__ is ArrayImpl:
        aval = x.aval  # without the shape and dtype properties' Python steps
        return _number_of((aval.shape, aval.dtype, aval.weak_type))
    if isinstance(x, (bool, int, float, complex)):
        return _number_of(type(x))
    return _number_of((tuple(x.shape), np.dtype(x.dtype), getattr(x, "weak_type", False)))


def _abstract(n: int):
    sig = _SIGS[n]
    if isinstance(sig, type):
        return sig(0)
    return jax.ShapeDtypeStruct(sig[0], sig[1], weak_type=sig[2])


def _outputs(fn, tree, sig: tuple, call_args) -> tuple:
    """(per output (shape, dtype, weak type, signature number), out tree, whether single)."""
    avals, out_tree, single = facts.shapes(fn, tree, tuple(_SIGS[n] for n in sig), call_args)
    outs = tuple((a.shape, a.dtype, a.weak_type, _number_of((a.shape, a.dtype, a.weak_type)))
                 for a in avals)
    return outs, out_tree, single


class Recorder:
    """The process's recording; thread-safe, since backward runs on PyTorch's autograd thread."""

    max_ops = MAX_OPS

    def __init__(self) -> None:
        self._lock = threading.RLock()
        self._trace = _Trace(self)
        self._shapes: dict = {}
        self._programs: dict = {}
        self._spares: list = []  # the last flush's results, whose buffers a next flush may reuse
        self._step_over = False  # an optimizer step ended since the last flush
        self.freezer = frozen.Freezer()
        self.owner: int | None = None  # the thread that entered the mode (its loop reads)
        self._warned_threads = False

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
        tree = None
        for a in args:
            if a.__class__ in _SEQUENCES:
                args, tree = jax.tree_util.tree_flatten(args)
                break
        # (Backward's ops, on PyTorch's autograd thread, are in a graph task: no call.)
        if self.owner is not None and not self._warned_threads \
                and threading.get_ident() != self.owner and _graph_task_id() == -1:
            self._warn_other_thread()
        with self._lock:
            if self._step_over:
                self.flush()
            trace = self._trace
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
            inputs = [numbers.cached(x) if x.__class__ in _NUMBERS else x
                      for x in fused_program.committed(trace.inputs)]
            trace.inputs = None
            n_inputs = len(inputs)
            # A result the recording reads is an input (donated there if nothing else holds it).
            spares = [x for x in self._spares if id(x) not in trace._array_ids]
            self._spares = []
            if not targets:
                return
            donate = fused_program.donatable(inputs, targets, spares)
            spares = None  # the spares no output reuses are freed before the program runs
            key = (tuple(trace.nodes), wanted, donate)
            entry = self._programs.get(key)
            if entry is None:
                order = (fused_program.in_place_order(key[0], wanted, targets, inputs, donate)
                         if donate else range(len(targets)))
                # keep_unused: the appended spares are parameters only so that XLA can alias them.
                fused = jax.jit(fused_program.replay(key[0], tuple(wanted[j] for j in order)),
                                donate_argnums=donate, keep_unused=True)
                entry = self._programs[key] = (fused, order)
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
        if threading.get_ident() == self.owner:
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
