"""A compiled graph's collectives merged into buckets, for running it as one SPMD program.

A graph that holds collectives runs as one SPMD program over its group's devices
(``eager/spmd.py``: ``Spmd``, the mesh and the per-rank call). ``combine(gm)`` first merges its
collectives into buckets: a simple_fsdp forward holds one all-gather per parameter, its
backward one reduce-scatter per gradient, and each XLA collective
across processes costs a fixed latency (~2-3 ms per call on XLA:CPU's cross-process transport,
the whole gap between a sharded and an unsharded step), where one collective over the same
bytes costs about one. XLA's own combiner passes are not in every platform's pipeline, so the
graph is rewritten: collectives of one kind, group, reduction and dtype whose inputs are all
ready before any of their results is used become one collective over their flattened,
concatenated inputs, up to ``BUCKET_BYTES`` each, split back after it.
"""

from __future__ import annotations

import math
import operator

import torch
from torch import fx
from torch._guards import detect_fake_mode

from torchtpu.eager.spmd import BUCKET_BYTES

aten = torch.ops.aten
c10d = torch.ops._c10d_functional
_GATHER, _SCATTER, _REDUCE = (c10d.all_gather_into_tensor.default,
                              c10d.reduce_scatter_tensor.default, c10d.all_reduce.default)


def _uses(n: fx.Node) -> list[fx.Node]:
    """The nodes reading n's result, looking through ``wait_tensor`` (an identity here)."""
    out = []
    for u in n.users:
        out.extend(_uses(u) if u.target is c10d.wait_tensor.default else [u])
    return out


def _buckets(gm: fx.GraphModule) -> list[list[fx.Node]]:
    nodes = list(gm.graph.nodes)
    at = {n: i for i, n in enumerate(nodes)}
    open_: dict = {}   # key -> [members, bytes, position of the first use of any result]
    done = []
    for n in nodes:
        if n.target not in (_GATHER, _SCATTER, _REDUCE):
            continue
        val = n.args[0].meta.get("val") if isinstance(n.args[0], fx.Node) else None
        uses = _uses(n)
        if not isinstance(val, torch.Tensor) or not uses:
            continue
        size = val.numel() * val.element_size()
        key = (n.target, val.dtype, *n.args[1:], tuple(sorted(n.kwargs.items())))
        ready, first = at[n.args[0]], min(at[u] for u in uses)
        bucket = open_.get(key)
        if bucket is None or ready >= bucket[2] or bucket[1] + size > BUCKET_BYTES:
            if bucket is not None:
                done.append(bucket[0])
            bucket = open_[key] = [[], 0, first]
        bucket[0].append(n)
        bucket[1] += size
        bucket[2] = min(bucket[2], first)
    done.extend(b[0] for b in open_.values())
    return [b for b in done if len(b) > 1]


def _add(graph: fx.Graph, fake, target, *args) -> fx.Node:
    node = graph.call_function(target, args)
    vals = fx.node.map_arg(args, lambda a: a.meta["val"])
    with fake:
        node.meta["val"] = target(*vals)
    return node


def _merge(gm: fx.GraphModule, members: list[fx.Node]) -> None:
    graph = gm.graph
    inputs = [m.args[0] for m in members]
    fake = detect_fake_mode([x.meta["val"] for x in inputs])
    first = min((u for m in members for u in _uses(m)), key=list(graph.nodes).index)
    op, rest = members[0].target, members[0].args[1:]
    n = rest[0] if op is _GATHER else rest[1] if op is _SCATTER else 1
    sizes = [math.prod(x.meta["val"].shape) // (1 if op is _GATHER else n) for x in inputs]
    with graph.inserting_before(first):
        if op is _SCATTER:  # each rank's chunk of every input side by side: [n, sum of chunks]
            rows = [_add(graph, fake, aten.reshape.default, x, [n, s])
                    for x, s in zip(inputs, sizes, strict=True)]
            flat = _add(graph, fake, aten.reshape.default,
                        _add(graph, fake, aten.cat.default, rows, 1), [-1])
        else:
            flat = _add(graph, fake, aten.cat.default,
                        [_add(graph, fake, aten.reshape.default, x, [-1]) for x in inputs])
        done = _add(graph, fake, c10d.wait_tensor.default, _add(graph, fake, op, flat, *rest))
        if op is _GATHER:  # every rank's flat inputs one after another: [n, sum of sizes]
            done = _add(graph, fake, aten.reshape.default, done, [n, sum(sizes)])
        parts = _add(graph, fake, aten.split_with_sizes.default, done, sizes,
                     1 if op is _GATHER else 0)
        for k, m in enumerate(members):
            piece = _add(graph, fake, operator.getitem, parts, k)
            piece = _add(graph, fake, aten.reshape.default, piece, list(m.meta["val"].shape))
            for wait in [u for u in m.users if u.target is c10d.wait_tensor.default]:
                wait.replace_all_uses_with(piece)  # it stood before the insertion point
                graph.erase_node(wait)
            m.replace_all_uses_with(piece)
            graph.erase_node(m)


def combine(gm: fx.GraphModule) -> int:
    """Merge gm's collectives into buckets, in place (see the module doc); how many
    collectives the graph holds fewer."""
    buckets = _buckets(gm)
    for members in buckets:
        _merge(gm, members)
    if buckets:
        gm.graph.lint()
        gm.recompile()
    return sum(len(b) - 1 for b in buckets)
