"""One FX graph (aten-level, functional) as one pure JAX function, built from the lowering table.

Each node runs exactly as eager would run the same op: its arguments are split into the same
spec (tensors, traced scalars, PRNG keys, constants) and rebuilt by ``eager.program.rebuild``, so
the lowering sees what it sees in eager, with the same promotion, and its results are cast to
the dtypes PyTorch's meta kernels gave (``node.meta["val"]``). Views, copies and allocations,
which eager serves with device kernels, come from ``lowering/graph_forms.py``.

The ops' checks of data (``lowering/checks.py``) run inside the program, as on the device in
eager: each gives an ``[bad, value]`` flag, returned after the graph's outputs, that the caller
hands to ``device/asserts.py`` (graphs with symbolic sizes check shapes at trace time only).

``GraphFunction.run`` is traced once per input signature by the caller; it never touches tensors.
"""

from __future__ import annotations

import operator
from typing import Any

import torch
import torch.fx as fx

from torchtpu.compile import buckets, control_flow, dynamic, masking
from torchtpu.device import dtypes
from torchtpu.eager import at_call, calls, meta, refusals, schema
from torchtpu.eager.program import (
    CONST,
    KEY,
    SCALAR,
    TENSOR,
    TENSORS,
    Spec,
    cast_outputs,
    rebuild,
)
from torchtpu.lowering import checks, graph_forms
from torchtpu.lowering.registry import GRAPH_FORMS, Lowering, lookup

OpOverload = torch._ops.OpOverload


def missing_lowering(op) -> NotImplementedError:
    return NotImplementedError(f"torchtpu.fallback: aten op '{op}' has no tpu lowering (compiled "
                               "graph)")


def _is_tensor_val(v) -> bool:
    return isinstance(v, torch.Tensor)


def _val(n):
    return n.meta.get("val") if isinstance(n, fx.Node) else n


def result_dtypes(val):
    """The node's result dtypes as JAX dtypes, shaped like its results (None where absent)."""
    if _is_tensor_val(val):
        return dtypes.to_jax(val.dtype)
    if isinstance(val, (list, tuple)):
        return tuple(result_dtypes(v) for v in val)
    return None


def _promotion_stand_in(v):
    """A meta tensor with v's dtype and rank: all that PyTorch's result_type looks at."""
    v = _val(v)
    if _is_tensor_val(v):
        return torch.empty((1,) * v.dim(), dtype=v.dtype, device="meta")
    return v


