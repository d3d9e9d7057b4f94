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
- Ops that treat positions independently (elementwise, views, embedding, causal masks) need
  nothing: garbage stays in padding positions.
- Ops that mix positions along a padded dim get their inputs masked with ``jnp.where`` on an
  iota-against-real-size mask (``masking``): reductions with their identity (0 for sum, -inf for
  amax/softmax/logsumexp, True for all...), contractions (mm, bmm, addmm) with 0 on both operands,
  mean divides by the real count, nll_loss ignores padded rows through ``ignore_index``, and the
  backward ops of softmax, log_softmax, layer norm and embedding are masked likewise. Fused
  attention runs padded when it is causal or has an attention mask (whose padded key columns
  become "never attend"); padded keys and values are zeroed.
- A symbolic size used as a number (a traced scalar argument) sees the real size; shapes see the
  bucket.

Reads that only look at real positions need nothing either: ``gather`` and integer-tensor
indexing (padded index positions give padded outputs; a negative index into a padded dim is
made to count from its real end), a ``select`` or a fixed slice counted
from the start (``x[:, 0]``, ``x[:, :1]``; Dynamo guards that they fit the real size). Counted
from the end (``x[:, -1]``, ``x[:, -3:]``), the input is first rolled so that its real elements
end where the padded dim ends.

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
from torchtpu.compile.graph_ops import SIZE_ARITHMETIC
from torchtpu.eager import schema

aten = torch.ops.aten

# Ops whose positions along every dimension are independent of each other, whatever the dims.
_POSITIONWISE = {
    aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
    aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.expand.default, aten.embedding.default, aten.full.default,
    aten.ones.default, aten.zeros.default, aten.empty.memory_format, aten.full_like.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.scalar_tensor.default, aten.copy.default, aten.arange.default, aten.arange.start,
    aten.arange.start_step, aten.sym_size.int, operator.getitem,
}
_INDEXED = {aten.tril.default, aten.triu.default}  # position-wise for leading-block layouts
_SYM_ARITHMETIC = set(SIZE_ARITHMETIC)
# Symbolic-size arguments that only set a size (a slice end, arange's end): buckets are right.
# (A range's end padded gives the real range and then padding: ``arange(0, s0)``'s dim is s0, a
# plain symbol; one whose length is not, ``arange(2, s0)`` or a step of 2, has no layout.)
_SIZE_ARGUMENTS = {(aten.slice.Tensor, 3), (aten.arange.default, 0), (aten.arange.start, 1),
                   (aten.arange.start_step, 1),
                   (aten._scaled_dot_product_fused_attention_overrideable_backward.default, 10),
                   (aten._scaled_dot_product_fused_attention_overrideable_backward.default, 11)}
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}

# Reductions: (dims argument index or None for every dim, identity the padding is replaced by).
_REDUCING = {
    aten.sum.dim_IntList: (1, "zero"), aten.sum.default: (None, "zero"),
    aten.mean.dim: (1, "zero"), aten.mean.default: (None, "zero"),
    aten.amax.default: (1, "lowest"), aten.amin.default: (1, "highest"),
    aten.all.dim: (1, "true"), aten.all.dims: (1, "true"),
    aten.any.dim: (1, "false"), aten.any.dims: (1, "false"),
    aten.prod.dim_int: (1, "one"), aten.logsumexp.default: (1, "lowest"),
    aten._softmax.default: (1, "lowest"), aten._log_softmax.default: (1, "lowest"),
}
MEAN_OPS = {aten.mean.dim, aten.mean.default}
# Contractions: ((arg, contracted dim) of each operand).
_CONTRACTING = {aten.mm.default: ((0, 1), (1, 0)), aten.bmm.default: ((0, 2), (1, 1)),
                aten.addmm.default: ((1, 1), (2, 0))}


@dataclasses.dataclass(frozen=True)
class Mask:
    """Replace the padding of argument ``arg`` along ``dims`` by ``fill`` before the op runs;
    "wrap": make the negative values of index tensor ``arg`` ((argument, list position)) count
    from the real end of ``dims`` of argument 0."""

    arg: int | tuple
    dims: tuple
    fill: str | int


