"""Dynamic shapes by padding: a graph with symbolic sizes runs as one program per size bucket.

Under ``torch.compile(dynamic=True)`` a graph's sizes are symbols (``s0``, ``s1``). When every
op a symbolic dimension flows through treats positions along it independently (elementwise ops,
matmuls and reductions over other dims, views that keep it whole, causal masks), zero-padding
each symbolic input dimension up to a bucket and slicing the outputs back gives exactly the
unpadded results: padded positions only ever produce padded positions. ``plan`` checks that,
op by op, from the graph's symbolic metadata; a graph that fails the check (a softmax or sum
over a symbolic dim, a slice that cuts one, a symbol used as a number) is compiled per exact
shape instead, which ``backend`` counts and logs.

Buckets are ``bucket_size * 2**i`` for ``i < num_dynamic_buckets``; larger sizes round up to a
multiple of the largest bucket. Padding and slicing happen on the host: a device pad or slice
would itself be one XLA program per size, which is what bucketing avoids.
"""

from __future__ import annotations

import math
import operator

import numpy as np
import sympy
import torch
import torch.fx as fx

aten = torch.ops.aten

# Ops whose positions along every dimension are independent of each other, whatever the dims.
_POSITIONWISE = {
    aten.clone.default, aten.alias.default, aten.detach.default, aten._to_copy.default,
    aten.t.default, aten.transpose.int, aten.permute.default, aten.unsqueeze.default,
    aten.squeeze.dim, aten.expand.default, aten.embedding.default, aten.full.default,
    aten.ones.default, aten.zeros.default, aten.empty.memory_format, aten.full_like.default,
    aten.zeros_like.default, aten.ones_like.default, aten.empty_like.default,
    aten.scalar_tensor.default, aten.tril.default, aten.triu.default, aten.copy.default,
    aten.arange.default, aten.sym_size.int, operator.getitem,
}
_SYM_ARITHMETIC = {operator.add, operator.sub, operator.mul, operator.floordiv}
# Reductions and normalizations: (dims argument index, True when it counts from the end).
_REDUCING = {
    aten.sum.dim_IntList: (1, False), aten.mean.dim: (1, False), aten.amax.default: (1, False),
    aten.amin.default: (1, False), aten.var_mean.correction: (1, False),
    aten.var.correction: (1, False), aten._softmax.default: (1, False),
    aten._log_softmax.default: (1, False), aten.native_layer_norm.default: (1, True),
}
_CONTRACTING = {aten.mm.default: 0, aten.bmm.default: 0, aten.addmm.default: 1}
_RESHAPES = {aten.view.default, aten._unsafe_view.default, aten.reshape.default}


def _expr(d):
    return d.node.expr if isinstance(d, torch.SymInt) else sympy.Integer(d)


def _symbolic(d) -> bool:
    return bool(_expr(d).free_symbols)


def _val(a):
    return a.meta.get("val") if isinstance(a, fx.Node) else a


def _tensors(node: fx.Node) -> list:
    vals = [_val(a) for a in node.all_input_nodes] + [_val(node)]
    flat = [v for x in vals for v in (x if isinstance(x, (list, tuple)) else [x])]
    return [v for v in flat if isinstance(v, torch.Tensor)]


def _touches_symbols(node: fx.Node) -> bool:
    return any(_symbolic(d) for t in _tensors(node) for d in t.shape)


def _reshape_ok(src, dst, order: list) -> bool:
    """Whether a reshape regroups only constant dims, or merges/splits whole symbolic dims."""
    def factors(shape):
        out = []
        for d in shape:
            e = _expr(d)
            if e.free_symbols:
                coeff, syms = e.as_coeff_mul()
                if coeff != 1 or any(not isinstance(s, sympy.Symbol) for s in syms):
                    return None
                out.append(sorted(syms, key=order.index))
            else:
                out.append(int(e))
        return out

    a, b = factors(src), factors(dst)
    if a is None or b is None:
        return False
    i = j = 0
    while i < len(a) or j < len(b):
        ga, gb = [a[i]] if i < len(a) else [], [b[j]] if j < len(b) else []
        i, j = i + len(ga), j + len(gb)
        while _product(ga) != _product(gb):
            ratio = sympy.fraction(sympy.simplify(_product(gb) / _product(ga)))[1]
            if ratio == 1 and i < len(a):
                ga.append(a[i])
                i += 1
            elif j < len(b):
                gb.append(b[j])
                j += 1
            else:
                return False
        sym_a = [s for g in ga if isinstance(g, list) for s in g]
        sym_b = [s for g in gb if isinstance(g, list) for s in g]
        consts = [g for g in ga + gb if not isinstance(g, list) and g != 1]
        if (sym_a or sym_b) and (sym_a != sym_b or consts):
            return False
    return True


def _product(group) -> sympy.Expr:
    return sympy.Mul(*[sympy.Mul(*g) if isinstance(g, list) else sympy.Integer(g)
                       for g in group])


