"""DeferAndFuse's replay: an op call that repeats the call recorded at the same place of an earlier
recording is appended to the recording without the op path.

A training loop records the same calls every step, in the same order (its flushes end each step
at the same op). Each call still took the whole op path: the handler, binding, the signature
and its lookup (``seen_calls``), reading the arrays, the hooks, the executor and the recorder's
key (~10 us of torchtpu's Python a call on this box, ~1,600 calls a 12-layer Llama step). Here
the recording's n-th call (``Taped``) is kept as the op path ended it: the op, each tensor
argument's geometry (shape, strides, offset, dtype), every other argument's value, where each
of the program's inputs came from (which argument's storage value, or which number) with its
signature, the program, its output and the result tensor's form, and the default dtype it ran
under. A call at the same place of a later recording (``Replay.repeat``, asked by the
dispatcher's entry through ``HOOKS.replay`` while DeferAndFuse records) whose op and arguments
are the same in all of these, under the same default dtype, appends the same node over its own
values and makes its result tensor: what the op path would have done, since that path is a
function of exactly these facts (the handler, its signature and reads, the meta kernel's
result, which the default dtype decides for a Python float over integer tensors, the
recorder's key).
Anything else takes the op path, and its call is kept for the next recording (``keep``). Calls
over tensor lists (clipping's and an optimizer's ``_foreach_*``, ``cat``) are kept at their places
as ``defer_replay_lists.ListTaped`` and replayed the same way; ``repeat`` answers ``hooks.MISS``
for a call it does not replay (an in-place call's own result is None).

Only calls whose path depends on nothing else are kept (``handle.replayable``, set by the
dispatcher: a lowered functional op with no tensor lists, no data-dependent shape, no check of
values, no argument rewriting, and no random key or one drawn by a rule of the call's signature
(SDPA's dropout); ``_to_copy``'s kernel, marked ``_torchtpu_replayable``: autocast's casts),
keyword arguments only of types whose equality is exact (``_EXACT``), and only when the call
recorded exactly one node and returned a fresh tensor whose storage holds exactly its output
(row-major, or a dense layout's memory order), or recorded nodes reading only its arguments
and each other (never a key) and returned a tuple or list of such tensors and constants (SDPA's
forward and backward with their results' recorded transposes: ``_tape_steps``); no call inside
a capture. Every tensor argument's storage must hold a computed array or a value pending
in the recording (not a lazy cast, a padded value: those take the op path). A call whose sizes
vary at its call site (``compile/eager_buckets.py``) is never the same call again, so it is
never replayed; one of a structure that started growing elsewhere after it was kept is
replayed at its own exact sizes, as it was recorded before (the same values either way).
"""

from __future__ import annotations

import functools
import operator
import threading
from _thread import get_ident
from math import copysign

import torch
from jax._src.array import ArrayImpl

from torchtpu.device import tensors
from torchtpu.device.hooks import HOOKS, MISS
from torchtpu.eager import defer_replay_lists
from torchtpu.eager.defer import RECORDER, Pending
from torchtpu.eager.defer_signatures import signature as _signature

_Tensor = torch.Tensor
_graph_task_id = torch._C._current_graph_task_id
_default_dtype = torch.get_default_dtype
_SEQUENCES = (list, tuple)
_CONSTANT_RESULTS = (int, bool, float)  # a result besides tensors (SDPA's sizes), or None
TAPE_MAX = 1 << 14  # calls kept (a recording flushes at ``defer.MAX_OPS`` anyway)
# Keyword arguments kept only of types whose ``==`` tells every value apart (not numbers:
# 1 == True == 1.0, 0.0 == -0.0), so that a dict comparison checks them.
_EXACT = (type(None), str, torch.dtype, torch.device, torch.layout, torch.memory_format)
STRIKES, RETRY = 3, 64


