"""DeferAndFuse's replay of calls over tensor lists: ``defer_replay``'s scheme for the
``_foreach_*`` calls of an optimizer and of gradient clipping (in place, or with a list of
results) and ``cat``.

A 12-layer Llama step's tail (``clip_grad_norm_``, AdamW) is ~12 such calls over its 111
parameters, and each took ``seen_lists``' short path: a signature of every tensor's geometry,
hashed and compared, each storage's value read, the twin's spec and executor, the recorder's
flatten, key and lookup: ~12-18 us a tensor a call here, ~15 ms of a ~140 ms recording. Here
the recording's n-th call, where it was one of these, is kept as the op path ended it
(``ListTaped``): per argument, a tensor's or each listed tensor's geometry (shape, strides,
offset, dtype), what the program read of its storage (the signature of a value pending in the
recording, or an array's shape, dtype and weak type) and the first argument sharing that storage;
a traced number's (or a list of them) type, sign and whether it is baked in
(``meta._traced_number_key``, as the short path's signature keys it), any other argument
exactly (``meta.exact_key``); the program and its argument structure, and where each of its
inputs comes from (an argument, or an element of one). A call at the same place of a later
recording that equals it in all of these appends the same node over its own values: an in-place
call's targets then hold its outputs, as the short path leaves them; a functional call's results
are fresh tensors around them.

Kept only where the handler says the path is a function of these facts (``handle.lists``:
``dispatch``'s functional handler of a list-reading op that draws no key and has no
data-dependent shape, and the in-place handler with ``seen_lists``' short path), where the call
recorded exactly one node whose inputs are, in order, the tensors and fed numbers of its
arguments (checked, not assumed: a number the program bakes in, a converted complex, a view read
through a program of its own, a CPU tensor, a ``None`` in a list make it not kept), and where
every output ended where the short path puts it (each target's storage holding its output whole;
each result a fresh tensor holding one whole). Every tensor's storage must hold a computed array
or a value pending in this recording, the same value (its signature) as the kept call's, at
replay too.
"""

from __future__ import annotations

import operator

import torch
from jax._src.array import ArrayImpl

from torchtpu.device import tensors
from torchtpu.device.hooks import MISS
from torchtpu.eager import meta
from torchtpu.eager.defer import Pending

_Tensor = torch.Tensor
_SEQUENCES = (list, tuple)
_NUMBERS = (bool, int, float)
# What an argument is: a tensor, a list of tensors, a number the program takes (or a list of
# them), anything else (a constant: the program holds it).
TENSOR, TENSORS, FED, CONST = range(4)


def _read_of(a):
    """What a program reads of a storage's value: a pending value's signature number, an array's
    (shape, dtype, weak type); None for anything else (a lazy value, a padded one)."""
    if a.__class__ is Pending:
        if a._value is None:
            return a._sig if a._error is None else None
        a = a._value
    if a.__class__ is ArrayImpl:
        aval = a.aval
        return aval.shape, aval.dtype, aval.weak_type
    return None


def _facts(t, a) -> tuple | None:
    """A tensor's ((shape, strides, offset, dtype), read), where its storage's value a is a
    recorded or computed value. The tensor may be its value whole, reshaped (``stack``'s
    unsqueezed norms read by ``cat``) or a view of it (rotary's half read by ``cat``): the
    program takes the value, and a view's geometry is the program's own (``tape`` checks that
    the program's input is the value itself, not a read of the view by a program of its own)."""
    if not isinstance(t, _Tensor) or t.is_cpu or t.is_conj() or t.is_neg():
        return None
    read = _read_of(a)
    if read is None:
        return None
    return (t.shape, t.stride(), t.storage_offset(), t.dtype), read


def before(args: tuple, written: tuple) -> dict:
    """What the storages of an in-place call's targets hold before it writes them (by storage)."""
    held = {}
    for pos in written:
        if pos < len(args):
            v = args[pos]
            for t in v if v.__class__ in _SEQUENCES else (v,):
                if isinstance(t, _Tensor):
                    st = t.untyped_storage()
                    held[st._cdata] = getattr(st, "_tpu_array", None)
    return held