@dataclasses.dataclass
class Plan:
    """How a graph runs padded: its symbols, each tensor's dim layouts, the masks of each node."""

    order: list
    layouts: dict
    masks: dict
    numbers: dict  # node -> the symbolic-size arguments it takes as traced numbers


class _Refused(Exception):
    pass


def _symbolic(d) -> bool:
    return bool(_expr(d).free_symbols)


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _is_sym(a) -> bool:
    return isinstance(a, fx.Node) and isinstance(_val(a), torch.SymInt)


def _tensors(node: fx.Node) -> list:
    vals = [_val(a) for a in node.all_input_nodes] + [_val(node)]
    flat = [v for x in vals for v in (x if isinstance(x, (list, tuple)) else [x])]
    return [v for v in flat if isinstance(v, torch.Tensor)]


def _touches_symbols(node: fx.Node) -> bool:
    return any(_symbolic(d) for t in _tensors(node) for d in t.shape) or any(
        _is_sym(a) for a in node.all_input_nodes)


def canonical_layout(d, order: list) -> tuple:
    """The layout given to an input dim: its symbols in graph order, then its constant factor."""
    e = _expr(d)
    if not e.free_symbols:
        return (int(e),)
    coeff, syms = e.as_coeff_mul()
    if any(not isinstance(s, sympy.Symbol) for s in syms) or len(set(syms)) != len(syms) \
            or not coeff.is_Integer:
        raise _Refused(f"a size {e} that is not a product of symbols")
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
                raise _Refused("a reshape that does not keep symbolic factors whole")
            head = atoms[0]
            if isinstance(head, sympy.Symbol):
                if sympy.fraction(sympy.cancel(need / head))[1] != 1:
                    raise _Refused(f"a reshape that splits the symbolic size {head}")
                take = head
                atoms.pop(0)
            else:
                coeff = need.as_coeff_mul()[0]
                take = math.gcd(head, int(coeff)) if coeff.is_Integer else 1
                if take == 1:
                    raise _Refused("a reshape that splits a symbolic size")
                atoms[0] = head // take
                if atoms[0] == 1:
                    atoms.pop(0)
            dim.append(take)
            need = sympy.cancel(need / take)
        out.append(_merge_constants(dim))
    if atoms:
        raise _Refused("a reshape that drops elements")
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
            raise _Refused(f"{node.target} gives a dim of size {e} with no single layout")
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
    if node.target in _RESHAPES:
        return _reshape_layout(layouts[node.args[0]], val.shape)
    return _generic_layout(node, val, layouts)