class Taped:
    """One call as the op path recorded it. ``tensors``: (position, shape, strides, offset,
    dtype, read, alias) of each tensor argument, ``read`` what the program takes of its
    storage's value (its signature: a number for a value pending in the recording, (shape,
    dtype, weak type) for an array) or None, ``alias`` the first argument's position sharing its
    storage (its own if none); ``consts``: (position, type, key) of every other argument;
    ``kwargs``: the keyword arguments (constants of types whose equality is exact: ``_EXACT``);
    ``sources``: the argument positions giving the program's inputs, in order; ``out``: the
    output's (shape, dtype, weak type, signature number); ``wrap``: the result tensor's maker;
    ``default``: the default dtype it was made under (``int_tensor * 2.5``'s dtype). A call of
    several nodes or results has ``steps`` instead of ``sources`` and ``fn``: per node (program,
    per input an argument's position or (node, output) of an earlier one, its outputs as
    ``Pending`` takes them), and ``out`` is (the result's type, per item (node, output, maker) or
    (None, the constant, None))."""

    __slots__ = ("op", "nargs", "kwargs", "tensors", "consts", "sources", "fn", "out", "wrap",
                 "default", "strikes", "steps", "pick", "pair")

    def __init__(self, op, nargs, kwargs, tensors_, consts, sources, fn, out, wrap) -> None:
        self.op, self.nargs, self.kwargs = op, nargs, kwargs
        self.default = _default_dtype()
        self.tensors, self.consts = tensors_, consts
        self.sources, self.fn, self.out, self.wrap = sources, fn, out, wrap
        # The program's inputs from the checked values by argument position, in one C call
        # where there are several (one: ``sources[0]``'s, as a tuple).
        self.pick = None if sources is None or len(sources) == 1 else \
            operator.itemgetter(*sources) if sources else _no_inputs
        # Two tensor arguments on storages of their own (each its own alias): told apart by
        # identity at replay.
        self.pair = len(tensors_) == 2 and all(e[6] == e[0] for e in tensors_)
        self.strikes = 0  # calls of its op at its place since it was kept that it did not serve
        self.steps = None  # a call of several nodes or results (``_tape_steps``)


def _no_inputs(values: dict) -> tuple:
    return ()


def _const_key(v):
    """A non-tensor argument as ``seen_calls.signature`` keys it: its value and type (a float's
    sign: 0.0 and -0.0 compute differently; a sequence's item types)."""
    kind = type(v)
    if kind is float:
        return v, copysign(1.0, v)
    if kind in _SEQUENCES:
        return tuple(v), tuple(map(type, v))
    return v


