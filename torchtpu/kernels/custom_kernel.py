"""Unannotated JAX functions and bare Pallas kernels called on tpu tensors (the reference's
``custom_jax_kernel`` and ``custom_kernel``, ``torch.tpu.pallas``).

``jax_op`` needs a function's annotations to make its schema; kernel libraries (Tokamax, splash
attention) hand out JAX functions without them, and Pallas kernels write into output references
whose shapes only the caller knows. Here each distinct call layout (which arguments are tensors,
which are ``None``, the static arguments' values, the output shapes ``propagate`` gives) becomes
one ``jax_op`` over the tensor arguments alone, defined at its first call: from then on it runs
as any lowered op does (cached per shape, recorded by DeferAndFuse, lowered inside
``torch.compile`` graphs, differentiable through ``jax.vjp``). Results come back in the
function's own structure (a tensor, a tuple, nested tuples, a dict).
"""

from __future__ import annotations

import functools
import itertools
import re
import threading
from collections.abc import Callable, Sequence

import jax
import torch

from torchtpu import errors
from torchtpu.device import dtypes
from torchtpu.kernels.jax_op import define
from torchtpu.kernels.signature import Param, Signature

_NAMESPACE = "torch_tpu_kernels"
_count = itertools.count()


def _argument_error(text: str) -> TypeError:
    return TypeError(errors.message("argument", text))


class JaxKernel:
    """``fn`` callable with torch tensors (see the module doc)."""

    def __init__(self, fn: Callable, name: str, static_argnums: tuple,
                 donate_argnums: tuple = ()) -> None:
        self.fn = fn
        self.name = name
        self.static_argnums = frozenset(static_argnums)
        self.donate_argnums = frozenset(donate_argnums)
        self._ops: dict = {}
        self._lock = threading.Lock()

    def __repr__(self) -> str:
        return f"JaxKernel({self.name}, static_argnums={sorted(self.static_argnums)})"

    def _layout(self, args: tuple, kwargs: dict) -> tuple:
        layout = []
        for i, a in enumerate(args):
            if i in self.static_argnums:
                if isinstance(a, torch.Tensor):
                    raise _argument_error(f"{self.name}: argument {i} is in static_argnums but is "
                                          "a tensor; tensors cannot be static arguments")
                layout.append(("static", a))
            elif a is None:
                layout.append(("none",))
            elif isinstance(a, torch.Tensor):
                layout.append(("tensor",))
            else:
                raise _argument_error(
                    f"{self.name}: argument {i} is a {type(a).__name__}; a kernel takes tensors "
                    "and None, and anything else as a static argument (static_argnums) or "
                    "through functools.partial")
        return (tuple(layout), tuple(sorted(kwargs.items())))

    def __call__(self, *args, **kwargs):
        key = self._layout(args, kwargs)
        try:
            op, tree = self._ops[key]
        except KeyError:
            with self._lock:
                op, tree = self._ops.get(key) or self._define(key, args, kwargs)
                self._ops[key] = (op, tree)
        except TypeError:  # a static value that cannot be hashed: a key of its repr
            raise _argument_error(f"{self.name}: static arguments and keyword arguments must be "
                                  "hashable (they select the compiled program)") from None
        tensors = [a for a, slot in zip(args, key[0]) if slot == ("tensor",)]
        out = op(*tensors)
        return jax.tree_util.tree_unflatten(tree, list(out) if isinstance(out, tuple) else [out])

    def _define(self, key: tuple, args: tuple, kwargs: dict):
        layout = key[0]

        def whole(*tensors):
            supplied = iter(tensors)
            full = [slot[1] if slot[0] == "static" else None if slot[0] == "none"
                    else next(supplied) for slot in layout]
            return self.fn(*full, **kwargs)

        structs = [jax.ShapeDtypeStruct(tuple(a.shape), dtypes.to_jax(a.dtype))
                   for a, slot in zip(args, layout) if slot == ("tensor",)]
        leaves, tree = jax.tree_util.tree_flatten(jax.eval_shape(whole, *structs))
        if not leaves:
            raise _argument_error(f"{self.name}: the function returns no arrays")

        def flat(*tensors):
            out = jax.tree_util.tree_leaves(whole(*tensors))
            return out[0] if len(out) == 1 else tuple(out)

        tensor_at = [i for i, slot in enumerate(layout) if slot == ("tensor",)]
        params = tuple(Param(f"x{i}", "Tensor") for i in range(len(tensor_at)))
        sig = Signature(params, ("Tensor",) * len(leaves), single=len(leaves) == 1)
        donated = tuple(tensor_at.index(i) for i in self.donate_argnums if i in tensor_at)
        stem = re.sub(r"\W", "_", self.name) or "kernel"
        op = define(f"{_NAMESPACE}::{stem}_{next(_count)}", flat, sig, donated=donated)
        return op, tree


def custom_jax_kernel(jax_fn: Callable | None = None, name: str | None = None,
                      static_argnums: Sequence[int] | int = (), **jit_kwargs):
    """A JAX function (annotated or not) callable with torch tensors; ``static_argnums`` name
    the non-tensor arguments (compile-time constants, as ``jax.jit``'s). Of ``jax.jit``'s other
    options ``donate_argnums`` is taken. Usable as a decorator with or without arguments."""
    donate = jit_kwargs.pop("donate_argnums", ())
    if jit_kwargs:
        raise _argument_error(f"custom_jax_kernel: jax.jit option(s) {sorted(jit_kwargs)} are "
                              "not supported here (static_argnums and donate_argnums are)")
    statics = (static_argnums,) if isinstance(static_argnums, int) else tuple(static_argnums)
    donate = (donate,) if isinstance(donate, int) else tuple(donate)

    def decorator(fn: Callable) -> JaxKernel:
        return JaxKernel(fn, name or getattr(fn, "__name__", "kernel"), statics, donate)

    return decorator if jax_fn is None else decorator(jax_fn)


def custom_kernel(propagate: Callable, pallas_kernel: Callable | None = None, **pallas_kwargs):
    """A Pallas kernel callable with torch tensors: ``propagate(*args)`` gives tensors shaped as
    its outputs (``torch.empty_like(x)``, any device), ``pallas_kwargs`` go to
    ``pl.pallas_call`` (``grid``, ``in_specs``, ``out_specs``, ...)."""

    def decorator(kernel: Callable) -> Callable:
        name = pallas_kwargs.get("name") or getattr(kernel, "__name__", "kernel")
        by_outputs: dict = {}

        @functools.wraps(kernel)
        def call(*args, **kwargs):
            outs = propagate(*args, **kwargs)
            leaves, tree = torch.utils._pytree.tree_flatten(outs)
            shapes = tuple((tuple(t.shape), t.dtype) for t in leaves)
            runner = by_outputs.get((shapes, tree))
            if runner is None:
                from jax.experimental import pallas as pl

                out_shape = torch.utils._pytree.tree_unflatten(
                    [jax.ShapeDtypeStruct(s, dtypes.to_jax(d)) for s, d in shapes], tree)
                # Built inside the op's trace, where pallas_mode picks compiled or interpreted.
                def run(*arrays, out_shape=out_shape):
                    return pl.pallas_call(kernel, out_shape=out_shape, **pallas_kwargs)(*arrays)

                runner = by_outputs[(shapes, tree)] = JaxKernel(run, name, ())
            return runner(*args, **kwargs)

        return call

    return decorator if pallas_kernel is None else decorator(pallas_kernel)
