"""Dynamic shapes by padding and masking: symbolic sizes run as one program per size bucket.

Under ``torch.compile(dynamic=True)`` a graph's sizes are symbols (``s0``, ``s1``). Each symbolic
input dimension is zero-padded on the host up to a size bucket, the program is built for the
bucket sizes, and the real sizes of the symbols reach it as traced runtime inputs, so one program
serves every size in a bucket. ``plan`` decides, op by op from the graph's symbolic metadata,
whether that gives exactly the unpadded results, and what the program must mask:

- Every tensor dim has a *layout*: its factors, major to minor (``(s0,)`` for a plain symbol,
  ``(s0, 2)`` for ``[s0, 2, ...]`` merged by a reshape). The real elements sit where every factor
  index is below the factor's real size; all other positions hold padding, which is treated as
  garbage (it may be anything, NaN included). Reshapes must keep symbolic factors whole; an op
  whose output dim has a compound size takes the layout of the input dims of the same size, and
  two disagreeing layouts are refused.
- What each op needs to stay exact (nothing for position-wise ops: garbage stays in padding
  positions; masks with ``jnp.where`` on an iota-against-real-size mask, ``masking``, for ops
  that mix positions along a padded dim) is the op's padding rule, declared in
  ``lowering/padding.py``; this module names no op.
- A symbolic size used as a number (a traced scalar argument) sees the real size; shapes see the
  bucket.

A graph with anything else on a symbolic dim (a normalization or variance over it, a slice that
cuts it elsewhere, cat along it, a symbol as a fill value, an unknown op) is compiled per exact
shape instead, which ``backend`` counts and logs.

Buckets are ``bucket_size * 2**i`` for ``i < num_dynamic_buckets``; larger sizes round up to a
multiple of the largest bucket. Only symbols whose size has varied between calls of a graph are
padded (``backend``): the first call runs at its own sizes, and a dim that never changes (the
batch, when ``dynamic=True`` makes every dim a symbol) keeps its size. Padding and slicing
happen on the host: a device pad or slice would itself be one XLA program per size, which is
what bucketing avoids.
"""

from __future__ import annotations

import dataclasses
import math
import operator

import sympy
import torch
import torch.fx as fx

from torchtpu.compile.buckets import size_expr as _expr
from torchtpu.eager import schema
from torchtpu.lowering import padding
from torchtpu.lowering.graph_forms import INPUT_WRITE, RESHAPES, SIZE_READS
from torchtpu.lowering.padding import Refused
from torchtpu.lowering.padding import val as _val
from torchtpu.lowering.registry import SIZE_ARGUMENTS


@dataclasses.dataclass
class Plan:
    """How a graph runs padded: its symbols, each tensor's dim layouts, the masks of each node."""

    order: list
    layouts: dict
    masks: dict
    numbers: dict  # node -> the symbolic-size arguments it takes as traced numbers


