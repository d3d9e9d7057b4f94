"""``torchtpu.jax.to_jax``: a PyTorch module as a pure JAX function of its weights.

``fn, params = to_jax(module)``: ``params`` is a dict (a JAX pytree) of the module's parameters
and buffers by their state-dict names, and ``fn(params, *inputs)`` is the module's forward as
JAX operations, from the same lowering table ``torch.compile(backend="tpu")`` and
``torchtpu.export`` use. It composes with ``jax.jit``, ``jax.grad`` (gradients equal PyTorch's
autograd), ``jax.vmap`` (where the module works on one example) and optax. The opposite
direction, a JAX function as a torch op, is ``jax_op`` (``torchtpu.pallas``).

The module is traced once per input signature (shapes and dtypes) with ``torch.export`` on CPU;
the graph's outputs come back in the module's output structure, tuples, lists and dicts as they
are and other mappings (Hugging Face ``ModelOutput``) as dicts. A module that updates buffers
(BatchNorm in training mode) gives ``(outputs, new_buffers)``; a module that draws random numbers
(dropout in training mode) is refused.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping

import jax.numpy as jnp
import torch

import torchtpu_artifact as artifact
from torchtpu.device import dtypes
from torchtpu.export.program import JaxProgram, weight_array


def _as_jax_tree(tree):
    """A torch output structure with JAX leaves, as containers JAX's pytrees know."""
    if isinstance(tree, tuple) and not hasattr(tree, "_fields"):
        return tuple(_as_jax_tree(v) for v in tree)
    if isinstance(tree, list):
        return [_as_jax_tree(v) for v in tree]
    if isinstance(tree, Mapping):
        return {k: _as_jax_tree(v) for k, v in tree.items()}
    return tree


class _Traced:
    """The module traced for one input signature: its program and how to call it."""

    def __init__(self, module: torch.nn.Module, inputs: tuple) -> None:
        examples = tuple(torch.zeros(tuple(x.shape), dtype=dtypes.to_torch(x.dtype))
                         for x in inputs)
        self.program = JaxProgram(torch.export.export(module, examples))
        weights = self.program.weights()
        # Lifted constants are not the module's parameters or buffers: they stay as traced.
        self.constants = {s.name: jnp.asarray(weights[s.name]) for s in self.program.inputs
                          if s.kind == "constant_tensor"}
        self.out_spec = self.program.ep.call_spec.out_spec

    def __call__(self, params: dict, inputs: tuple, aliases: dict, buffers: dict):
        given = iter(inputs)
        args = []
        for slot in self.program.inputs:
            if slot.kind == artifact.USER_INPUT:
                args.append(next(given))
            elif slot.name in self.constants:
                args.append(self.constants[slot.name])
            elif aliases.get(slot.name, slot.name) in params:
                args.append(params[aliases.get(slot.name, slot.name)])
            elif slot.kind == "buffer" and slot.name in buffers:
                args.append(buffers[slot.name])
            else:
                raise KeyError(f"torchtpu.argument: params has no {slot.name!r} (the "
                               f"module's {slot.kind}); pass the dict to_jax returned, or "
                               "the part of it that holds every parameter")
        outs = iter(self.program(*args))
        values = [next(outs) if k in self.program.kept else None
                  for k in range(len(self.program.ep.graph_signature.output_specs))]
        updated, user = {}, []
        for spec, value in zip(self.program.ep.graph_signature.output_specs, values,
                               strict=True):
            if spec.kind.name.lower() == artifact.BUFFER_MUTATION:
                updated[spec.target] = value
            else:
                user.append(value)
        result = _as_jax_tree(self.out_spec.unflatten(user))
        return (result, updated) if updated else result


def to_jax(module: torch.nn.Module) -> tuple[Callable, dict]:
    """(fn, params): fn(params, *inputs) runs module's forward on JAX arrays; params holds its
    parameters and buffers as JAX arrays, by state-dict name. params given to fn may leave the
    buffers out (to take gradients over the parameters alone): then their values here are used."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"torchtpu.argument: to_jax takes a torch.nn.Module, got "
                        f"{type(module).__name__}")
    named = {**dict(module.named_parameters()), **dict(module.named_buffers())}
    params = {name: jnp.asarray(weight_array(t)) for name, t in named.items()}
    # A tied weight (one tensor under two names) is in params once, under its first name.
    first = {id(t): name for name, t in named.items()}
    aliases = {name: first[id(t)] for name, t in [
        *module.named_parameters(remove_duplicate=False),
        *module.named_buffers(remove_duplicate=False)]}
    buffers = {name: params[name] for name, _ in module.named_buffers()}
    traced: dict[tuple, _Traced] = {}

    def fn(params: dict, *inputs):
        inputs = tuple(x if hasattr(x, "shape") else jnp.asarray(x) for x in inputs)
        key = tuple((tuple(x.shape), str(x.dtype)) for x in inputs)
        if key not in traced:
            traced[key] = _Traced(module, inputs)
        return traced[key](params, inputs, aliases, buffers)

    fn.__name__ = f"{type(module).__name__}_as_jax"
    return fn, params


__all__ = ["to_jax"]
