"""A recorded program's calls in the forms their arguments' producers allow
(``registry.producer_form``).

A lowering sees its arguments' values, never the calls that made them, so an NLL loss picks
each row's class out of the [rows, classes] log-probabilities and the log-softmax's backward
sums its [rows, classes] gradient, passes over the logits for one number a row that the
producer's own arguments give (bench/RESULTS.md, whole7 and loss1). A recording knows both
ends: each call's lowering and spec, and which recorded call made each argument. ``rewrite``
gives a call whose op declares a producer form, and whose argument at the declared position is
the whole first result of a call of one of the declared producers, the program of that form
instead: it takes the call's own values and then the producer's, and returns what the call's
program returns. The facts it depends on, each checked: the argument is that producer's result
0 (a reference in the recording, not a view, a cast or an earlier program's array); the
producer's op; the consumer's lowering the table's own (not a read form's), drawing no key,
donating nothing; no argument lists on either end. The form itself checks what the arrays say
(shapes, the dims). Captures and DeferAndFuse's flushes apply them (``read_forms.apply``).
Nothing here names an op.
"""

from __future__ import annotations

import functools

import jax

from torchtpu.cache import warm_keys
from torchtpu.eager.program import (
    CONST,
    TENSOR,
    TENSORS,
    Spec,
    call_of,
    finished,
    rebuild,
)
from torchtpu.lowering.registry import PRODUCER_FORMS, TABLE


def _dynamic_index(spec: Spec, position: int) -> int | None:
    """The index among the call's dynamic values of its argument at ``position``, where that
    argument is one array read whole; else None."""
    at = 0
    for i, (kind, payload) in enumerate(spec.entries):
        if i == position:
            return at if kind == TENSOR and payload is None else None
        if kind == TENSORS:
            at += sum(element is not True for element in payload)
        elif kind != CONST:
            at += 1
    return None


def rewrite(nodes: list) -> int:
    """Replace in place the recorded calls (``(fn, tree, refs)``) whose producer form applies.
    Returns how many."""
    done = 0
    for i, (fn, tree, refs) in enumerate(nodes):
        call = call_of(fn)
        if call is None or tree is not None:
            continue
        lowering, spec = call
        declared = PRODUCER_FORMS.get(lowering.op)
        if (declared is None or TABLE.get(lowering.op) is not lowering or lowering.random
                or lowering.donates):
            continue
        position, producers, form = declared
        at = _dynamic_index(spec, position)
        ref = refs[at] if at is not None else None
        if ref.__class__ is not tuple or ref[1] != 0:
            continue  # an input of the program, or another result of its producer
        pfn, ptree, prefs = nodes[ref[0]]
        made = call_of(pfn)
        if made is None or ptree is not None or made[0].op not in producers:
            continue
        nodes[i] = (_joined(form, fn, pfn, len(refs)), None, refs + prefs)
        done += 1
    return done


@functools.cache  # one program per form and pair of calls: recordings' keys see one object
def _joined(form, fn, pfn, n: int):
    """The program of form over the call fn's n values and then its producer pfn's."""
    (lowering, spec), (producer, pspec) = call_of(fn), call_of(pfn)

    def run(*dyn):
        kept = [] if spec.keeps else None
        args = rebuild(spec, lowering, dyn[:n], kept)
        out = finished(form(args, rebuild(pspec, producer, dyn[n:])), spec)
        return out if kept is None else (out, tuple(kept))

    run.__name__ = f"{lowering.op}_of_{producer.op}".replace(".", "_")
    parts = [getattr(f, "_ttpu_parts", None) for f in (fn, pfn)]
    jitted = jax.jit(run)
    jitted._ttpu_op = lowering.op  # (``program.op_of``: it returns what the call returns)
    # Named by the form and both calls' names where both have one (a warm start's key).
    return warm_keys.named(jitted, "producer_form", form, *parts) if None not in parts else jitted
