"""A recorded program's calls in the forms their readers read them (``registry.read_form``).

A lowering sees its arguments, never its result's readers, so it writes a product as the 2-D
(tokens, features) array its shapes give; the program that reads it as attention's heads then
pays the TPU compiler's copies between the two layouts (bench/RESULTS.md, whole8). A recording
knows both ends: each call's lowering and spec, and each spec's view Geometry for an argument it
reads through a view. ``rewrite`` gives a call whose op declares a read form, and whose one
result is read through views that the form accepts (every such view asking for the same form),
the program of that form instead: the same values, another layout; ``view_forms`` gives a call
whose op declares a view form for the views its own arguments are read through, and which no
read form replaced, that form's program. Captures and DeferAndFuse's flushes apply both
(``apply``), and the forms of calls given their arguments' producers (``producer_forms``) after
them. Nothing here names an op.
"""

from __future__ import annotations

import dataclasses
import functools

from torchtpu import metrics
from torchtpu.device.views import Geometry
from torchtpu.eager import producer_forms, rounded_reads
from torchtpu.eager.program import KEY, SCALAR, TENSOR, TENSORS, Spec, call_of, program
from torchtpu.lowering.registry import READ_FORMS, TABLE, VIEW_FORMS, Lowering


def _views_read(spec: Spec, refs: tuple):
    """(producer node, Geometry) for each argument spec reads through a view of a recorded
    call's result (``refs``: the recorded call's references, one per dynamic value)."""
    at = 0
    for kind, payload in spec.entries:
        if kind == TENSOR or kind == TENSORS:
            for how in (payload if kind == TENSORS else (payload,)):
                if how is True:
                    continue
                r = refs[at]
                if type(how) is Geometry and r.__class__ is tuple and r[1] == 0:
                    yield r[0], how
                at += 1
        elif kind == SCALAR or kind == KEY:
            at += 1


def apply(nodes: list) -> None:
    """Give the recorded calls (``(fn, tree, refs)``, as recorded; replaced in place) their
    read forms, then their view forms, then their producer forms (``producer_forms``), then the
    casts that round a result to half precision right after theirs (``rounded_reads``; counted:
    ``read_forms``, ``view_forms``, ``producer_forms``, ``rounded_reads``)."""
    metrics.count("read_forms", rewrite(nodes))
    metrics.count("view_forms", view_forms(nodes))
    metrics.count("producer_forms", producer_forms.rewrite(nodes))
    metrics.count("rounded_reads", rounded_reads.rewrite(nodes))


def _calls(nodes: list) -> dict:
    """node -> (lowering, spec) of each recorded op call (not a device kernel's program)."""
    return {i: c for i, (fn, _, _) in enumerate(nodes) if (c := call_of(fn)) is not None}


def rewrite(nodes: list) -> int:
    """Replace in place the nodes whose read form applies. Returns how many."""
    calls, read = _calls(nodes), {}
    for node, (_, spec) in calls.items():
        for producer, g in _views_read(spec, nodes[node][2]):
            read.setdefault(producer, set()).add(g)
    done = 0
    for producer, views in read.items():
        lowering, spec = calls.get(producer, (None, None))
        rule = READ_FORMS.get(lowering.op) if lowering is not None else None
        if rule is None:
            continue
        forms = {rule(g) for g in views}
        if len(forms) != 1 or None in forms:
            continue
        _, tree, refs = nodes[producer]
        nodes[producer] = (program(_with_fn(lowering, forms.pop()), spec), tree, refs)
        done += 1
    return done


def view_forms(nodes: list) -> int:
    """Replace in place the calls whose view form applies (the table's lowering still: a read
    form's program is left as it is). Returns how many."""
    done = 0
    for node, (lowering, spec) in _calls(nodes).items():
        rule = VIEW_FORMS.get(lowering.op)
        if rule is None or TABLE.get(lowering.op) is not lowering:
            continue
        form = rule(tuple(how for kind, how in spec.entries if kind == TENSOR))
        if form is None:
            continue
        _, tree, refs = nodes[node]
        nodes[node] = (program(_with_fn(lowering, form), spec), tree, refs)
        done += 1
    return done


@functools.cache  # the same object for the same form: ``program``'s cache keys by identity
def _with_fn(lowering: Lowering, fn) -> Lowering:
    return dataclasses.replace(lowering, fn=fn)