class _Step:
    """One call_function node, prepared once; ``run`` evaluates it inside the trace."""

    def __init__(self, node: fx.Node, key_slots: list) -> None:
        self.node = node
        op = node.target
        self.graph_op = None
        self.lowering: Lowering | None = lookup(op) if isinstance(op, OpOverload) else None
        self.dtypes = result_dtypes(node.meta.get("val"))
        if op is operator.getitem:
            return
        if op is graph_forms.INPUT_WRITE and node.args[0].op == "placeholder":
            # An input mutation kept in an inference graph: the new value becomes an extra
            # output that the caller writes into the input tensor.
            self.graph_op = graph_forms.copy
            return
        if self.lowering is None:
            self.graph_op = GRAPH_FORMS.get(op)
            if self.graph_op is None:
                raise missing_lowering(op)
            return
        self.oi = schema.info(op)
        # The same traced arguments as eager (calls.traced_arguments).
        self.traced = calls.traced_arguments(op, self.lowering)
        self.values, _ = schema.bind(self.oi, node.args, node.kwargs)
        if self.lowering.data_dependent_shape and self.lowering.shape_depends_on_values(
                fx.node.map_arg(self.values, _val)):
            raise NotImplementedError(
                f"torchtpu.compile: {op} has a data-dependent output shape; it cannot be part of "
                "a compiled graph (run it outside torch.compile)"
            )
        self.promote = None
        if self.lowering.promote == "common":
            self.promote = meta.common_dtype([_promotion_stand_in(v) for v in self.values])
        # One PRNG key per random draw, in graph order, like one per op call in eager.
        self.key_slots = []
        self.draws_key = bool(self.lowering.random) and self.lowering.draws_key(
            fx.node.map_arg(self.values, _val))
        for _ in range(int(self.draws_key) + int(self.oi.generator_index >= 0)):
            self.key_slots.append(len(key_slots))
            key_slots.append(node)
        self.check = checks.find(op) if _static(self.values) else None
        if _static(self.values):
            # What CPU's kernel refuses for these dtypes, as eager refuses it (eager/refusals.py).
            refusals.check(op, fx.node.map_arg(self.values, _val), [], self.traced,
                           read_values=False)

    def device_checks(self, env: dict) -> list:
        """(flag, error) for each check of data the op's check hands the device, on the graph's
        values; a check that fails on shapes alone raises now, at trace time."""
        found: list = []

        def arg(v):
            if isinstance(v, (list, tuple)):
                return [arg(x) for x in v] if any(isinstance(x, fx.Node) for x in v) else v
            if not isinstance(v, fx.Node):
                return v
            val = _val(v)
            return checks.Arg(tuple(val.shape), val.dtype, lambda: None,
                              lambda find, error: found.append((find(env[v]), error)))

        error = self.check(*(arg(v) for v in self.values))
        if error is not None:
            raise at_call.check_error(self.node.target, error)
        return found

    def run(self, env: dict, keys: tuple, scalars: list):
        node = self.node
        if node.target is operator.getitem:
            seq, i = node.args
            return env[seq][i]
        if self.graph_op is not None:
            args = fx.node.map_arg(node.args, env.__getitem__)
            kwargs = fx.node.map_arg(node.kwargs, env.__getitem__)
            return cast_outputs(self.graph_op(*args, **kwargs), self.dtypes)
        entries, dyn = self._split(env, keys, scalars)
        spec = Spec(tuple(entries), self.dtypes, self.dtypes, self.promote)
        args = rebuild(spec, self.lowering, tuple(dyn))
        return cast_outputs(self.lowering.fn(*args), spec.final)

    def _split(self, env: dict, keys: tuple, scalars: list):
        """Eager's split (``calls.entries_of``, ``dynamic_values``) over graph values."""
        entries, dyn = [], []
        if self.draws_key:
            # No Generator argument: a leading key from the default device generator, as in eager.
            entries.append((KEY, None))
            dyn.append(keys[self.key_slots[0]])
        elif self.lowering.random:
            entries.append((CONST, None))  # a call that draws no key gets None, as in eager
        oi = self.oi
        for i, v in enumerate(self.values):
            if isinstance(v, fx.Node) and _is_tensor_val(_val(v)):
                entries.append((TENSOR, None))
                dyn.append(env[v])
            elif isinstance(v, (list, tuple)) and any(
                isinstance(x, fx.Node) and _is_tensor_val(_val(x)) for x in v
            ):
                entries.append((TENSORS, tuple(x is None for x in v)))
                dyn.extend(env[x] for x in v if x is not None)
            elif i == oi.generator_index:
                entries.append((KEY, None))
                dyn.append(keys[self.key_slots[-1]])
            elif self._traces(i, v):
                entries.append((SCALAR, None))
                # A symbolic number is a plain value of the trace; a constant is a traced input.
                dyn.append(env[v] if isinstance(v, fx.Node) else scalars.pop(0))
            else:
                v = fx.node.map_arg(v, env.__getitem__)
                entries.append((CONST, tuple(v) if isinstance(v, list) else v))
        return entries, dyn

    def scalar_args(self) -> list:
        """The Python numbers this node passes as traced scalars, in order (eager traces them)."""
        if self.lowering is None:
            return []
        oi = self.oi
        return [v for i, v in enumerate(self.values)
                if i != oi.generator_index and not isinstance(v, fx.Node) and self._traces(i, v)]

    def _traces(self, i: int, v) -> bool:
        """Whether argument i is a traced number, as eager decides (``calls.entries_of``):
        a schema default or a special number (``x ** 2``) is baked in."""
        return i in self.traced and v is not None and (
            isinstance(v, fx.Node) or not meta.is_baked_number(v, self.oi.defaults[i]))