class ListTaped:
    """One call over tensor lists as the op path recorded it. ``args``: per argument (kind,
    facts): TENSOR (facts of one tensor, alias), TENSORS (a tuple of them), FED (its traced key),
    CONST (its exact key); ``leaves``: per program input, (position, index in a list or None);
    ``fn``, ``tree``: the program and its arguments' structure; ``outs``: its outputs as
    ``Pending`` takes them; ``results``: the result tensors' makers (a functional call; None: in
    place), ``single``: one result, not a list, ``listed``: else the list's type; ``targets``:
    an in-place call's written (position, index), in output order."""

    __slots__ = ("op", "nargs", "kwargs", "default", "strikes", "args", "leaves", "fn", "tree",
                 "outs", "results", "single", "listed", "targets", "distinct")

    def replay(self, rec, args: tuple):
        """The call's result, appended to the recording over args' values; ``miss`` where any
        fact differs."""
        trace = rec._trace
        # The program's inputs in ``leaves``' order, which is the arguments' (``tape``): each
        # tensor's value, a list's values, a fed number or each of a fed list's, appended as
        # they are checked (no second pass over ``leaves``). A call whose tensors' storages
        # were all distinct (``distinct``: an optimizer's) checks that once at the end, not
        # by a dict entry a tensor.
        distinct = self.distinct
        items, storages = [], None if distinct is not None else {}
        for pos, (kind, facts) in enumerate(self.args):
            v = args[pos]
            if kind == TENSOR:
                if not _values((v,), facts, trace, storages, pos, items):
                    return MISS
            elif kind == TENSORS:
                if v.__class__ not in _SEQUENCES or len(v) != len(facts) or \
                        not _values(v, facts, trace, storages, pos, items):
                    return MISS
            elif kind == FED:
                typ, key, default = facts
                if type(v) is not typ or meta._traced_number_key(v, default) != key:
                    return MISS
                if typ in _SEQUENCES:
                    items.extend(v)
                else:
                    items.append(v)
            else:
                typ, key = facts
                if type(v) is not typ or meta.exact_key(v) != key:
                    return MISS
        if distinct:  # (its tensors' values among the items: those must be distinct still)
            values = distinct(items)
            if len(set(map(id, values))) != len(values):
                return MISS
        ps = rec.append_many(trace, self.fn, self.tree, items, self.outs)
        if ps is None:
            return MISS
        if self.results is None:
            for (pos, i), p in zip(self.targets, ps):
                (args[pos] if i is None else args[pos][i]).untyped_storage()._tpu_array = p
            return None
        out = [wrap(p) for wrap, p in zip(self.results, ps)]
        return out[0] if self.single else out if self.listed is list else tuple(out)


def _values(ts, facts: tuple, trace, storages: dict, pos: int, xs: list) -> bool:
    """Whether each of the tensors ts (argument pos) is as kept: their storages' values are
    appended to xs as they are checked."""
    # (Every tensor of an optimizer's lists comes here: ~1,800 a 12-layer Llama step.)
    for i, t in enumerate(ts):
        geometry, read, alias = facts[i]
        # (The geometry as one tuple, compared in C: a comparison and an ``or`` a fact fewer.)
        if t.__class__ is not _Tensor and not isinstance(t, _Tensor) or (
                t.shape, t.stride(), t.storage_offset(), t.dtype) != geometry \
                or t.is_conj() or t.is_neg():
            return False
        try:
            a = t.untyped_storage()._tpu_array
        except AttributeError:  # a CPU tensor's storage (no ``getattr`` call a tensor)
            return False
        # Arguments sharing a storage as the kept call's did (the program reads it once);
        # None: none did, which ``replay`` checks at once.
        if storages is not None and storages.setdefault(id(a), (pos, i)) != alias:
            return False
        if a.__class__ is Pending and a._value is None:  # (``stored_value``'s first case)
            if a._trace is not trace or a._sig != read or a._error is not None:
                return False
        elif a.__class__ is ArrayImpl:  # (and its common case under Strict)
            aval = a.aval
            if (aval.shape, aval.dtype, aval.weak_type) != read:
                return False
        else:
            a = stored_value(a, trace, read)
            if a is None:
                return False
        xs.append(a)
    return True


def stored_value(a, trace, read: tuple):
    """A storage's value a (pending or an array) where it feeds a replay as the kept call read
    it: pending in this recording under the same signature, or an array of the same shape,
    dtype and weak type; else None."""
    if a.__class__ is Pending:
        if a._value is None:
            if a._error is not None or a._trace is not trace or a._sig != read:
                return None
            return a
        a = a._value
    if a.__class__ is not ArrayImpl:
        return None
    aval = a.aval
    return a if (aval.shape, aval.dtype, aval.weak_type) == read else None


