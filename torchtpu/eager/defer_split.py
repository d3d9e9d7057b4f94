"""DeferAndFuse's split at backward's start: what the forward's program writes, and what the
backward's recomputes.

At the split (``Recorder._split``) every value still referenced is an output of the forward's
program: mostly what autograd saved for backward. Many of those are cheap functions of others
it saved too: an RMSNorm's normalized rows (its input times its saved ``rsqrt``), autocast's
bfloat16 copies of one activation (one per product reading it), SiLU's output and the gated
product (the two projections are saved), a parameter's bfloat16 copy, the float32
log-softmax of the head's bfloat16 logits. Written by the forward and read back by the
backward, they cost the device twice their bytes (the 2-block step at the chip's width wrote
2.2 GB, half of it the log-softmax); the one program of an unsplit step never writes them, its
compiler fuses them into their readers. So the split recomputes them in the backward's
program instead: each such call is recorded again at the head of the next recording, reading
values the forward's program writes anyway, parameters, or a smaller value it then writes
(the logits, half the log-softmax's bytes), and its pending value moves there.

A value is recomputed when its producer and the calls between it and what it reads (its cone,
walked back through calls that are not yet outputs) are all cheap (``_CHEAP``: elementwise
math, casts, layout moves; no product, reduction, gather, random draw or kernel) and it costs
the device fewer bytes: nothing new written, or 2 x the new values' bytes + the kept values'
bytes it reads < 2 x its own (a write and a read saved). A reduction is not recomputed: in the
backward's program it is a pass of its own over its input (the log-softmax's two over the
logits: 10.7 M of the backward's 59.6 M estimated cycles on v5e), where the forward fused it
into its producer. An op that declares row parts (``registry.row_parts``: the log-softmax's
max and log-sum a row) is the exception: the forward writes those parts (a number or two a
row) and the backward computes the result from its input and them, pointwise. A cone reaching
a value recomputed at a price (not for free) keeps the value: no chain of recomputations (the
residual stream from its deltas, which the TPU compiler itself makes slower). The plan is
cached by the recording's structure, outputs and input signatures, so every step carries the
same calls: the same two programs.
"""

from __future__ import annotations

import math
import weakref

import jax
from jax.extend.core import ClosedJaxpr, Jaxpr

from torchtpu import metrics
from torchtpu.cache import warm_keys
from torchtpu.eager import defer_signatures as signatures
from torchtpu.eager import program
from torchtpu.lowering import registry

# Primitives a recomputed call may use: each reads its inputs once and does little per element.
_CHEAP = frozenset({
    "abs", "add", "and", "broadcast_in_dim", "ceil", "clamp", "concatenate",
    "convert_element_type", "copy", "copy_p", "cos", "div", "eq", "erf", "exp", "exp2", "expm1",
    "expand_dims", "floor", "ge", "gt", "integer_pow", "iota", "is_finite", "le", "log",
    "log1p", "logistic", "lt", "max", "min", "mul", "ne", "neg", "not", "or", "pad", "pow",
    "reduce_precision", "rem", "reshape", "rev",
    "round", "rsqrt", "select_n", "sign", "sin", "slice", "sqrt", "square", "squeeze",
    "stop_gradient", "sub", "tan", "tanh", "transpose", "xor", "pjit", "jit", "custom_jvp_call",
    "custom_vjp_call", "custom_vjp_call_jaxpr", "closed_call"})
CONE_CALLS = 32  # a cone longer than this is kept, not walked (planning stays cheap)
MIN_BYTES = 1 << 16  # smaller values are kept: nothing to save
_cheap_calls: dict = {}  # (fn, tree, signature) -> whether every primitive is in _CHEAP
_plans: dict = {}  # what a split carries, by recording (``split``'s key)


def _dead() -> None:
    return None


def _jaxprs(params: dict):
    for v in params.values():
        for x in v if isinstance(v, (tuple, list)) else (v,):
            if isinstance(x, ClosedJaxpr):
                yield x.jaxpr
            elif isinstance(x, Jaxpr):
                yield x


def _all_cheap(jaxpr) -> bool:
    for eqn in jaxpr.eqns:
        if eqn.primitive.name not in _CHEAP or eqn.effects:
            return False
        if not all(_all_cheap(j) for j in _jaxprs(eqn.params)):
            return False
    return True


class _Plan:
    """What one split carries: ``calls`` (nodes recorded again, in order), ``moved`` (live
    values recomputed there), ``extra`` (values not live that the forward writes for them:
    (node, leaf, out)), ``inputs`` (the forward's inputs they read), ``parted`` (node -> its
    row parts' programs and outputs: the forward writes the parts, the next recording
    computes the node's result from them)."""

    __slots__ = ("calls", "moved", "extra", "inputs", "parted")

    def __init__(self, calls: tuple, moved: frozenset, extra: tuple, inputs: tuple,
                 parted: dict) -> None:
        self.calls, self.moved, self.extra, self.inputs = calls, moved, extra, inputs
        self.parted = parted


