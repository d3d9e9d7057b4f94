"""Padding rules: what each op needs to give exact results on inputs padded to a size bucket.

``compile/dynamic.py`` runs graphs with symbolic sizes padded to buckets (its module doc says
how, and what a *layout* is). Whether one op stays exact under that padding, and what must be
masked first, is a property of the op, so it is declared with ``@padding_rule(op)``
(``registry.PADDING_RULES``; a new op's beside its lowering, today's ops' here beside the
helpers they share) and the compiled path names no op. A rule gets the FX node and the
layouts of the tensors before it, and returns the node's ``Mask`` list (empty when it is
position-wise) or raises ``Refused`` (the graph then compiles per exact shape, logged).

Ops tagged pointwise need no rule. Reductions replace the padding by their identity (0 for sum,
-inf for amax/softmax/logsumexp, True for all...), contractions (mm, bmm, addmm) by 0 on both
operands, mean divides by the real count (``MEAN_DIMS``), nll_loss ignores padded rows through
``ignore_index``, and the backward ops of softmax, log_softmax, layer norm and embedding are
masked likewise. Fused attention runs padded when it is causal or has an attention mask.
Gathers and integer-tensor indexing read real positions only; a ``select`` or slice counted from
the end rolls the input first (fill "end").
"""

from __future__ import annotations

import dataclasses
import operator

import sympy
import torch
import torch.fx as fx

from torchtpu.lowering.graph_forms import SIZE_ARITHMETIC
from torchtpu.lowering.registry import PADDING_RULES, padding_rule

aten = torch.ops.aten


class Refused(Exception):
    """The op is not exact under this padding (the message says why, for the log)."""


@dataclasses.dataclass(frozen=True)
class Mask:
    """Replace the padding of argument ``arg`` along ``dims`` by ``fill`` before the op runs;
    "wrap": make the negative values of index tensor ``arg`` ((argument, list position)) count
    from the real end of ``dims`` of argument 0; "end": roll the real elements to the end."""

    arg: int | tuple
    dims: tuple
    fill: str | int


# Symbolic-size arguments that only set a size (a slice end, arange's end): buckets are right.
# (A range's end padded gives the real range and then padding: ``arange(0, s0)``'s dim is s0, a
# plain symbol; one whose length is not, ``arange(2, s0)`` or a step of 2, has no layout.)
SIZE_ARGUMENTS = {(aten.slice.Tensor, 3), (aten.arange.default, 0), (aten.arange.start, 1),
                  (aten.arange.start_step, 1),
                  (aten._scaled_dot_product_fused_attention_overrideable_backward.default, 10),
                  (aten._scaled_dot_product_fused_attention_overrideable_backward.default, 11)}
# Ops whose output keeps its input's elements in order under a new shape (layouts follow).
RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}
# Ops that read sizes, never values: they take no symbolic size as a number.
SIZE_READS = {aten.sym_size.int, operator.getitem, *SIZE_ARITHMETIC}
# Means (argument index of their dims, None for every dim): the padded program sums the masked
# input and divides by the real count.
MEAN_DIMS = {aten.mean.dim: 1, aten.mean.default: None}


def masks(node: fx.Node, layouts: dict) -> list:
    """The masks node needs (empty when it is position-wise); raises Refused when it cannot be
    exact."""
    op = node.target
    if isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
        return []
    rule = PADDING_RULES.get(op)
    if rule is None:
        raise Refused(f"{op} is not known to be exact under padding")
    return rule(node, layouts)


def val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def symbolic(d) -> bool:
    """Whether size d (an int or a SymInt) has a symbol in it."""
    return isinstance(d, torch.SymInt) and bool(d.node.expr.free_symbols)


def reduced_dims(node: fx.Node, index, ndim: int) -> tuple:
    dims = None if index is None else (node.args[index] if len(node.args) > index else None)
    if dims is None or dims == []:
        return tuple(range(ndim))
    dims = [dims] if isinstance(dims, int) else list(dims)
    return tuple(sorted(d % max(ndim, 1) for d in dims))


def padded(layout: tuple, dims) -> tuple:
    """The dims among dims whose layout has a symbolic factor (hold padding)."""
    return tuple(d for d in dims if any(isinstance(f, sympy.Symbol) for f in layout[d]))


def _same(layouts: list, what: str) -> None:
    if len(set(layouts)) > 1:
        raise Refused(f"{what} over dims laid out differently")


def _first(node: fx.Node, layouts: dict):
    args = node.args
    return layouts.get(args[0]) if args and isinstance(args[0], fx.Node) else None


# Positions independent along every dim, whatever the dims (views, copies, allocations, embedding,
# causal masks are position-wise too; RESHAPES keep symbolic factors whole, dynamic.py checks).
@padding_rule(
    aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
    aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.expand.default, aten.embedding.default, aten.full.default,
    aten.ones.default, aten.zeros.default, aten.empty.memory_format, aten.full_like.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.scalar_tensor.default, aten.copy.default, aten.arange.default, aten.arange.start,
    aten.arange.start_step, *SIZE_READS, *RESHAPES)