def tape(trace, n: int, op, handle, args: tuple, kwargs: dict, out, held: dict | None
         ) -> ListTaped | None:
    """The call that just took the op path as the n-th of trace, recorded as one node there,
    kept where it can be replayed (see the module's doc); else None. ``held``: what its targets'
    storages held before it (``before``)."""
    fn, tree, refs = trace.nodes[n]
    traced, defaults, written = handle.lists

    def value(t):  # what the call read of t's storage
        st = t.untyped_storage()
        a = getattr(st, "_tpu_array", None)
        return held.get(st._cdata, a) if held else a

    kept_args, leaves, first = [], [], {}
    for pos, v in enumerate(args):
        if isinstance(v, _Tensor):
            a = value(v)
            f = _facts(v, a)
            if f is None:
                return None
            kept_args.append((TENSOR, (f + (first.setdefault(id(a), (pos, 0)),),)))
            leaves.append((pos, None))
        elif v.__class__ in _SEQUENCES and v and isinstance(v[0], _Tensor):
            fs = []
            for i, t in enumerate(v):
                a = value(t) if isinstance(t, _Tensor) else None
                f = None if a is None else _facts(t, a)
                if f is None:
                    return None
                fs.append(f + (first.setdefault(id(a), (pos, i)),))
                leaves.append((pos, i))
            kept_args.append((TENSORS, tuple(fs)))
        elif pos in traced and _fed(v, defaults[pos]):
            kept_args.append((FED, (type(v), meta._traced_number_key(v, defaults[pos]),
                                    defaults[pos])))
            leaves.extend([(pos, i) for i in range(len(v))] if v.__class__ in _SEQUENCES
                          else [(pos, None)])
        else:
            try:
                key = meta.exact_key(v)
                hash(key)
            except TypeError:
                return None
            kept_args.append((CONST, (type(v), key)))
    # The program's inputs must be these leaves, in order (as ``seen_lists.arrays`` gives them).
    if len(refs) != len(leaves):
        return None
    for r, (pos, i) in zip(refs, leaves):
        v = args[pos] if i is None else args[pos][i]
        if isinstance(v, _Tensor):
            a = value(v)
            if r.__class__ is int:
                if trace.inputs[r] is not (a._value if a.__class__ is Pending else a):
                    return None
            elif a.__class__ is not Pending or a._value is not None or a._trace is not trace \
                    or (a._node, a._leaf) != r:
                return None
        elif r.__class__ is not int or trace.inputs[r] is not v:
            return None
    ps = [ref() for ref in trace.outs[n]]
    if any(p is None for p in ps):
        return None
    kept = ListTaped()
    kept.op, kept.nargs, kept.kwargs = op, len(args), dict(kwargs)
    kept.default, kept.strikes = torch.get_default_dtype(), 0
    kept.args, kept.leaves, kept.fn, kept.tree = tuple(kept_args), tuple(leaves), fn, tree
    kept.distinct = _distinct(kept.args, leaves)
    kept.outs = tuple((p.shape, p.dtype, p.weak_type, p._sig) for p in ps)
    kept.results = kept.targets = None
    kept.single = False
    if written:  # in place: each target's storage holds its output, in order
        if out is not None:
            return None
        targets = []
        for pos in written:
            v = args[pos]
            targets.extend([(pos, i) for i in range(len(v))] if v.__class__ in _SEQUENCES
                           else [(pos, None)])
        if len(targets) != len(ps):
            return None
        for (pos, i), p in zip(targets, ps):
            t = args[pos] if i is None else args[pos][i]
            if t.untyped_storage()._tpu_array is not p or tuple(t.shape) != tuple(p.shape):
                return None
        kept.targets = tuple(targets)
        return kept
    kept.single = type(out) is _Tensor
    outs = [out] if kept.single else out
    if type(outs) not in _SEQUENCES or len(outs) != len(ps):
        return None
    kept.listed = type(outs)
    makers = []
    for t, p in zip(outs, ps):
        wrap = _maker(t, p)
        if wrap is None:
            return None
        makers.append(wrap)
    kept.results = tuple(makers)
    return kept


def _distinct(kept_args: list, leaves: list):
    """Where no two of a call's tensors shared a storage value (each its own alias): what
    picks its tensors' values out of its program's inputs (``replay``'s items), or False for a
    call of one tensor (nothing to tell apart); else None (``_values`` checks every alias)."""
    at = []
    for j, (pos, i) in enumerate(leaves):
        kind, facts = kept_args[pos]
        if kind == TENSOR or kind == TENSORS:
            alias = facts[0 if i is None else i][2]
            if alias != (pos, 0 if i is None else i):
                return None
            at.append(j)
    if len(at) < 2:
        return False
    return operator.itemgetter(*at)


def _fed(v, default) -> bool:
    """Whether a traced argument's value is a program input: a real number the spec does not
    bake in, or a list of real numbers (``calls.entries_of``)."""
    if v.__class__ in _SEQUENCES:
        return bool(v) and all(type(x) in _NUMBERS for x in v)
    return type(v) in _NUMBERS and not meta.is_baked_number(v, default)


def _maker(t, p):
    """The result tensor's maker, where t is fresh and its storage holds exactly p."""
    if type(t) is not _Tensor or t.untyped_storage()._tpu_array is not p or t.storage_offset() \
            or not t.numel() or t.is_conj() or t.is_neg() \
            or t.untyped_storage().nbytes() != t.numel() * t.element_size():
        return None
    size, dtype = tuple(t.shape), t.dtype
    if t.is_contiguous():
        return tensors.wrapper(size, dtype)
    return None