_NOTHING = _Plan((), frozenset(), (), (), {})
_row_programs: dict = {}  # (node program, arguments) -> (parts program, combine program)


def _rows(fn, n_args: int):
    """(the parts program, the combine program) of a recorded op call whose op declares row
    parts (``registry.row_parts``), else None."""
    call = program.call_of(fn)
    if call is None:
        return None
    lowering, spec = call
    rule = registry.ROW_PARTS.get(lowering.op)
    if rule is None or spec.keeps or spec.order is not None:
        return None
    key = (fn, n_args)
    got = _row_programs.get(key)
    if got is None:
        parts, combine = rule

        def row_parts(*dyn):
            return tuple(parts(*program.rebuild(spec, lowering, dyn)))

        def from_row_parts(*dyn):
            args = program.rebuild(spec, lowering, dyn[:n_args])
            return program.finished(combine(*args, *dyn[n_args:]), spec)

        named = getattr(fn, "_ttpu_parts", None) or ()
        got = _row_programs[key] = (
            warm_keys.named(jax.jit(row_parts), "row_parts", *named),
            warm_keys.named(jax.jit(from_row_parts), "from_row_parts", n_args, *named))
    return got


def _call_shapes(fn, tree, sig: tuple) -> tuple:
    abstract = [signatures.abstract(s) for s in sig]
    return signatures.outputs(fn, tree, sig,
                              tree.unflatten(abstract) if tree is not None else abstract)


class _Planner:
    def __init__(self, rec, trace, targets: list, wanted: tuple) -> None:
        self.rec, self.trace, self.nodes = rec, trace, trace.nodes
        self.live = {w: p for w, p in zip(wanted, targets, strict=True)}
        self._outs: dict = {}  # node -> its outputs (shape, dtype, weak type, signature)

    def _sig(self, refs: tuple) -> tuple:
        """The signature numbers of a call's arguments."""
        return tuple(signatures.signature(self.trace.inputs[r]) if r.__class__ is int
                     else self.outs(r[0])[r[1]][3] for r in refs)

    def outs(self, n: int) -> tuple:
        """Node n's outputs as ``signatures.outputs`` gives them (the recorder's table first)."""
        got = self._outs.get(n)
        if got is not None:
            return got
        fn, tree, refs = self.nodes[n]
        sig = self._sig(refs)
        shapes = self.rec._shapes.get((fn, tree, sig))
        if shapes is None:
            shapes = self.rec._shapes[(fn, tree, sig)] = _call_shapes(fn, tree, sig)
        self._outs[n] = shapes[0]
        return shapes[0]

    def cheap(self, n: int) -> bool:
        fn, tree, refs = self.nodes[n]
        key = (fn, tree, self._sig(refs))
        got = _cheap_calls.get(key)
        if got is None:
            abstract = [signatures.abstract(s) for s in key[2]]
            try:
                jaxpr = jax.make_jaxpr(fn)(*(tree.unflatten(abstract) if tree is not None
                                             else abstract))
                got = _all_cheap(jaxpr.jaxpr)
            except Exception:  # noqa: BLE001 (a call that cannot be traced alone is kept)
                got = False
            _cheap_calls[key] = got
        return got

    def plan(self) -> _Plan:
        status: dict = {}  # live node -> "keep" | "free" | "paid"
        by_node: dict = {}
        for n, leaf in self.live:
            by_node.setdefault(n, []).append(leaf)
        calls, moved, extra, inputs, parted = set(), set(), {}, set(), {}
        for n in sorted(by_node):
            size = sum(math.prod(self.live[(n, leaf)].shape)
                       * self.live[(n, leaf)].dtype.itemsize for leaf in by_node[n])
            status[n] = "keep"
            rows = None
            if size < MIN_BYTES:
                continue
            if not self.cheap(n):
                rows = _rows(self.nodes[n][0], len(self.nodes[n][2]))
                if rows is None or self.nodes[n][1] is not None:
                    continue
            cone = self._cone(n, status, extra)
            if cone is None:
                continue
            nodes, new, kept_read, ins = cone
            new_bytes = sum(self._bytes(*v) for v in new)
            if rows is not None:  # its parts: written by the forward too
                parts_outs = self._call_outs(rows[0], self.nodes[n][2])
                new_bytes += sum(math.prod(o[0]) * o[1].itemsize for o in parts_outs)
            if new and 2 * new_bytes + kept_read >= 2 * size:
                continue
            status[n] = "paid" if new or rows is not None else "free"
            if rows is not None:
                parted[n] = (*rows, parts_outs)
            calls |= nodes
            moved |= {(n, leaf) for leaf in by_node[n]}
            inputs |= ins
            for v in new:
                extra[v] = self.outs(v[0])[v[1]]
        if not calls:
            return _NOTHING
        return _Plan(tuple(sorted(calls)), frozenset(moved),
                     tuple((n, leaf, out) for (n, leaf), out in sorted(extra.items())),
                     tuple(sorted(inputs)), parted)

    def _call_outs(self, fn, refs: tuple) -> tuple:
        """fn's outputs over refs (as ``signatures.outputs`` gives them)."""
        return _call_shapes(fn, None, self._sig(refs))[0]

    def _bytes(self, n: int, leaf: int) -> int:
        shape, dtype = self.outs(n)[leaf][:2]
        return math.prod(shape) * dtype.itemsize

    def _cone(self, n: int, status: dict, extra: dict):
        """(calls to record again, values not live to write, bytes of kept values read,
        inputs read) for live node n, or None where it must be kept."""
        calls, stack, new, kept, ins = {n}, [n], set(), set(), set()
        while stack:
            for r in self.nodes[stack.pop()][2]:
                if r.__class__ is int:
                    ins.add(r)
                    continue
                m = r[0]
                if m in calls or r in new:
                    continue
                s = status.get(m)
                if s == "paid":
                    return None
                if s == "keep" and r in self.live or r in extra:
                    kept.add(r)
                elif s == "free" or (r not in self.live and s is None and self.cheap(m)):
                    calls.add(m)
                    stack.append(m)
                    if len(calls) > CONE_CALLS:
                        return None
                elif r not in self.live:
                    new.add(r)
                else:
                    kept.add(r)
        return calls, new, sum(self._bytes(*v) for v in kept), ins