def _positionwise(node: fx.Node, layouts: dict) -> list:
    return []


def _reduction(index, fill: str):
    def rule(node: fx.Node, layouts: dict) -> list:
        lay = _first(node, layouts)
        dims = padded(lay, reduced_dims(node, index, len(lay)))
        return [Mask(0, dims, fill)] if dims else []

    return rule


# Reductions: padding replaced by their identity.
for _op, (_index, _fill) in {
    aten.sum.dim_IntList: (1, "zero"), aten.sum.default: (None, "zero"),
    aten.mean.dim: (1, "zero"), aten.mean.default: (None, "zero"),
    aten.amax.default: (1, "lowest"), aten.amin.default: (1, "highest"),
    aten.all.dim: (1, "true"), aten.all.dims: (1, "true"),
    aten.any.dim: (1, "false"), aten.any.dims: (1, "false"),
    aten.prod.dim_int: (1, "one"), aten.logsumexp.default: (1, "lowest"),
    aten._softmax.default: (1, "lowest"), aten._log_softmax.default: (1, "lowest"),
}.items():
    padding_rule(_op)(_reduction(_index, _fill))


def _contraction(a: int, da: int, b: int, db: int):
    """Operand a's dim da contracts with operand b's dim db: padding zeroed on both."""
    def rule(node: fx.Node, layouts: dict) -> list:
        args = node.args
        if args[a] is args[b]:
            raise Refused(f"{node.target} of a tensor with itself")
        la, lb = layouts[args[a]][da], layouts[args[b]][db]
        _same([la, lb], f"{node.target} contracts")
        return [Mask(a, (da,), "zero"), Mask(b, (db,), "zero")] if padded((la,), [0]) else []

    return rule


padding_rule(aten.mm.default)(_contraction(0, 1, 1, 0))
padding_rule(aten.bmm.default)(_contraction(0, 2, 1, 1))
padding_rule(aten.addmm.default)(_contraction(1, 1, 2, 0))


@padding_rule(aten.tril.default, aten.triu.default)
def _triangle(node: fx.Node, layouts: dict) -> list:
    # Position-wise for leading-block layouts.
    if any(len(_first(node, layouts)[d]) > 1 for d in (-2, -1)):
        raise Refused(f"{node.target} on a merged dim")
    return []


@padding_rule(aten.native_layer_norm.default)
def _layer_norm(node: fx.Node, layouts: dict) -> list:
    lay = _first(node, layouts)
    if padded(lay, range(len(lay) - len(node.args[1]), len(lay))):
        raise Refused(f"{node.target} normalizes over a symbolic dim")
    return []


@padding_rule(aten.native_layer_norm_backward.default)
def _layer_norm_backward(node: fx.Node, layouts: dict) -> list:
    lay, normalized = _first(node, layouts), len(node.args[2])
    if padded(lay, range(len(lay) - normalized, len(lay))):
        raise Refused(f"{node.target} normalizes over a symbolic dim")
    lead = padded(lay, range(len(lay) - normalized))
    return [Mask(i, lead, "zero") for i in (0, 1, 3, 4)] if lead else []


@padding_rule(aten._softmax_backward_data.default, aten._log_softmax_backward_data.default)
def _softmax_backward(node: fx.Node, layouts: dict) -> list:
    lay = _first(node, layouts)
    dims = padded(lay, reduced_dims(node, 2, len(lay)))
    both = node.target is aten._softmax_backward_data.default
    return [Mask(i, dims, "zero") for i in ((0, 1) if both else (0,))] if dims else []


@padding_rule(aten.nll_loss_forward.default)
def _nll_loss(node: fx.Node, layouts: dict) -> list:
    lay, args = _first(node, layouts), node.args
    if padded(lay, [len(lay) - 1]):
        raise Refused(f"{node.target} over a symbolic number of classes")
    if args[3] == 0 or not padded(lay, [0]):
        return []
    _same([lay[0], layouts[args[1]][0]], f"{node.target} reduces")
    return [Mask(0, (0,), "zero"), Mask(1, (0,), args[4])]


@padding_rule(aten.nll_loss_backward.default)
def _nll_loss_backward(node: fx.Node, layouts: dict) -> list:
    target = layouts[node.args[1]]
    if padded(target, [len(target) - 1]):
        raise Refused(f"{node.target} over a symbolic number of classes")
    return []


@padding_rule(aten.embedding_dense_backward.default)
def _embedding_backward(node: fx.Node, layouts: dict) -> list:
    lay, args = _first(node, layouts), node.args
    ind = layouts[args[1]]
    if args[4]:
        raise Refused(f"{node.target} scales by frequency")
    _same([lay[:len(ind)], ind], f"{node.target} scatters")
    dims = padded(ind, range(len(ind)))
    return [Mask(0, dims, "zero"), Mask(1, dims, max(args[3], 0))] if dims else []