def _is_sym(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(_val(a), torch.SymInt)


def _tensors(node: fx.Node) -> list:
    vals = [_val(a) for a in node.all_input_nodes] + [_val(node)]
    flat = [v for x in vals for v in (x if isinstance(x, (list, tuple)) else [x])]
    return [v for v in flat if isinstance(v, torch.Tensor)]


def _touches_symbols(node: fx.Node) -> bool:
    return any(padding.symbolic(d) for t in _tensors(node) for d in t.shape) or any(
        _is_sym(a) for a in node.all_input_nodes)


def canonical_layout(d, order: list) -> tuple:
    """The layout given to an input dim: its symbols in graph order, then its constant factor."""
    e = _expr(d)
    if not e.free_symbols:
        return (int(e),)
    coeff, syms = e.as_coeff_mul()
    if any(not isinstance(s, sympy.Symbol) for s in syms) or len(set(syms)) != len(syms) \
            or not coeff.is_Integer:
        raise Refused(f"a size {e} that is not a product of symbols")
    return tuple(sorted(syms, key=order.index)) + ((int(coeff),) if coeff != 1 else ())


def _size(layout: tuple) -> sympy.Expr:
    return sympy.Mul(*[f if isinstance(f, sympy.Symbol) else sympy.Integer(f) for f in layout])


def _reshape_layout(src: tuple, dst_shape) -> tuple:
    """The layouts after a reshape that keeps every symbolic factor whole, in order."""
    atoms = [f for dim in src for f in dim if f != 1]
    out = []
    for d in dst_shape:
        need, dim = _expr(d), []
        while need != 1:
            if not atoms:
                raise Refused("a reshape that does not keep symbolic factors whole")
            head = atoms[0]
            if isinstance(head, sympy.Symbol):
                if sympy.fraction(sympy.cancel(need / head))[1] != 1:
                    raise Refused(f"a reshape that splits the symbolic size {head}")
                take = head
                atoms.pop(0)
            else:
                coeff = need.as_coeff_mul()[0]
                take = math.gcd(head, int(coeff)) if coeff.is_Integer else 1
                if take == 1:
                    raise Refused("a reshape that splits a symbolic size")
                atoms[0] = head // take
                if atoms[0] == 1:
                    atoms.pop(0)
            dim.append(take)
            need = sympy.cancel(need / take)
        out.append(_merge_constants(dim))
    if atoms:
        raise Refused("a reshape that drops elements")
    return tuple(out)


def _merge_constants(dim: list) -> tuple:
    """One layout per dim: adjacent constant factors merged (they hold no padding)."""
    out: list = []
    for f in dim:
        if out and not isinstance(f, sympy.Symbol) and not isinstance(out[-1], sympy.Symbol):
            out[-1] *= f
        else:
            out.append(f)
    return tuple(out) or (1,)


def _generic_layout(node: fx.Node, val, layouts: dict) -> tuple:
    """Dims of plain sizes have plain layouts; a compound one takes its inputs' of equal size."""
    out = []
    for d in val.shape:
        e = _expr(d)
        if not e.free_symbols or isinstance(e, sympy.Symbol):
            out.append((e,) if e.free_symbols else (int(e),))
            continue
        found = {lay for a in node.all_input_nodes for lt in _flat_layouts(layouts.get(a))
                 for lay in lt if _size(lay) == e}
        if len(found) != 1:
            raise Refused(f"{node.target} gives a dim of size {e} with no single layout")
        out.append(found.pop())
    return tuple(out)


def _flat_layouts(lt) -> list:
    if lt is None:
        return []
    return [x for x in lt if x is not None] if isinstance(lt, list) else [lt]


def _layout_of(node: fx.Node, layouts: dict, order: list):
    val = _val(node)
    if node.target is operator.getitem:
        src = layouts.get(node.args[0])
        return src[node.args[1]] if isinstance(src, list) else None
    if isinstance(val, (list, tuple)):
        return [_generic_layout(node, v, layouts) if isinstance(v, torch.Tensor) else None
                for v in val]
    if not isinstance(val, torch.Tensor):
        return None
    if node.target in RESHAPES:
        return _reshape_layout(layouts[node.args[0]], val.shape)
    return _generic_layout(node, val, layouts)


def _numbers(node: fx.Node, traced: frozenset) -> tuple:
    """The symbolic sizes node takes as traced numbers; refused where it takes one otherwise."""
    op = node.target
    if op in SIZE_READS:
        return ()
    values = schema.bind(schema.info(op), node.args, node.kwargs)[0] \
        if isinstance(op, torch._ops.OpOverload) else node.args
    numbers = []
    for i, v in enumerate(values):
        if _is_sym(v):
            if i in traced:
                numbers.append(v)
            elif (op, i) not in SIZE_ARGUMENTS:
                raise Refused(f"{op} takes a symbolic size as a value")
    if numbers and any(_is_sym(x) for v in values if isinstance(v, (list, tuple)) for x in v):
        raise Refused(f"{op} uses a symbolic size both as a number and as a size")
    return tuple(numbers)


NO_SYMBOLS = "the graph has no symbolic sizes"


def plan(gm: fx.GraphModule, traced_of) -> Plan | str:
    """How the graph runs padded to buckets, or why it cannot (for the log).

    ``traced_of(node)`` gives the argument positions the node's lowering takes as traced values
    (empty for graph ops).
    """
    order: list = []
    placeholders = [n for n in gm.graph.nodes if n.op == "placeholder"]
    for n in placeholders:
        v = _val(n)
        if isinstance(v, torch.SymInt) and isinstance(_expr(v), sympy.Symbol) \
                and _expr(v) not in order:
            order.append(_expr(v))
        for d in (v.shape if isinstance(v, torch.Tensor) else []):
            if isinstance(_expr(d), sympy.Symbol) and _expr(d) not in order:
                order.append(_expr(d))
    symbols = {s for n in placeholders for d in (
        _val(n).shape if isinstance(_val(n), torch.Tensor) else [_val(n)]
        if isinstance(_val(n), torch.SymInt) else []) for s in _expr(d).free_symbols}
    if not symbols:
        return NO_SYMBOLS
    if symbols - set(order):
        return "a symbol is not the size of an input dim"
    layouts, masks, numbers = {}, {}, {}
    try:
        for n in placeholders:
            if isinstance(_val(n), torch.Tensor):
                layouts[n] = tuple(canonical_layout(d, order) for d in _val(n).shape)
            elif isinstance(_val(n), torch.SymInt):
                canonical_layout(_val(n), order)
        for n in gm.graph.nodes:
            if n.op != "call_function" or not _touches_symbols(n):
                if n.op == "call_function":
                    layouts[n] = _layout_of(n, layouts, order)
                continue
            if n.target is INPUT_WRITE:
                raise Refused("an input with a symbolic size is mutated")
            layouts[n] = _layout_of(n, layouts, order)
            node_masks = padding.masks(n, layouts)
            if node_masks:
                masks[n] = node_masks
            nums = _numbers(n, traced_of(n))
            if nums:
                numbers[n] = nums
    except Refused as e:
        return str(e)
    return Plan(order, layouts, masks, numbers)