class Replay:
    """The kept calls of the process's recorder, by their place in a recording."""

    def __init__(self, recorder=RECORDER) -> None:
        self.recorder = recorder
        self.tape: dict = {}  # place in the recording -> Taped
        self.replayed = 0     # calls appended here (tests read the delta around a call)
        self.lists = 0        # of them, calls over tensor lists (``defer_replay_lists``)

    def repeat(self, op, args: tuple, kwargs: dict):
        """op(*args, **kwargs)'s result where the call repeats the one kept at its place, else
        ``MISS`` (the op path runs it, then ``keep``)."""
        rec = self.recorder
        # After an optimizer step the next recorded call starts a recording (``record``
        # flushes first): its place there is 0. (Every recorded call of a step comes here:
        # ``Recorder.place`` and ``begin`` inline, the lock only where a flush is due.)
        trace = rec._trace
        over = rec._step_over
        kept = self.tape.get(0 if over else trace.start + len(trace.nodes))
        if kept is None or kept.op is not op or len(args) != kept.nargs or kwargs != kept.kwargs \
                or _default_dtype() is not kept.default \
                or HOOKS.deferrer is not rec or HOOKS.capture is not None \
                or not (get_ident() == rec.owner or _graph_task_id() != -1 or rec.in_order()):
            return MISS
        if over or trace.outside >= rec.split_min_ops:
            rec.begin()
        if kept.__class__ is not Taped:
            out = kept.replay(rec, args)  # a call over lists (``defer_replay_lists``)
            if out is not MISS:
                self.replayed += 1
                self.lists += 1
            return out
        # A ``Taped`` call's facts checked here, in this frame (every replayed call: ~1,500 a
        # 12-layer Llama step).
        values, storages = {}, {}
        pair, before = kept.pair, MISS
        for pos, shape, stride, offset, dtype, read, alias in kept.tensors:
            t = args[pos]
            if t.__class__ is not _Tensor and not isinstance(t, _Tensor) \
                    or t.dtype is not dtype or t.shape != shape \
                    or t.stride() != stride or t.storage_offset() != offset \
                    or t.is_conj() or t.is_neg():
                return MISS
            try:
                a = t.untyped_storage()._tpu_array
            except AttributeError:  # a CPU tensor's storage (no ``getattr`` call a tensor)
                return MISS
            # Arguments sharing a storage as the kept call's did (x @ x.t() is not x @ y.t():
            # the program reads that storage once); None: its one tensor argument. Two that
            # did not share one (``pair``: most calls of two tensors) are told apart by
            # identity, without the dict.
            if alias is not None:
                if pair:
                    if a is before:
                        return MISS
                    before = a
                elif storages.setdefault(id(a), pos) != alias:
                    return MISS
            if read is None:  # only its geometry read: a device value as the kept call's
                if a.__class__ is not Pending and a.__class__ is not ArrayImpl:
                    return MISS
                continue
            if a.__class__ is Pending and a._value is None:  # (``stored_value``'s first case)
                if a._trace is not trace or a._sig != read or a._error is not None:
                    return MISS
            else:
                a = defer_replay_lists.stored_value(a, trace, read)
                if a is None:
                    return MISS
            values[pos] = a
        for pos, kind, key in kept.consts:
            v = args[pos]
            # (The type first: a tensor compared with a constant would be an op call.)
            if type(v) is not kind or _const_key(v) != key:
                return MISS
            values[pos] = v
        if kept.steps is not None:
            return self._repeat_steps(rec, trace, kept, values)
        pick = kept.pick
        p = rec.append(trace, kept.fn, pick(values) if pick is not None
                       else (values[kept.sources[0]],), kept.out)
        if p is None:
            return MISS
        self.replayed += 1
        return kept.wrap(p)

    def mark(self, op, args: tuple) -> tuple:
        """Where the recording stands before a call takes the op path (``keep``), and what an
        in-place list call's targets held (the values it reads)."""
        rec = self.recorder
        trace = rec._trace
        lists = getattr(op.__dict__.get("_torchtpu_handler"), "lists", None)
        before = defer_replay_lists.before(args, lists[2]) if lists is not None and lists[2] \
            else None
        return rec.place(), trace, len(trace.nodes), before

    def keep(self, op, args: tuple, kwargs: dict, out, mark: tuple) -> None:
        """Keep the call that took the op path from ``mark`` on, where it can be replayed."""
        rec = self.recorder
        handle = op.__dict__.get("_torchtpu_handler")
        lists = getattr(handle, "lists", None)
        if not (op.__dict__.get("_torchtpu_replayable") or lists is not None
                or getattr(handle, "replayable", False)) \
                or any(type(v) not in _EXACT for v in kwargs.values()) \
                or HOOKS.deferrer is not rec or HOOKS.capture is not None:
            return
        place, trace, n, before = mark
        # Under the recording's lock: another thread's flush would end the recording read here
        # (a replay's ``append`` checks the recording again under it).
        with rec._lock:
            if rec._trace is not trace and rec._trace.start + rec._trace.carried == place:
                trace, n = rec._trace, rec._trace.carried  # it flushed first, as ``record``
                # does (a step's end, the split at backward's start, after the calls it carried)
            if rec._trace is not trace or len(trace.nodes) <= n or place >= TAPE_MAX \
                    or lists is not None and len(trace.nodes) != n + 1:
                return  # it recorded no node (a list call: other than one), or flushed
            # Keeping a call costs several times its replay: a place whose calls of one op keep
            # differing (sizes growing every step) is kept anew only at every ``RETRY``-th call
            # after a few; another op there (another loop) is kept at once.
            old = self.tape.get(place)
            strikes = 0 if old is None or old.op is not op else old.strikes + 1
            if old is not None:
                old.strikes = strikes
            if strikes > STRIKES and strikes % RETRY:
                return
            if lists is None:
                self._tape(rec, trace, n, op, args, kwargs, out, strikes)
                return
            kept = defer_replay_lists.tape(trace, n, op, handle, args, kwargs, out, before)
            if kept is not None:
                kept.strikes = strikes
                self.tape[place] = kept

    def _repeat_steps(self, rec, trace, kept: Taped, values: dict):
        """A call of several nodes or results (SDPA's: the attention's node, its laid-out
        results' transposes): its nodes appended in order, under the lock, none flushed in
        between (the bound is checked first), each reading arguments or earlier nodes' outputs."""
        made = []
        with rec._lock:
            if rec._trace is not trace or len(trace.nodes) + len(kept.steps) >= rec.max_ops:
                return MISS
            for fn, sources, outs in kept.steps:
                ps = rec.append_many(trace, fn, None, [
                    values[s] if s.__class__ is int else made[s[0]][s[1]] for s in sources], outs)
                if ps is None:
                    return MISS
                made.append(ps)
        self.replayed += 1
        form, results = kept.out
        return form([const if j is None else wrap(made[j][const])
                     for j, const, wrap in results])

    def _tape(self, rec, trace, n: int, op, args: tuple, kwargs: dict, out,
              strikes: int) -> None:
        """Keep the call that just took the op path as the n-th of ``trace``, where it
        recorded one node there and returned a fresh tensor holding its output whole, or
        recorded nodes from there on and returned a tuple or list of fresh tensors holding
        their outputs whole and constants (``_tape_steps``)."""
        if type(out) is not _Tensor:
            if type(out) in _SEQUENCES:
                self._tape_steps(rec, trace, n, op, args, kwargs, out, strikes)
            return
        if len(trace.nodes) != n + 1:
            return
        p = getattr(out.untyped_storage(), "_tpu_array", None)
        if p.__class__ is not Pending or p._trace is not trace or p._node != n or p._leaf \
                or len(trace.outs[n]) != 1:
            return
        wrap = _maker(out)
        fn, tree, refs = trace.nodes[n]
        if tree is not None or wrap is None:
            return
        taped, consts, held = _arguments(args)
        if taped is None:
            return
        reads = {}
        sources = _sources(trace, refs, args, consts, held, reads)
        if sources is None:
            return
        for entry in taped:
            entry[5] = reads.get(entry[0])
        kept = self.tape[trace.start + n] = Taped(
            op, len(args), dict(kwargs), tuple(tuple(e) for e in taped), tuple(consts),
            tuple(sources), fn, (p.shape, p.dtype, p.weak_type, p._sig), wrap)
        kept.strikes = strikes

    def _tape_steps(self, rec, trace, n: int, op, args: tuple, kwargs: dict, out,
                    strikes: int) -> None:
        """``_tape`` of a call whose nodes n.. read only its arguments and each other's
        outputs and whose results are fresh tensors around their outputs or constants."""
        taped, consts, held = _arguments(args)
        if taped is None:
            return
        reads, steps = {}, []
        for j in range(n, len(trace.nodes)):
            fn, tree, refs = trace.nodes[j]
            if tree is not None:
                return
            outer = [r for r in refs if r.__class__ is int or r[0] < n]
            found = _sources(trace, outer, args, consts, held, reads)
            if found is None:
                return
            found, sources, sigs = iter(found), [], []
            for r in refs:
                if r.__class__ is not int and r[0] >= n:  # an earlier node's output of this call
                    sources.append((r[0] - n, r[1]))
                    sigs.append(steps[r[0] - n][2][r[1]][3])
                    continue
                pos = next(found)
                sources.append(pos)
                sigs.append(_signature(trace.inputs[r]) if r.__class__ is int
                            else trace.outs[r[0]][r[1]]()._sig)
            # Its outputs as the recorder described them (dead ones have no pending value left).
            shapes = rec._shapes.get((fn, None, tuple(sigs)))
            if shapes is None or len(shapes[0]) != len(trace.outs[j]):
                return
            steps.append((fn, tuple(sources), shapes[0]))
        results, made = [], set()
        for o in out:
            if type(o) is _Tensor:
                p = getattr(o.untyped_storage(), "_tpu_array", None)
                wrap = _maker(o)
                if p.__class__ is not Pending or p._trace is not trace or p._node < n \
                        or wrap is None or id(p) in made:
                    return
                made.add(id(p))
                results.append((p._node - n, p._leaf, wrap))
            elif o is None or type(o) in _CONSTANT_RESULTS:
                results.append((None, o, None))
            else:
                return
        for entry in taped:
            entry[5] = reads.get(entry[0])
        kept = self.tape[trace.start + n] = Taped(
            op, len(args), dict(kwargs), tuple(tuple(e) for e in taped), tuple(consts),
            None, None, (type(out), tuple(results)), None)
        kept.steps, kept.strikes = tuple(steps), strikes


