"""``jax_op``: a JAX (or Pallas) function as a ``torch.library`` custom op on tpu tensors.

The function becomes the op's entry in the one lowering table (``lowering/registry.py``), so it
runs like any ATen op: Strict and Debug run it as a cached program, DeferAndFuse records it into
the pending program (no flush), and ``torch.compile`` lowers it inside the graph's own XLA
program. Nothing here runs arrays itself; the op's PrivateUse1 kernel is the executors' entry
(``eager/dispatch.py``).

- Schema: from the annotations (``signature.py``); non-tensor arguments are static (baked into
  the program, as ``jax.jit``'s static arguments), tensors are traced.
- Fake kernel: ``jax.eval_shape`` of the function; ``.register_fake`` overrides it. When the
  function is traced, its results are checked against the fake kernel's (shapes and dtypes), so
  a fake kernel that disagrees is an error naming the op, not a silently wrong tensor.
- Autograd: by default a backward op ``<name>_vjp`` derived with ``jax.vjp`` (it recomputes the
  forward inside the backward program; the gradient flows to floating-point tensor arguments).
  ``.register_autograd(backward, setup_context=...)`` replaces it, typically with a backward
  that calls a second ``jax_op``.
- Pallas: the function is traced under ``pallas_mode.interpreting()``: kernels compile on TPU and
  are interpreted elsewhere, unedited.
- ``mesh`` with ``input_partition_specs`` (one per tensor parameter) and
  ``output_partition_specs`` (one per result) runs the function under ``jax.shard_map`` over
  that mesh: each call sees its shard. On one device every shard is the whole array, so the
  result is the function's own; the specs are still checked against the function's arity.
- ``donate_argnums``: positions of tensor parameters whose buffers the call takes, as
  ``jax.jit``'s: the tensors are consumed, and refused when anything else could see their
  buffers (``donation.py``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
import torch
from torch._subclasses.fake_tensor import unset_fake_temporarily

from torchtpu import errors
from torchtpu.cache import warm_keys
from torchtpu.device import dtypes
from torchtpu.eager import dispatch, meta
from torchtpu.kernels import donation, pallas_mode, signature
from torchtpu.kernels.signature import Param, Signature
from torchtpu.lowering.registry import lowers

CustomOpDef = torch._library.custom_ops.CustomOpDef

_libraries: list = []  # the PrivateUse1 registrations live as long as the process


def jax_op(name: str, fn: Callable, *, donate_argnums: Sequence[int] | int | None = None,
           mesh: jax.sharding.Mesh | None = None, input_partition_specs: Sequence | None = None,
           output_partition_specs=None) -> CustomOpDef:
    """Turn the annotated JAX function ``fn`` into the custom op ``name`` ("namespace::op")."""
    sig = signature.from_function(name, fn)
    donated = _donated(name, sig, donate_argnums)
    if mesh is not None or input_partition_specs is not None or output_partition_specs is not None:
        fn = _sharded(name, fn, sig, mesh, input_partition_specs, output_partition_specs)
    return define(name, fn, sig, donated=donated)


def define(name: str, fn: Callable, sig: Signature, differentiable: bool = True,
           donated: tuple = ()) -> CustomOpDef:
    """The custom op ``name`` computing ``fn`` with schema ``sig`` (see the module doc)."""
    ns, opname = _split(name)
    if hasattr(getattr(torch.ops, ns), opname):
        raise ValueError(errors.message(
            "kernel", f"jax_op {name!r}: an op of that name already exists; choose another "
            "name (op names are global to the process)"))
    opdef = torch.library.custom_op(name, _off_device(name), mutates_args=(),
                                    schema=sig.schema())
    op = getattr(getattr(torch.ops, ns), opname).default
    opdef.register_fake(_fake(name, fn, sig))
    _forgets_on_register_fake(opdef, op)
    lowers(op, donates=donated)(_lowering(name, op, fn, sig))
    lib = torch.library.Library(ns, "IMPL")
    lib.impl(opname, functools.partial(_kernel, name, op, donated), "PrivateUse1")
    _libraries.append(lib)
    if differentiable:
        backward = define(f"{name}_vjp", _vjp(name, fn, sig), _vjp_signature(sig),
                          differentiable=False)
        _register_default_autograd(name, opdef, backward, sig, donated)
    return opdef


def _forgets_on_register_fake(opdef: CustomOpDef, op) -> None:
    """A fake kernel registered again describes op's results anew: what torchtpu kept of the
    old one's descriptions (plans, remembered signatures) goes with it, or a call after it
    would be described by the old kernel."""
    register = opdef.register_fake

    @functools.wraps(register)
    def register_fake(fn, /, *args, **kwargs):
        out = register(fn, *args, **kwargs)
        dispatch.forget(op)
        return out

    opdef.register_fake = register_fake


def _split(name: str) -> tuple[str, str]:
    ns, sep, opname = name.partition("::")
    if not sep or not ns.isidentifier() or not opname.isidentifier():
        raise ValueError(errors.message(
            "kernel", f"jax_op name {name!r} must be 'namespace::op_name' (identifiers)"))
    return ns, opname


def _donated(name: str, sig: Signature, donate_argnums) -> tuple:
    if donate_argnums is None:
        return ()
    positions = (donate_argnums,) if isinstance(donate_argnums, int) else tuple(donate_argnums)
    for i in positions:
        if not (isinstance(i, int) and 0 <= i < len(sig.params) and sig.params[i].is_tensor):
            raise ValueError(errors.message(
                "kernel", f"jax_op {name!r}: donate_argnums entry {i!r} is not the position "
                f"of a jax.Array parameter (parameters: "
                f"{', '.join(p.name for p in sig.params)})"))
    return tuple(sorted(set(positions)))


def _off_device(name: str) -> Callable:
    def run(*args, **kwargs):
        where = {a.device.type for a in (*args, *kwargs.values()) if isinstance(a, torch.Tensor)}
        raise RuntimeError(errors.message(
            "kernel", f"jax_op {name!r} runs on tpu tensors, but got tensors on "
            f"{', '.join(sorted(where)) or 'no device'}; move them with .to('tpu')"))

    return run


def _kernel(name: str, op, donated: tuple, *args, **kwargs):
    """The op's PrivateUse1 kernel: the executors' entry, with lowering failures explained."""
    consumed = donation.check(name, op, donated, args, kwargs)
    try:
        out = dispatch.kernel(op, *args, **kwargs)
    except Exception as e:
        hint = pallas_mode.lowering_hint(f"jax_op {name!r}", e)
        if hint is None:
            raise
        raise RuntimeError(errors.message("kernel", hint)) from e
    donation.consume(name, consumed)
    return out


def _as_declared(sig: Signature, args: tuple) -> list:
    """Schema values as the function declared them: lists (``int[]``, ``Tensor[]``) as tuples."""
    return [tuple(a) if isinstance(a, list) else a for a in args]


def _call(name: str, fn: Callable, sig: Signature, args) -> object:
    with pallas_mode.interpreting(f"jax_op {name!r}"):
        return fn(*_as_declared(sig, args))


def _leaves(out) -> list:
    return list(out) if isinstance(out, (tuple, list)) else [out]


# ----------------------------------------------------------------------------- fake kernel

def _fake(name: str, fn: Callable, sig: Signature) -> Callable:
    def fake(*args):
        like = next(a for a in _flat(args) if isinstance(a, torch.Tensor))
        structs = [_struct(a) for a in args]
        # The function is traced by JAX, outside the fake mode that calls this: a function that
        # makes torch tensors of its own (Helion's jax_fn does) must not get fake ones.
        with unset_fake_temporarily():
            out = jax.eval_shape(lambda *xs: _call(name, fn, sig, xs), *structs)
        made = [like.new_empty(o.shape, dtype=dtypes.to_torch(o.dtype)) for o in _leaves(out)]
        return made[0] if sig.single and sig.returns[0] == "Tensor" else (
            made if sig.returns[0] == "Tensor[]" else tuple(made))

    setattr(fake, meta.DERIVED_FAKE, True)
    return fake


def _flat(args) -> list:
    flat = []
    for a in args:
        flat.extend(a if isinstance(a, (list, tuple)) else [a])
    return flat


def _struct(a):
    if isinstance(a, torch.Tensor):
        return jax.ShapeDtypeStruct(tuple(a.shape), dtypes.to_jax(a.dtype))
    if isinstance(a, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in a):
        return [_struct(x) for x in a]
    return _Static(a)


class _Static:
    """A non-tensor argument carried through ``jax.eval_shape`` untraced (no pytree leaves)."""

    def __init__(self, value) -> None:
        self.value = value


jax.tree_util.register_pytree_node(_Static, lambda s: ((), s.value), lambda v, _: v)


# ----------------------------------------------------------------------------- lowering

def _lowering(name: str, op, fn: Callable, sig: Signature) -> Callable:
    def lowering(*args):
        out = _call(name, fn, sig, args)
        _check_against_fake(name, op, args, out)
        return list(out) if sig.returns[0] == "Tensor[]" else out

    lowering.__name__ = name.replace("::", "_")
    # Known in keys by what it computes: a module-level fn (torchtpu's own ops, the
    # checkpoints' optimization barrier among them) keeps the programs reading it keyed, so a
    # new process loads them (a DeferAndFuse recording holding one was traced in every
    # process); a closure's stays out of warm starts (``warm_keys.canonical`` refuses it).
    return warm_keys.named(lowering, "jax_op", name, fn, sig.returns[0])


def _meta_like(a):
    if a is None or not hasattr(a, "shape"):
        return [_meta_like(x) for x in a] if isinstance(a, (list, tuple)) else a
    return torch.empty(tuple(a.shape), dtype=dtypes.to_torch(a.dtype), device="meta")


def _check_against_fake(name: str, op, args: tuple, out) -> None:
    """At trace time: the function's results must be what the op's fake kernel promised."""
    expected = _leaves(op(*[_meta_like(a) for a in args]))
    got = _leaves(out)
    problem = None
    if len(got) != len(expected):
        problem = f"returned {len(got)} result(s) but its fake kernel {len(expected)}"
    else:
        for i, (g, e) in enumerate(zip(got, expected)):
            want = (tuple(e.shape), dtypes.to_jax(e.dtype))
            if not hasattr(g, "shape") or (tuple(g.shape), np.dtype(g.dtype)) != want:
                have = f"{np.dtype(g.dtype).name}{list(g.shape)}" if hasattr(g, "shape") \
                    else repr(type(g).__name__)
                problem = (f"result {i} is {have} but its fake kernel says "
                           f"{want[1].name}{list(want[0])}")
                break
    if problem is not None:
        raise ValueError(errors.message(
            "kernel", f"jax_op {name!r}: the function {problem}; make the function and the "
            "kernel given to register_fake agree (the fake kernel must return "
            "tensors of exactly the shapes and dtypes the function returns)"))


# ----------------------------------------------------------------------------- default backward

def _differentiable(a) -> bool:
    if isinstance(a, torch.Tensor):
        return a.dtype.is_floating_point or a.dtype.is_complex
    return a is not None and hasattr(a, "dtype") and jnp.issubdtype(a.dtype, jnp.inexact)


def _vjp_signature(sig: Signature) -> Signature:
    params = tuple(Param(p.name, p.type) for p in sig.params)
    return Signature((*params, Param("cotangents", "Tensor[]")), ("Tensor[]",), True)


def _vjp(name: str, fn: Callable, sig: Signature) -> Callable:
    """(inputs..., cotangents) -> gradients of the differentiable tensor inputs, by jax.vjp."""

    def backward(*args):
        *primal, cotangents = args
        diff = [i for i in sig.tensor_positions if _differentiable(primal[i])]

        def forward(*xs):
            full = list(primal)
            for i, x in zip(diff, xs):
                full[i] = x
            return fn(*full)

        try:
            out, pullback = jax.vjp(forward, *[primal[i] for i in diff])
        except (ValueError, NotImplementedError, TypeError) as e:
            # A bare pallas_call has no reverse-mode rule; JAX's error does not say which op.
            raise type(e)(errors.message(
                "kernel", f"jax_op {name!r}: JAX cannot differentiate its function ({e}); "
                "give it a backward with .register_autograd(backward, setup_context=...) or "
                "wrap the kernel in jax.custom_vjp")) from e
        cts = [ct if jnp.issubdtype(o.dtype, jnp.inexact) else np.zeros(o.shape, jax.dtypes.float0)
               for o, ct in zip(_leaves(out), cotangents)]
        return list(pullback(cts[0] if sig.single else tuple(cts)))

    return backward


def _register_default_autograd(name: str, opdef: CustomOpDef, backward_op: CustomOpDef,
                               sig: Signature, donated: tuple) -> None:
    def setup_context(ctx, inputs, output):
        taken = [sig.params[i].name for i in donated if isinstance(inputs[i], torch.Tensor)]
        if taken:
            # Raised here, at the call, rather than in backward, where the input would be read.
            raise RuntimeError(errors.message(
                "kernel", f"jax_op {name!r}: gradients flow through this call, and its derived "
                f"backward (jax.vjp) recomputes it from every input, but {', '.join(taken)} "
                "was donated (donate_argnums) and holds no value; give the op a backward that "
                "does not need it (.register_autograd), or do not donate where gradients flow"))
        tensor_at = [i for i, a in enumerate(inputs) if isinstance(a, torch.Tensor)]
        ctx.save_for_backward(*[inputs[i] for i in tensor_at])
        ctx.tensor_at = tensor_at
        ctx.others = [None if isinstance(a, torch.Tensor) else a for a in inputs]
        ctx.outputs = [(o.shape, o.dtype, o.device) for o in _leaves(output)]

    def backward(ctx, *grads):
        inputs = list(ctx.others)
        for i, t in zip(ctx.tensor_at, ctx.saved_tensors):
            inputs[i] = t
        cts = [g if g is not None else torch.zeros(s, dtype=d, device=dev)
               for g, (s, d, dev) in zip(grads, ctx.outputs)]
        computed = iter(backward_op(*inputs, cts))
        return tuple(next(computed) if i in sig.tensor_positions and _differentiable(a) else None
                     for i, a in enumerate(inputs))

    opdef.register_autograd(backward, setup_context=setup_context)


# ----------------------------------------------------------------------------- mesh

def _sharded(name: str, fn: Callable, sig: Signature, mesh, in_specs, out_specs) -> Callable:
    if mesh is None or in_specs is None or out_specs is None:
        raise ValueError(errors.message(
            "kernel", f"jax_op {name!r}: mesh, input_partition_specs and "
            "output_partition_specs go together; give all three or none"))
    positions = sig.tensor_positions
    in_specs = tuple(in_specs)
    if len(in_specs) != len(positions):
        raise ValueError(errors.message(
            "kernel", f"jax_op {name!r}: input_partition_specs has {len(in_specs)} entries; "
            f"give one per jax.Array parameter ({len(positions)})"))
    n_out = len(sig.returns)
    if not sig.single and (not isinstance(out_specs, (tuple, list)) or len(out_specs) != n_out):
        raise ValueError(errors.message(
            "kernel", f"jax_op {name!r}: output_partition_specs must be a tuple of {n_out} "
            "specs, one per result"))
    out_specs = tuple(out_specs) if not sig.single else out_specs

    @functools.wraps(fn)
    def sharded(*args):
        present = [(i, s) for i, s in zip(positions, in_specs) if args[i] is not None]

        def body(*xs):
            full = list(args)
            for (i, _), x in zip(present, xs):
                full[i] = x
            return fn(*full)

        return jax.shard_map(body, mesh=mesh, in_specs=tuple(s for _, s in present),
                             out_specs=out_specs)(*[args[i] for i, _ in present])

    return sharded
