"""Padding rules: what an op needs to give exact results on inputs padded to a size bucket.

``compile/dynamic.py`` runs graphs with symbolic sizes padded to buckets (its module doc says
how, and what a *layout* is). Whether one op stays exact under that padding, and what must be
masked first, is a property of the op, so it is declared beside the op's lowering (or graph
form) with ``@padding_rule(op)`` (``registry.PADDING_RULES``), and the compiled path names no
op; so are the arguments that only set a size (``registry.size_arguments``) and the means
(``registry.padded_mean``). A rule gets the FX node and the layouts of the tensors before it,
and returns the node's ``Mask`` list (empty when it is position-wise) or raises ``Refused``
(the graph then compiles per exact shape, logged). This module holds what rules share:
``Mask``, the helpers, the rule factories (``positionwise``, ``reduction``, ``contraction``,
``along``) and ``masks``, which the plan calls for every node.

Ops tagged pointwise need no rule. Reductions replace the padding by their identity (0 for sum,
-inf for amax/softmax/logsumexp, True for all...), contractions (mm, bmm, addmm) by 0 on both
operands, mean divides by the real count, nll_loss ignores padded rows through
``ignore_index``, and the backward ops of softmax, log_softmax, layer norm and embedding are
masked likewise. Fused attention runs padded when it is causal or has an attention mask.
Gathers and integer-tensor indexing read real positions only; a ``select`` or slice counted from
the end rolls the input first (fill "end").
"""

from __future__ import annotations

import dataclasses

import sympy
import torch
import torch.fx as fx

from torchtpu.lowering.registry import PADDING_RULES


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


def same(layouts: list, what: str) -> None:
    if len(set(layouts)) > 1:
        raise Refused(f"{what} over dims laid out differently")


def first(node: fx.Node, layouts: dict):
    args = node.args
    return layouts.get(args[0]) if args and isinstance(args[0], fx.Node) else None


def positionwise(node: fx.Node, layouts: dict) -> list:
    """The rule of ops whose positions are independent along every dim, whatever the dims
    (views, copies, allocations, embedding): garbage stays in padding positions."""
    return []


def reduction(index, fill: str):
    """The rule of a reduction over the dims at argument index (None: every dim): padding
    replaced by its identity, fill."""
    def rule(node: fx.Node, layouts: dict) -> list:
        lay = first(node, layouts)
        dims = padded(lay, reduced_dims(node, index, len(lay)))
        return [Mask(0, dims, fill)] if dims else []

    return rule


def contraction(a: int, da: int, b: int, db: int):
    """The rule of a product whose operand a's dim da contracts with operand b's dim db:
    padding zeroed on both."""
    def rule(node: fx.Node, layouts: dict) -> list:
        args = node.args
        if args[a] is args[b]:
            raise Refused(f"{node.target} of a tensor with itself")
        la, lb = layouts[args[a]][da], layouts[args[b]][db]
        same([la, lb], f"{node.target} contracts")
        return [Mask(a, (da,), "zero"), Mask(b, (db,), "zero")] if padded((la,), [0]) else []

    return rule


def along(at: int, of_list: bool = False):
    """The rule of ops that cut or join along the dim at argument at: exact unless that dim is
    padded."""
    def rule(node: fx.Node, layouts: dict) -> list:
        args = node.args
        dim = args[at] if len(args) > at else node.kwargs.get("dim", 0)
        t = val(args[0][0]) if of_list else val(args[0])
        if symbolic(t.shape[dim % t.dim()]):
            raise Refused(f"{node.target} along a symbolic dim")
        return []

    return rule


def from_end(node: fx.Node, layout: tuple, dim: int) -> list:
    """Positions counted from the end of a padded dim: the input is rolled so that its real
    elements end where the padded dim ends."""
    dim %= len(layout)
    if not padded(layout, [dim]):
        return []
    if len(layout[dim]) > 1:
        raise Refused(f"{node.target} counts from the end of a merged dim")
    return [Mask(0, (dim,), "end")]