def _maker(out):
    """What makes a tensor like out around another value: out is its storage's value whole
    (row-major, or a dense layout's memory order: ``results.Stored``); None for anything
    else."""
    if out.storage_offset() or not out.numel() or out.is_conj() or out.is_neg() \
            or out.untyped_storage().nbytes() != out.numel() * out.element_size():
        return None
    size, dtype = tuple(out.shape), out.dtype
    return tensors.wrapper(size, dtype) if out.is_contiguous() \
        else functools.partial(tensors.wrap_strided, dtype=dtype, size=size, stride=out.stride())


def _arguments(args: tuple) -> tuple:
    """(tensor facts to fill, constants, storage value id -> first argument) of a call's
    arguments (a lone tensor's alias None: nothing to compare); (None, None, None) where a
    sequence holds a tensor."""
    held, taped, consts = {}, [], []
    for pos, v in enumerate(args):
        if isinstance(v, _Tensor):
            a = getattr(v.untyped_storage(), "_tpu_array", None)
            alias = held.setdefault(id(a), pos)
            if a.__class__ is Pending and a._value is not None:
                held.setdefault(id(a._value), pos)
            taped.append([pos, v.shape, v.stride(), v.storage_offset(), v.dtype, None, alias])
        elif v.__class__ in _SEQUENCES and any(isinstance(x, _Tensor) for x in v):
            return None, None, None
        else:
            consts.append((pos, type(v), _const_key(v)))
    if len(taped) == 1:
        taped[0][6] = None  # no other tensor argument to share its storage
    return taped, consts, held