@padding_rule(aten.gather.default)
def _gather(node: fx.Node, layouts: dict) -> list:
    # Each output position reads where its index points: padded index positions give padded
    # outputs, and real indices point at real input positions.
    lay, args = _first(node, layouts), node.args
    dim, index = args[1] % max(len(lay), 1), layouts[args[2]]
    others = [d for d in range(len(lay)) if d != dim]
    if padded(lay, others) or padded(index, others):
        _same([tuple(lay[d] for d in others), tuple(index[d] for d in others)],
              f"{node.target} reads")
    return []


@padding_rule(aten.index.Tensor)
def _index(node: fx.Node, layouts: dict) -> list:
    # The same for advanced indexing with integer index tensors (masks are data-dependent), but
    # a negative index counts from the end: along a padded dim it is made to count from the
    # real end.
    lay, indices, op = _first(node, layouts), node.args[1], node.target
    if any(isinstance(i, fx.Node) and val(i).dtype == torch.bool for i in indices):
        raise Refused(f"{op} with a boolean mask")
    wrapped = [j for j, i in enumerate(indices) if isinstance(i, fx.Node) and padded(lay, [j])]
    if any(len(lay[j]) > 1 for j in wrapped):
        raise Refused(f"{op} indexes a merged dim")
    if len({indices[j] for j in wrapped}) < len(wrapped):
        raise Refused(f"{op} indexes two padded dims with one tensor")
    return [Mask((1, j), (j,), "wrap") for j in wrapped]


def _from_end(node: fx.Node, layout: tuple, dim: int) -> list:
    """Positions counted from the end of a padded dim: the input is rolled so that its real
    elements end where the padded dim ends."""
    dim %= len(layout)
    if not padded(layout, [dim]):
        return []
    if len(layout[dim]) > 1:
        raise Refused(f"{node.target} counts from the end of a merged dim")
    return [Mask(0, (dim,), "end")]


@padding_rule(aten.slice.Tensor)
def _slice(node: fx.Node, layouts: dict) -> list:
    lay, op = _first(node, layouts), node.target
    dim, start, end = (list(node.args[1:4]) + [0, None, None])[:3]
    n = val(node.args[0]).shape[dim]
    if not symbolic(n) or ((start or 0) == 0 and (end is None or val(end) is n or (
            isinstance(end, int) and end >= 2**62))):
        return []
    start = start or 0
    if isinstance(start, int) and isinstance(end, int) and 0 <= start <= end \
            and not symbolic(val(node).shape[dim]):
        return []  # a fixed block from the start (x[:, :1]): real positions, as guarded
    if isinstance(start, int) and start < 0 and (end is None or (
            isinstance(end, int) and end >= 2**62)):
        return _from_end(node, lay, dim)  # the last positions (x[:, -3:])
    raise Refused(f"{op} cuts a symbolic dim")


def _along(at: int, of_list: bool = False):
    """Ops that cut or join along the dim at argument at: exact unless that dim is padded."""
    def rule(node: fx.Node, layouts: dict) -> list:
        args = node.args
        dim = args[at] if len(args) > at else node.kwargs.get("dim", 0)
        t = val(args[0][0]) if of_list else val(args[0])
        if symbolic(t.shape[dim % t.dim()]):
            raise Refused(f"{node.target} along a symbolic dim")
        return []

    return rule


_select_along = _along(1)


@padding_rule(aten.select.int)
def _select(node: fx.Node, layouts: dict) -> list:
    # A position counted from the start is real (Dynamo guards that it is below the size); one
    # counted from the end (x[:, -1]) reads the real end once that is moved to the end.
    if isinstance(node.args[2], int):
        return [] if node.args[2] >= 0 else _from_end(node, _first(node, layouts), node.args[1])
    return _select_along(node, layouts)


padding_rule(aten.split.Tensor, aten.split_with_sizes.default)(_along(2))
padding_rule(aten.cat.default)(_along(1, of_list=True))


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


@padding_rule(*_ATTENTION)
def _attention(node: fx.Node, layouts: dict) -> list:
    causal, bias, masked = _ATTENTION[node.target]
    args = node.args
    seq = [layouts[args[i]][2] for i in masked]
    if not padded((seq[0],), [0]):
        return []
    _same(seq, f"{node.target} attends")
    if len(seq[0]) > 1:
        raise Refused(f"{node.target} over a merged dim")
    out = [Mask(i, (2,), "zero") for i in masked]
    mask = args[bias] if len(args) > bias else None
    if isinstance(mask, fx.Node):
        key_dim = val(mask).dim() - 1
        if layouts[mask][key_dim] != seq[0]:
            raise Refused(f"{node.target}: the attention mask's key dim is not the keys'")
        never = "false" if val(mask).dtype == torch.bool else "lowest"
        return [*out, Mask(bias, (key_dim,), never)]
    if len(args) > causal and args[causal] is True:
        return out
    raise Refused(f"{node.target} over a symbolic length without a causal or attention mask")
