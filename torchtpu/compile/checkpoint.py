"""Activation checkpointing that XLA keeps: the recomputation starts behind an optimization barrier.

``torch.utils.checkpoint`` drops a region's activations in the forward and runs the region again
in the backward. When forward and backward are one XLA program (a captured step, a compiled
whole step) the second run computes the same values from the same inputs, and XLA's common
subexpression elimination merges it with the first: every activation is kept, the saving is
gone (measured: an 8-block step's temporaries were the same to the byte with and without
checkpointing). So the recomputation reads its inputs through ``lax.optimization_barrier``:
values XLA cannot see through, so the recomputed ops are new ones, scheduled where the backward
needs them. (JAX's ``jax.checkpoint`` does the same with ``prevent_cse``.)

A recomputation that shares a program with the forward starts in eager code (and the captures
that record it, the compiled whole step among them): ``install()`` wraps the two functions
through which ``torch.utils.checkpoint`` hands a region its saved inputs again,
``detach_variable`` (``use_reentrant=True``) and ``_CheckpointFrame.get_inputs``
(``use_reentrant=False``, which ``checkpoint_sequential`` and the selective policies of
``create_selective_checkpoint_contexts`` use). Only tpu tensors pass through the barrier, as
fresh leaves with the same ``requires_grad``, which is what both forms expect of their inputs.

Under Dynamo's graphs AOTAutograd's partitioner copies the nodes a checkpoint tagged into the
backward graph, a program of its own that XLA cannot merge with the forward; but nothing there
says when to recompute: every region depends only on saved values, and XLA computed them all
at the program's start (measured on an 8-layer Llama: 0.70 MB handed over, but 4.5 MB of
backward temporaries, 5.2 MB in all against 8.3 MB unchecked; 1.6 MB with the barriers).
``schedule_recomputation`` gives each region's inputs a barrier with the first gradient its
backward meets, so a region is recomputed when the backward reaches it. A region holding a
random op (``scaled_dot_product_attention`` counts as one) draws its forward's numbers again
(``control_flow.RngStateStep``).
"""

from __future__ import annotations

import functools
import heapq
import itertools
import operator

import torch
import torch.fx as fx
import torch.utils.checkpoint as torch_checkpoint

# control_flow's name for it too (not imported from there: that module loads JAX, and this one
# is installed at ``import torch``).
RUN_WITH_RNG = torch.ops.higher_order.run_with_rng_state

_installed = False
# Gradients of checkpointed regions' outputs that arrived in the backward and whose region has
# not recomputed yet: the next recomputation's barrier takes them, so it waits for them.
_arrived: list = []


def _barrier():
    from torchtpu.kernels import ops  # noqa: PLC0415 (defines torch.ops.torchtpu's barrier)

    return ops.optimization_barrier


def _on_tpu(v) -> bool:
    return isinstance(v, torch.Tensor) and v.device.type == "tpu"


def _through_barrier(values):
    """values with each tpu tensor replaced by its value behind one barrier (with the arrived
    gradients), as a leaf with the same requires_grad."""
    values = tuple(values)
    at = [k for k, v in enumerate(values) if _on_tpu(v)]
    if not at:
        return values
    waits = [g for g in _arrived if _on_tpu(g)]
    _arrived.clear()
    with torch.no_grad():
        fenced = _barrier()([values[k] for k in at] + waits)
        if waits:
            tie = fenced[-1].reshape(-1)[0] * 0
            fenced = [_tied(f, tie) for f in fenced[:len(at)]]
    out = list(values)
    for k, f in zip(at, fenced[:len(at)], strict=True):
        out[k] = f.detach().requires_grad_(values[k].requires_grad)
    return tuple(out)


def _tied(value, tie):
    """value + tie (a zero computed from a gradient), for floating values."""
    if not value.is_floating_point():
        return value
    return value + tie.to(value.dtype)


def _note_gradient(grad):
    _arrived.append(grad)


def _watch_outputs(out) -> None:
    """Each tpu output that requires grad tells its gradient's arrival (see ``_arrived``)."""
    for v in (out if isinstance(out, (tuple, list)) else (out,)):
        if _on_tpu(v) and v.requires_grad:
            v.register_hook(_note_gradient)


def install() -> None:
    """Wrap torch.utils.checkpoint's hand-over of a region's inputs to its recomputation, and
    its ``checkpoint`` (outside ``torch.compile``) to watch the regions' output gradients."""
    global _installed
    if _installed:
        return
    _installed = True
    detach_variable = torch_checkpoint.detach_variable

    def detach_fenced(inputs):
        return _through_barrier(detach_variable(inputs))

    detach_fenced.__doc__ = detach_variable.__doc__
    torch_checkpoint.detach_variable = detach_fenced
    frame = torch_checkpoint._CheckpointFrame
    get_inputs = frame.get_inputs

    def get_inputs_fenced(self):
        return _through_barrier(get_inputs(self))

    frame.get_inputs = get_inputs_fenced
    checkpoint = torch_checkpoint.checkpoint

    @functools.wraps(checkpoint)
    def checkpoint_watched(function, *args, **kwargs):
        out = checkpoint(function, *args, **kwargs)
        if not torch.compiler.is_compiling():
            _watch_outputs(out)
        return out

    torch_checkpoint.checkpoint = checkpoint_watched


_RECOMPUTED = (torch_checkpoint.CheckpointPolicy.MUST_RECOMPUTE,
               torch_checkpoint.CheckpointPolicy.PREFER_RECOMPUTE)