def reduced_dims(node: fx.Node, index, ndim: int) -> tuple:
    dims = None if index is None else (node.args[index] if len(node.args) > index else None)
    if dims is None or dims == []:
        return tuple(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return tuple(sorted(d % max(ndim, 1) for d in dims))


def _padded(layout: tuple, dims) -> tuple:
    return tuple(d for d in dims if any(isinstance(f, sympy.Symbol) for f in layout[d]))


def _same(layouts: list, what: str) -> None:
    if len(set(layouts)) > 1:
        raise _Refused(f"{what} over dims laid out differently")


def _masks(node: fx.Node, layouts: dict) -> list:
    """The masks node needs (empty when it is position-wise); raises when it cannot be exact."""
    op, args = node.target, node.args
    if op in _SYM_ARITHMETIC or op in _POSITIONWISE:
        return []
    if isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
        return []
    lay = layouts.get(args[0]) if args and isinstance(args[0], fx.Node) else None
    if op in _REDUCING:
        index, fill = _REDUCING[op]
        dims = _padded(lay, reduced_dims(node, index, len(lay)))
        return [Mask(0, dims, fill)] if dims else []
    if op in _CONTRACTING:
        (a, da), (b, db) = _CONTRACTING[op]
        if args[a] is args[b]:
            raise _Refused(f"{op} of a tensor with itself")
        la, lb = layouts[args[a]][da], layouts[args[b]][db]
        _same([la, lb], f"{op} contracts")
        return [Mask(a, (da,), "zero"), Mask(b, (db,), "zero")] if _padded((la,), [0]) else []
    if op in _INDEXED:
        if any(len(lay[d]) > 1 for d in (-2, -1)):
            raise _Refused(f"{op} on a merged dim")
        return []
    if op in _RESHAPES:
        return []
    if op is aten.native_layer_norm.default:
        if _padded(lay, range(len(lay) - len(args[1]), len(lay))):
            raise _Refused(f"{op} normalizes over a symbolic dim")
        return []
    if op is aten.native_layer_norm_backward.default:
        if _padded(lay, range(len(lay) - len(args[2]), len(lay))):
            raise _Refused(f"{op} normalizes over a symbolic dim")
        lead = _padded(lay, range(len(lay) - len(args[2])))
        return [Mask(i, lead, "zero") for i in (0, 1, 3, 4)] if lead else []
    if op in (aten._softmax_backward_data.default, aten._log_softmax_backward_data.default):
        dims = _padded(lay, reduced_dims(node, 2, len(lay)))
        both = op is aten._softmax_backward_data.default
        return [Mask(i, dims, "zero") for i in ((0, 1) if both else (0,))] if dims else []
    if op is aten.nll_loss_forward.default:
        if _padded(lay, [len(lay) - 1]):
            raise _Refused(f"{op} over a symbolic number of classes")
        if args[3] == 0 or not _padded(lay, [0]):
            return []
        _same([lay[0], layouts[args[1]][0]], f"{op} reduces")
        return [Mask(0, (0,), "zero"), Mask(1, (0,), args[4])]
    if op is aten.nll_loss_backward.default:
        if _padded(layouts[args[1]], [len(layouts[args[1]]) - 1]):
            raise _Refused(f"{op} over a symbolic number of classes")
        return []
    if op is aten.embedding_dense_backward.default:
        ind = layouts[args[1]]
        if args[4]:
            raise _Refused(f"{op} scales by frequency")
        _same([lay[:len(ind)], ind], f"{op} scatters")
        dims = _padded(ind, range(len(ind)))
        return [Mask(0, dims, "zero"), Mask(1, dims, max(args[3], 0))] if dims else []
    if op in _ATTENTION:
        return _attention_masks(node, layouts)
    if op is aten.gather.default:
        # Each output position reads where its index points: padded index positions give
        # padded outputs, and real indices point at real input positions.
        dim, index = args[1] % max(len(lay), 1), layouts[args[2]]
        others = [d for d in range(len(lay)) if d != dim]
        if _padded(lay, others) or _padded(index, others):
            _same([tuple(lay[d] for d in others), tuple(index[d] for d in others)],
                  f"{op} reads")
        return []
    if op is aten.index.Tensor:
        # The same for advanced indexing with integer index tensors (masks are data-dependent),
        # but a negative index counts from the end: along a padded dim it is made to count from
        # the real end.
        if any(isinstance(i, fx.Node) and _val(i).dtype == torch.bool for i in args[1]):
            raise _Refused(f"{op} with a boolean mask")
        wrapped = [j for j, i in enumerate(args[1]) if isinstance(i, fx.Node) and _padded(lay, [j])]
        if any(len(lay[j]) > 1 for j in wrapped):
            raise _Refused(f"{op} indexes a merged dim")
        if len({args[1][j] for j in wrapped}) < len(wrapped):
            raise _Refused(f"{op} indexes two padded dims with one tensor")
        return [Mask((1, j), (j,), "wrap") for j in wrapped]
    x = _val(args[0]) if args else None
    if op is aten.slice.Tensor:
        dim, start, end = (list(args[1:4]) + [0, None, None])[:3]
        n = x.shape[dim]
        if not _symbolic(n) or ((start or 0) == 0 and (end is None or _val(end) is n or (
                isinstance(end, int) and end >= 2**62))):
            return []
        start = start or 0
        if isinstance(start, int) and isinstance(end, int) and 0 <= start <= end \
                and not _symbolic(_val(node).shape[dim]):
            return []  # a fixed block from the start (x[:, :1]): real positions, as guarded
        if isinstance(start, int) and start < 0 and (end is None or (
                isinstance(end, int) and end >= 2**62)):
            return _from_end(node, lay, dim)  # the last positions (x[:, -3:])
        raise _Refused(f"{op} cuts a symbolic dim")
    if op is aten.select.int and isinstance(args[2], int):
        # A position counted from the start is real (Dynamo guards that it is below the size);
        # one counted from the end (x[:, -1]) reads the real end once that is moved to the end.
        return [] if args[2] >= 0 else _from_end(node, lay, args[1])
    if op in (aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default):
        at = 1 if op in (aten.select.int, aten.cat.default) else 2
        dim = args[at] if len(args) > at else node.kwargs.get("dim", 0)
        t = _val(args[0][0]) if op is aten.cat.default else x
        if _symbolic(t.shape[dim % t.dim()]):
            raise _Refused(f"{op} along a symbolic dim")
        return []
    raise _Refused(f"{op} is not known to be exact under padding")


_ATTENTION = {
    # (is_causal index, attn_bias index, masked args): padded keys and values are zeroed
    # forward; backward also zeroes the padded query rows' inputs, which would otherwise reach
    # real keys' gradients. What keeps real queries off padded keys is causality (a padded key
    # comes after every real query) or the attention mask, whose padded key columns are set to
    # "never attend" (False, or -inf for an additive mask).
    aten._scaled_dot_product_fused_attention_overrideable.default: (5, 3, (1, 2)),
    aten._scaled_dot_product_fused_attention_overrideable_backward.default: (
        13, 4, (0, 1, 2, 3, 6, 7)),
}


def _attention_masks(node: fx.Node, layouts: dict) -> list:
    causal, bias, masked = _ATTENTION[node.target]
    args = node.args
    seq = [layouts[args[i]][2] for i in masked]
    if not _padded((seq[0],), [0]):
        return []
    _same(seq, f"{node.target} attends")
    if len(seq[0]) > 1:
        raise _Refused(f"{node.target} over a merged dim")
    masks = [Mask(i, (2,), "zero") for i in masked]
    mask = args[bias] if len(args) > bias else None
    if isinstance(mask, fx.Node):
        key_dim = _val(mask).dim() - 1
        if layouts[mask][key_dim] != seq[0]:
            raise _Refused(f"{node.target}: the attention mask's key dim is not the keys'")
        never = "false" if _val(mask).dtype == torch.bool else "lowest"
        return [*masks, Mask(bias, (key_dim,), never)]
    if len(args) > causal and args[causal] is True:
        return masks
    raise _Refused(f"{node.target} over a symbolic length without a causal or attention mask")


def _from_end(node: fx.Node, layout: tuple, dim: int) -> list:
    """Positions counted from the end of a padded dim: the input is rolled so that its real
    elements end where the padded dim ends."""
    dim %= len(layout)
    if not _padded(layout, [dim]):
        return []
    if len(layout[dim]) > 1:
        raise _Refused(f"{node.target} counts from the end of a merged dim")
    return [Mask(0, (dim,), "end")]


def _numbers(node: fx.Node, traced: frozenset) -> tuple:
    """The symbolic sizes node takes as traced numbers; refused where it takes one otherwise."""
    op = node.target
    if op in _SYM_ARITHMETIC or op is operator.getitem or op is aten.sym_size.int:
        return ()
    values = schema.bind(schema.info(op), node.args, node.kwargs)[0] \
        if isinstance(op, torch._ops.OpOverload) else node.args
    numbers = []
    for i, v in enumerate(values):
        if _is_sym(v):
            if i in traced:
                numbers.append(v)
            elif (op, i) not in _SIZE_ARGUMENTS:
                raise _Refused(f"{op} takes a symbolic size as a value")
    if numbers and any(_is_sym(x) for v in values if isinstance(v, (list, tuple)) for x in v):
        raise _Refused(f"{op} uses a symbolic size both as a number and as a size")
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
            if n.target is aten.copy_.default:
                raise _Refused("an input with a symbolic size is mutated")
            layouts[n] = _layout_of(n, layouts, order)
            node_masks = _masks(n, layouts)
            if node_masks:
                masks[n] = node_masks
            nums = _numbers(n, traced_of(n))
            if nums:
                numbers[n] = nums
    except _Refused as e:
        return str(e)
    return Plan(order, layouts, masks, numbers)
