"""A bucketed eager call as a one-node FX graph with symbolic sizes, and its padding plan.

``eager_buckets`` hands over a call whose sizes vary at its call site: its tensors become
placeholders whose varying dims are symbols (equal sizes, one symbol), its varying integer
arguments symbolic placeholders, and ``dynamic.plan`` decides, exactly as for
``torch.compile(dynamic=True)``, whether it runs padded and what it masks.
"""

from __future__ import annotations

import torch
import torch.fx as fx

from torchtpu.compile import dynamic
from torchtpu.compile.graph_function import GraphFunction
from torchtpu.eager import calls, schema
from torchtpu.eager.program import CONST, TENSOR, TENSORS, Spec
from torchtpu.lowering.registry import Lowering


def is_int(v) -> bool:
    return type(v) is int


def int_tuple(payload) -> bool:
    return isinstance(payload, tuple) and bool(payload) and all(is_int(x) for x in payload)


def _symint(env, k: int, hint: int):
    from torch._dynamo.source import ConstantSource
    from torch.fx.experimental.symbolic_shapes import DimDynamic

    s = env.create_symbol(hint, ConstantSource(f"eager_size_{k}"), dynamic_dim=DimDynamic.DYNAMIC)
    return env.create_symintnode(s, hint=hint)


def build(lowering: Lowering, spec: Spec, values: list, call, pattern: tuple,
           real: tuple, sizes: tuple):
    """(GraphFunction, Plan, its symbols, the symbols of its integer placeholders) of the call
    as a one-node graph with symbolic sizes, or why it cannot run padded."""
    # Imported here: importing torchtpu stays free of Dynamo's import cost.
    from torch._subclasses.fake_tensor import FakeTensorMode
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    op = lowering.op
    try:
        env = ShapeEnv()
        syms = [_symint(env, k, n) for k, n in enumerate(real)]
        slot = iter(zip(pattern, sizes))

        def size():
            s, n = next(slot)
            return n if s is None else syms[s]

        graph = fx.Graph()
        with FakeTensorMode(shape_env=env):
            fakes = [torch.empty([size() for _ in range(t.dim())], dtype=t.dtype)
                     for t in call.tensors]
            args, int_symbols = _node_values(graph, spec, values, fakes, call, size)
            oi = schema.info(op)
            pos = [a for a, name in zip(args, oi.names) if name not in oi.kwarg_only]
            kw = {name: a for a, name in zip(args, oi.names) if name in oi.kwarg_only}
            node = graph.call_function(op, tuple(pos), kw)
            node.meta["val"] = op(*fx.node.map_arg(tuple(pos), _val),
                                  **fx.node.map_arg(kw, _val))
        graph.output((node,))
        if env.replacements:
            return f"{op} specializes a size"
        gm = fx.GraphModule(torch.nn.Module(), graph)
        traced = calls.traced_arguments(op, lowering)
        plan = dynamic.plan(gm, lambda n: traced)
        if isinstance(plan, str):
            return plan
        symbols = tuple(s.node.expr for s in syms)
        return GraphFunction(gm), plan, symbols, int_symbols
    except Exception as e:  # a meta kernel refusing symbolic sizes: the exact path serves it
        return f"{op}: {type(e).__name__}: {e}"


def _val(n: fx.Node):
    return n.meta["val"]


def _node_values(graph: fx.Graph, spec: Spec, values: list, fakes: list, call, size):
    """The node's arguments: tensors and varying integers as placeholders, the rest as given;
    and the symbols of the integer placeholders, in order."""
    fake = iter(fakes)
    count = [0]

    def placeholder(val):
        p = graph.placeholder(f"arg{count[0]}")
        count[0] += 1
        p.meta["val"] = val
        return p

    tensor_nodes = []
    for (kind, _), v in zip(call.entries, values):
        if kind == TENSOR:
            tensor_nodes.append(placeholder(next(fake)))
        elif kind == TENSORS:
            tensor_nodes.extend(placeholder(next(fake)) for x in v if x is not None)
    tensor_node = iter(tensor_nodes)
    args, int_symbols = [], []

    def integer(n):
        s = size()
        if isinstance(s, int):
            return n
        int_symbols.append(s.node.expr)
        return placeholder(s)

    for (kind, payload), v in zip(call.entries, values):
        if kind == TENSOR:
            args.append(next(tensor_node))
        elif kind == TENSORS:
            args.append([None if x is None else next(tensor_node) for x in v])
        elif kind == CONST and is_int(payload):
            args.append(integer(payload))
        elif kind == CONST and int_tuple(payload):
            args.append([integer(x) for x in payload])
        else:
            args.append(v)
    return args, tuple(int_symbols)