def _regions(graph: fx.Graph) -> dict:
    """{checkpoint id: its recomputed nodes, in graph order} of a backward graph. The nodes the
    partitioner adds to a region (the RNG wrapper, its getitems) carry no tag: they join the
    region all their computed inputs belong to."""
    regions: dict = {}
    member: dict = {}
    for n in graph.nodes:
        if n.op != "call_function":
            continue
        region = None
        if n.meta.get("recompute") in _RECOMPUTED:
            region = n.meta.get("ac_graph_id", -1)
        elif n.target in (operator.getitem, RUN_WITH_RNG):
            found = {member.get(a, None) for a in n.all_input_nodes if a.op != "placeholder"}
            if len(found) == 1 and None not in found:
                region = found.pop()
        if region is not None:
            member[n] = region
            regions.setdefault(region, []).append(n)
    return regions


def _barrier_before(graph: fx.Graph, nodes: list, inputs: list, tie: list) -> list:
    """The region's uses of inputs read them through one barrier that also takes tie; the
    nodes made."""
    _barrier()
    with graph.inserting_before(nodes[0]):
        fence = graph.call_function(torch.ops.torchtpu.optimization_barrier.default,
                                    ([*inputs, *tie],))
        fence.meta["val"] = [a.meta["val"] for a in (*inputs, *tie)]
        made = [fence]
        inside = set(nodes)
        last = graph.call_function(operator.getitem, (fence, len(inputs) + len(tie) - 1))
        last.meta["val"] = tie[-1].meta["val"]
        # A zero computed from the gradient, added to the saved activations: XLA:CPU turns
        # barriers into control dependencies that its scheduler does not keep (the same as
        # ``_through_barrier``'s tie in eager code).
        flat = graph.call_function(torch.ops.aten.reshape.default, (last, [-1]))
        first = graph.call_function(torch.ops.aten.select.int, (flat, 0, 0))
        zero = graph.call_function(torch.ops.aten.mul.Tensor, (first, 0))
        val = last.meta["val"]
        flat.meta["val"] = val.reshape(-1)
        first.meta["val"] = flat.meta["val"][0]
        zero.meta["val"] = first.meta["val"] * 0
        made += [last, flat, first, zero]
        for k, a in enumerate(inputs):
            fenced = graph.call_function(operator.getitem, (fence, k))
            fenced.meta["val"] = a.meta["val"]
            made.append(fenced)
            if _activation(a):
                fenced = graph.call_function(torch.ops.aten.add.Tensor, (fenced, zero))
                fenced.meta["val"] = a.meta["val"] + zero.meta["val"].to(a.meta["val"].dtype)
                made.append(fenced)
            a.replace_all_uses_with(fenced, delete_user_cb=inside.__contains__)
    return made


def _activation(n: fx.Node) -> bool:
    """A floating value saved by the forward, not one of its inputs (AOTAutograd names those
    ``primals_<k>``: the parameters, which the tie would copy)."""
    val = n.meta["val"]
    return val.is_floating_point() and not (n.op == "placeholder"
                                            and n.name.startswith("primals_"))


def _topological(graph: fx.Graph, order: dict) -> None:
    """The graph's nodes in a topological order, each as early as its original place allows."""
    waiting = {n: len(set(n.all_input_nodes)) for n in graph.nodes}
    seq = itertools.count()
    ready = [(order[n], next(seq), n) for n in graph.nodes if not waiting[n]]
    heapq.heapify(ready)
    placed = []
    while ready:
        _, _, n = heapq.heappop(ready)
        placed.append(n)
        for u in n.users:
            waiting[u] -= 1
            if not waiting[u]:
                heapq.heappush(ready, (order[u], next(seq), u))
    if len(placed) != len(waiting):
        raise AssertionError("torchtpu.compile: the recomputation's barriers made a cycle")
    output = next(n for n in reversed(graph.nodes) if n.op == "output")
    for n in placed:
        if n is not output:
            output.prepend(n)


def schedule_recomputation(gm: fx.GraphModule) -> fx.GraphModule:
    """A backward graph whose recomputed regions each start behind a barrier with the first
    gradient they meet: the values (not saved) that the first node using the region also
    reads. Graphs without recomputation are returned as they are."""
    graph = gm.graph
    regions = _regions(graph)
    if not regions:
        return gm
    order = {n: k for k, n in enumerate(graph.nodes)}
    changed = False
    for nodes in regions.values():
        inside = set(nodes)
        users = [u for n in nodes for u in n.users if u not in inside]
        if not users:
            continue
        first = min(users, key=order.__getitem__)
        tie = [a for a in dict.fromkeys(first.all_input_nodes)
               if a not in inside and a.op != "placeholder" and _is_tensor(a)]
        inputs = [a for a in dict.fromkeys(x for n in nodes for x in n.all_input_nodes)
                  if a not in inside and _is_tensor(a) and order[a] < order[first]]
        if tie and inputs:
            # Placed just before the first user, the region after it (see _topological).
            for n in _barrier_before(graph, nodes, inputs, tie):
                order[n] = order[first] - 0.5
            changed = True
    if changed:
        _topological(graph, order)
        graph.lint()
        gm.recompile()
    return gm


def _is_tensor(n: fx.Node) -> bool:
    return isinstance(n.meta.get("val"), torch.Tensor)