def _sources(trace, refs, args: tuple, consts: list, held: dict, reads: dict) -> list | None:
    """The argument giving each of a node's inputs refs (an array or a number from outside the
    recording, or a value pending in it), noting what the program reads of its storage in
    reads; None where an input is no argument's (a key, a converted number)."""
    sources = []
    for r in refs:
        if r.__class__ is int:
            x = trace.inputs[r]
            if x.__class__ is ArrayImpl:
                pos = held.get(id(x))
                read = (x.aval.shape, x.aval.dtype, x.aval.weak_type)
            else:  # a traced number: the argument it is
                pos = next((i for i, _, _ in consts if args[i] is x), None)
                read = None
        else:
            source = trace.outs[r[0]][r[1]]()
            pos = None if source is None else held.get(id(source))
            read = None if source is None else source._sig
        if pos is None:
            return None
        if read is not None and reads.setdefault(pos, read) != read:
            return None  # one storage read as two values (cannot be: kept out all the same)
        sources.append(pos)
    return sources


REPLAY = Replay()
_lock = threading.Lock()


def start() -> None:
    """Calls replay from here on (DeferAndFuse records)."""
    with _lock:
        HOOKS.replay = REPLAY


def stop() -> None:
    """Calls take the op path again. The kept calls stay (shapes, constants and programs, no
    tensor or array): a loop that enters the mode at every step replays from its second."""
    with _lock:
        HOOKS.replay = None
