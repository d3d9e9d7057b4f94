"""The host-only cones of a compiled graph: mutated CPU inputs (an optimizer's step counts) whose
new values come from CPU tensors alone. PyTorch computes those on the host, so the compiled
graph evaluates them there and writes them back without waiting for its program. And the CPU
inputs a graph only moves to the device (``moved_in``), sent as it is called."""

from __future__ import annotations

import operator

import torch
import torch.fx as fx

from torchtpu.compile.graph_function import GraphFunction


def on_cpu(n) -> bool:
    """Whether node n's value is a CPU tensor, or a list of them (a foreach op's)."""
    v = n.meta.get("val")
    values = v if isinstance(v, (list, tuple)) and v else [v]
    return all(isinstance(x, torch.Tensor) and x.device.type == "cpu" for x in values)


def moved_in(fn: GraphFunction) -> frozenset:
    """The positions of the CPU tensor inputs that the graph only moves to the device (the
    user's ``x.to("tpu")`` inside a compiled function, whose CPU tensor Dynamo hands in):
    every use a copy whose result is on the device."""
    def sent(u) -> bool:
        v = u.meta.get("val")
        return (u.op == "call_function" and u.target is torch.ops.aten._to_copy.default
                and isinstance(v, torch.Tensor) and v.device.type != "cpu")

    return frozenset(k for k, n in enumerate(fn.placeholders)
                     if n.users and on_cpu(n) and all(sent(u) for u in n.users))


def of(fn: GraphFunction) -> dict:
    """{mutation index: its new value's node} for the mutated CPU inputs (an optimizer's step
    counts) whose new value comes from CPU tensors alone: PyTorch computes those on the host,
    so writing them back does not wait for the program to finish."""
    def host_only(n) -> bool:
        if n.op == "placeholder":
            return on_cpu(n)
        target = n.target
        deterministic = target is operator.getitem or (
            isinstance(target, torch._ops.OpOverload)
            and torch.Tag.nondeterministic_seeded not in target.tags)
        return (n.op == "call_function" and deterministic and on_cpu(n)
                and all(host_only(a) for a in n.all_input_nodes))

    return {k: node.args[1] for k, (i, node) in enumerate(fn.mutations)
            if on_cpu(fn.placeholders[i]) and host_only(node.args[1])}


def value(n, env: dict):
    """Node n evaluated with PyTorch on the CPU tensors env gives its placeholders."""
    if n not in env:
        args = fx.node.map_arg(n.args, lambda a: value(a, env))
        kwargs = fx.node.map_arg(n.kwargs, lambda a: value(a, env))
        env[n] = n.target(*args, **kwargs)
    return env[n]