def split(rec, trace, pending: type) -> None:
    """Flush trace (the forward) at backward's start, carrying its cheap live values into the
    next recording as recomputations (the plan cached by the recording's structure); pending:
    the recorder's pending value class (``defer.Pending``)."""
    start = trace.start + len(trace.nodes)
    targets, wanted = rec._alive(trace)
    # Every fact the plan depends on: the calls and their wiring, the live values, the inputs'
    # signatures (the bytes weighed, the written values' shapes) and the thresholds.
    key = (tuple(trace.nodes), wanted, tuple(signatures.signature(x) for x in trace.inputs),
           MIN_BYTES, CONE_CALLS)
    plan = _plans.get(key)
    if plan is None:
        plan = _plans[key] = _Planner(rec, trace, targets, wanted).plan()
    if not plan.calls:
        rec.flush()
        rec._trace.start = start
        return
    held = {i: trace.inputs[i] for i in plan.inputs}  # (held: not donated to the forward)
    moved = [p for p in targets if (p._node, p._leaf) in plan.moved]
    written = {}
    for n, leaf, out in plan.extra:
        written[(n, leaf)] = p = pending(out, trace, n, leaf)
        refs = list(trace.outs[n])
        refs[leaf] = weakref.ref(p)
        trace.outs[n] = refs
    for p in moved:
        refs = list(trace.outs[p._node])
        refs[p._leaf] = _dead
        trace.outs[p._node] = refs
    parts_at = {}
    for n, (parts, _, outs) in plan.parted.items():  # the forward writes the row parts
        parts_at[n] = m = len(trace.nodes)
        trace.nodes.append((parts, None, trace.nodes[n][2]))
        ps = [pending(out, trace, m, i) for i, out in enumerate(outs)]
        trace.outs.append([weakref.ref(p) for p in ps])
        written.update(((m, i), p) for i, p in enumerate(ps))
    calls = set(plan.calls)
    for p in targets:
        if (p._node, p._leaf) not in plan.moved:
            written[(p._node, p._leaf)] = p
    del targets
    try:
        rec.flush()
    except BaseException as e:
        for p in moved:
            p._error, p._trace = e, None
        raise
    new = rec._trace
    where = {}
    for n in plan.calls:
        fn, tree, refs = trace.nodes[n]
        args = []
        for r in refs:
            if r.__class__ is int:
                args.append(new.input(held[r]))
            elif r[0] in calls:
                args.append((where[r[0]], r[1]))
            else:
                args.append(new.input(written[r]._value))
        if n in parts_at:  # its result from its arguments and its row parts
            fn = plan.parted[n][1]
            args += [new.input(written[(parts_at[n], i)]._value)
                     for i in range(len(plan.parted[n][2]))]
        where[n] = len(new.nodes)
        new.nodes.append((fn, tree, tuple(args)))
        new.outs.append([_dead] * len(trace.outs[n]))
    for p in moved:
        new.outs[where[p._node]][p._leaf] = weakref.ref(p)
        p._trace, p._node = new, where[p._node]
    new.carried = len(plan.calls)
    new.start = start - new.carried
    metrics.count("deferred_recomputed_calls", len(plan.calls))