def _node_problem(node: fx.Node, order: list) -> str | None:
    op = node.target
    if not _touches_symbols(node) and not any(
            isinstance(_val(a), torch.SymInt) for a in node.all_input_nodes):
        return None
    if op in _SYM_ARITHMETIC or op in _POSITIONWISE:
        return None
    if isinstance(op, torch._ops.OpOverload) and torch.Tag.pointwise in op.tags:
        if any(isinstance(_val(a), torch.SymInt) for a in node.all_input_nodes):
            return f"{op} uses a symbolic size as a number"
        return None
    x = _val(node.args[0]) if node.args else None
    if op in _REDUCING:
        index, from_end = _REDUCING[op]
        dims = node.args[index] if len(node.args) > index else None
        if dims is None:
            return f"{op} reduces every dim"
        dims = [dims] if isinstance(dims, int) else list(dims)
        nd = x.dim()
        axes = range(nd - len(dims), nd) if from_end else [d % max(nd, 1) for d in dims]
        return f"{op} reduces a symbolic dim" if any(_symbolic(x.shape[a]) for a in axes) \
            else None
    if op in _CONTRACTING:
        lhs = _val(node.args[_CONTRACTING[op]])
        return f"{op} contracts a symbolic dim" if _symbolic(lhs.shape[-1]) else None
    if op in _RESHAPES:
        return None if _reshape_ok(x.shape, _val(node).shape, order) else \
            f"{op} {list(x.shape)} -> {list(_val(node).shape)} splits a symbolic dim"
    if op is aten.slice.Tensor:
        dim, start, end = (list(node.args[1:4]) + [0, None, None])[:3]
        n = x.shape[dim]
        if not _symbolic(n) or ((start or 0) == 0 and (end is None or _val(end) is n or (
                isinstance(end, int) and end >= 2**62))):
            return None
        return f"{op} cuts a symbolic dim"
    if op in (aten.select.int, aten.split.Tensor, aten.split_with_sizes.default, aten.cat.default):
        dim = node.args[1] if op is aten.select.int else (node.args[2] if len(node.args) > 2
                                                             else node.kwargs.get("dim", 0))
        t = _val(node.args[0][0]) if op is aten.cat.default else x
        return f"{op} along a symbolic dim" if _symbolic(t.shape[dim % t.dim()]) else None
    return f"{op} is not known to be exact under padding"


NO_SYMBOLS = "the graph has no symbolic sizes"


def plan(gm: fx.GraphModule) -> str | None:
    """None when the graph can run padded to buckets, else why not (for the log)."""
    order: list = []
    for n in gm.graph.nodes:
        v = _val(n)
        if n.op != "placeholder":
            continue
        dims = list(v.shape) if isinstance(v, torch.Tensor) else [v] \
            if isinstance(v, torch.SymInt) else []
        for d in dims:
            e = _expr(d)
            if e.free_symbols and not isinstance(e, sympy.Symbol):
                return f"input {n.name} has a size {e} that is not a plain symbol"
            if isinstance(e, sympy.Symbol) and e not in order:
                order.append(e)
    if not order:
        return NO_SYMBOLS
    for n in gm.graph.nodes:
        if n.op == "call_function":
            problem = _node_problem(n, order)
            if problem:
                return problem
    outputs = next(n for n in gm.graph.nodes if n.op == "output").args[0]
    for o in outputs:
        v = _val(o)
        dims = list(v.shape) if isinstance(v, torch.Tensor) else [v] \
            if isinstance(v, torch.SymInt) else []
        if any(_expr(d).free_symbols and not isinstance(_expr(d), sympy.Symbol) for d in dims):
            return f"output {o} has a size that is not a plain symbol"
    return None


def bucket(n: int, bucket_size: int, num_buckets: int) -> int:
    """The padded size for a symbolic size n."""
    for i in range(num_buckets):
        if n <= bucket_size << i:
            return bucket_size << i
    largest = bucket_size << (num_buckets - 1)
    return math.ceil(n / largest) * largest


def sizes_of(placeholders: list, args: list) -> dict:
    """Each symbol's runtime value, read from the inputs whose sizes name it."""
    values = {}
    for n, a in zip(placeholders, args, strict=True):
        v = _val(n)
        if isinstance(v, torch.SymInt):
            values[_expr(v)] = int(a)
        elif isinstance(v, torch.Tensor):
            for d, actual in zip(v.shape, a.shape, strict=True):
                if isinstance(_expr(d), sympy.Symbol):
                    values[_expr(d)] = int(actual)
    return values


def real_value(val, values: dict):
    """A symbolic output number at the real sizes (the program saw padded ones)."""
    return int(_expr(val).subs(values)) if isinstance(val, torch.SymInt) else val


def padded_shape(val, to: dict) -> tuple:
    return tuple(to[_expr(d)] if _symbolic(d) else int(d) for d in val.shape)


def pad(array, shape: tuple):
    """array zero-padded at the end of each dim up to shape, as a host array."""
    host = np.asarray(array)
    if host.shape == shape:
        return host
    return np.pad(host, [(0, p - s) for s, p in zip(host.shape, shape, strict=True)])


def unpad(array, shape: tuple):
    """The leading shape block of array, as a host array."""
    return np.asarray(array)[tuple(slice(0, s) for s in shape)]