def _run_step(step, env: dict, keys: tuple, scalars: list):
    return step.run(env, keys, scalars)


def _static(values: list) -> bool:
    """Whether every node argument is a tensor of static shape (what a check can be given)."""
    for v in values:
        for x in (v if isinstance(v, (list, tuple)) else (v,)):
            if isinstance(x, fx.Node) and not (
                    _is_tensor_val(_val(x)) and all(type(n) is int for n in _val(x).shape)):
                return False
    return True


class GraphFunction:
    """An FX graph prepared for tracing: which placeholders are tensors, how many keys it draws."""

    def __init__(self, gm: fx.GraphModule) -> None:
        self.gm = gm
        graph = gm.graph
        self.placeholders = [n for n in graph.nodes if n.op == "placeholder"]
        self.tensor_inputs = [_is_tensor_val(_val(n)) for n in self.placeholders]
        # Tensor constants; a higher-order op's body (a submodule) is part of its step instead.
        self.constants = [n for n in graph.nodes if n.op == "get_attr"
                          and not isinstance(getattr(gm, n.target), torch.nn.Module)]
        self.key_nodes: list = []
        self.steps = [control_flow.higher_order_step(n, self.key_nodes, GraphFunction, _Step)
                      if control_flow.is_higher_order(n) else _Step(n, self.key_nodes)
                      for n in graph.nodes if n.op == "call_function"]
        self.scalars = [s for step in self.steps for s in step.scalar_args()]
        self.output = next(n for n in graph.nodes if n.op == "output").args[0]
        self.checked = [s for s in self.steps if getattr(s, "check", None) is not None]
        # (op, error) per flag ``run`` returns last; set when it is traced.
        self.check_errors: list = []
        # (position in the placeholders, copy_ node) for each input the graph mutates.
        self.mutations = [(self.placeholders.index(s.node.args[0]), s.node) for s in self.steps
                          if s.node.target is graph_forms.INPUT_WRITE
                          and s.node.args[0].op == "placeholder"]

    def run(self, arrays: tuple, constants: tuple, scalars: tuple, keys: tuple,
            symbols: tuple, plan: dynamic.Plan | None = None) -> list:
        """The graph's outputs from its tensor inputs (arrays) and non-tensor inputs (symbols).

        With a padding plan, arrays and symbols are at bucket sizes and the arrays end with the
        real size of each of the plan's symbols.
        """
        real = ()
        if plan is not None:
            split = len(arrays) - len(plan.order)
            arrays, real = arrays[:split], arrays[split:]
        env: dict[fx.Node, Any] = {}
        tensors_in, symbols_in = iter(arrays), iter(symbols)
        for n, is_tensor in zip(self.placeholders, self.tensor_inputs, strict=True):
            env[n] = next(tensors_in) if is_tensor else next(symbols_in)
        env.update(zip(self.constants, constants, strict=True))
        pending = list(scalars)
        run = _run_step
        if plan is not None:
            padding = masking.Padding(
                plan, buckets.sizes_of(self.placeholders, [env[n] for n in self.placeholders]),
                tuple(real))
            run = padding.run
        for step in self.steps:
            env[step.node] = run(step, env, keys, pending)
        outputs = [env[o] if isinstance(o, fx.Node) else o for o in self.output]
        found = [(step.node.target, *f) for step in self.checked for f in step.device_checks(env)]
        self.check_errors = [(op, error) for op, _, error in found]
        return outputs + [env[node] for _, node in self.mutations] + [f for _, f, _ in found]
