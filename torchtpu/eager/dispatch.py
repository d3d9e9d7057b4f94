"""The PrivateUse1 entry point: every ATen op on a tpu tensor without a device kernel lands here.

For each op overload a handler is chosen once:
- it has a lowering: run it through the current executor;
- it is an in-place or ``out=`` overload whose functional twin has a lowering: compute the twin,
  write the results into the written arguments;
- PyTorch has a decomposition for it: run that (its pieces dispatch back here);
- otherwise: the CPU fallback, counted and reported (or an error, if so configured).

PyTorch's meta kernels give every result's shape and dtype, so type promotion, broadcasting and
shape errors are exactly PyTorch's; results are cached per input signature.
"""

from __future__ import annotations

import functools
import threading

import numpy as np
import torch
from torch._decomp import decomposition_table

from torchtpu import errors, metrics
from torchtpu.device import dtypes, kernels, launch, overlap, tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.device.random import key_data_for
from torchtpu.eager import at_call, executor, fallback, meta, refusals, results, schema, seen_calls
from torchtpu.eager.lazy_casts import computed
from torchtpu.eager.program import CONST, KEY, SCALAR, TENSOR, TENSORS, Spec, with_views
from torchtpu.eager.seen_calls import signature
from torchtpu.lowering.registry import META_STRIDES, Lowering, lookup
from torchtpu.runtime import platform

OpOverload = torch._ops.OpOverload


# ----------------------------------------------------------------------------- running lowerings

@functools.cache
def traced_arguments(op: OpOverload, lowering: Lowering) -> frozenset:
    """Argument positions whose Python numbers the program takes as inputs (not constants)."""
    oi = schema.info(op)
    return frozenset(
        i for i, name in enumerate(oi.names)
        if i != oi.generator_index and (
            (i in oi.scalar_indices and not lowering.static_scalars) or name in lowering.traced)
    )


def entries_of(oi: schema.OpInfo, values: list, lowering: Lowering) -> tuple:
    """The static spec entries for bound arguments (what is traced, what is baked in)."""
    entries = []
    for i, v in enumerate(values):
        if isinstance(v, torch.Tensor):
            entries.append((TENSOR if not v.is_cpu else SCALAR, None))
        elif isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
            entries.append((TENSORS, tuple(x is None for x in v)))
        elif i == oi.generator_index:
            entries.append((KEY, None))
        elif (v is not None and i in traced_arguments(oi.op, lowering)
              # A number at its schema default (add's alpha=1) is baked in: passing a Python
              # number to a program costs a transfer per call. So is a special number (x ** 2):
              # XLA computes with it differently from any other value.
              and not meta.is_baked_number(v, oi.defaults[i])):
            entries.append((SCALAR, None))
        else:
            entries.append((CONST, tuple(v) if isinstance(v, list) else v))
    return tuple(entries)


_WIDE = (torch.float64, torch.complex128)


def _number(v, values: list):
    """A traced Python number as its program takes it. A complex one would enter as complex128
    (x64 is on), which a TPU cannot compute (libtpu ends the process on it); where no device
    tensor of the call is float64 or complex128, torch computes the number as complex64
    anyway (``2j * w`` of a complex64 ``w``), so it enters as that."""
    if isinstance(v, complex) and not any(
            isinstance(x, torch.Tensor) and not x.is_cpu and x.dtype in _WIDE for x in values):
        return np.complex64(v)
    return v


def dynamic_values(values: list, entries: tuple, fold: bool = True) -> tuple[tuple, tuple]:
    """The traced values of bound arguments, in the order the spec consumes them, and the views
    among them (``program.with_views``): a view's storage array goes to the program, which
    reads the view itself rather than a program call of its own doing it first; so does a lazy
    cast's source (``lazy_casts``), which the program converts, unless ``fold`` is False."""
    dyn, views = [], []
    for i, ((kind, _), v) in enumerate(zip(entries, values)):
        if kind == TENSOR:
            array, g = tensors.read_parts(v, fold)
            dyn.append(array)
            if g is not None:
                views.append((i, None, g))
        elif kind == SCALAR:
            dyn.append(_number(v.item() if isinstance(v, torch.Tensor) else v, values))
        elif kind == TENSORS:
            for j, x in enumerate(v):
                if x is None:
                    continue
                if not x.is_cpu:
                    array, g = tensors.read_parts(x, fold)
                    dyn.append(array)
                    if g is not None:
                        views.append((i, j, g))
                elif x.dim() == 0:
                    # A CPU scalar tensor in a list (``_foreach_mul(ts, cpu_scalars)``) is allowed,
                    # as alone; a NumPy scalar, which the program call transfers.
                    dyn.append(np.asarray(x.item(), dtypes.to_jax(x.dtype)))
                else:
                    raise meta.device_error(x)
        elif kind == KEY:
            dyn.append(key_data_for(v))
    return tuple(dyn), tuple(views)


# Per-op state lives on the OpOverload itself: hashing one runs Python code (~1 us), an
# attribute read does not. ``_PLANS``: (its plans by call key, its traced argument positions).
_HANDLER, _PLANS = "_torchtpu_handler", "_torchtpu_plans"


def _compute_dtype(described: tuple) -> np.dtype:
    # Checked before the program compiles: libtpu ends the process on a complex128 one.
    if described[1] is torch.complex128:
        dtypes.check_platform(described[1])
    return dtypes.to_jax(described[1])


def plan(op: OpOverload, lowering: Lowering, oi: schema.OpInfo, values: list,
         final: tuple | None = None, known_key: tuple | None = None) -> tuple:
    """(result shapes/dtypes, program spec) for one call, cached by its call key
    (``known_key``, where the caller has it: ``meta.call_key`` with op's traced arguments)."""
    plans = op.__dict__.get(_PLANS)
    if plans is None:
        plans = ({}, traced_arguments(op, lowering))
        setattr(op, _PLANS, plans)
    cache, traced = plans
    key = (meta.call_key(oi, values, traced) if known_key is None else known_key, final)
    hit = cache.get(key)
    if hit is None:
        result = meta.infer(op, values, traced=traced,
                            strides=lowering.layout is META_STRIDES)
        if callable(lowering.layout):
            result = results.laid_out(result, lowering.layout(*values))
        compute_dtypes = results.map_described(result, _compute_dtype)
        promote = meta.common_dtype(values) if lowering.promote == "common" else None
        entries = entries_of(oi, values, lowering)
        if lowering.random:
            # No Generator argument: a leading key from the default device generator, or None
            # for a call that draws none.
            entries = ((KEY if lowering.draws_key(values) else CONST, None), *entries)
        spec = Spec(entries, compute_dtypes, compute_dtypes if final is None else final, promote)
        hit = (result, spec)
        meta.bounded_put(cache, key, hit)
    return hit


def compute(lowering: Lowering, spec: Spec, values: list, writes: bool = False):
    """Run lowering on bound values through the current executor; returns arrays."""
    padded_inputs = HOOKS.padded_inputs
    if padded_inputs is not None:
        out = padded_inputs(lowering, spec, values, writes)
        if out is not None:
            return out
    # A donated argument's buffer must be its own: a lazy cast's source is another's.
    dyn, views = dynamic_values([None, *values] if lowering.random else values, spec.entries,
                                not lowering.donates)
    growing = HOOKS.growing
    if growing is not None:
        out = growing(lowering, spec, values, dyn, views, writes)
        if out is not None:
            return dedupe(out, dyn)
    if views:
        spec = with_views(spec, views)
    return dedupe(executor.current().run(lowering, spec, dyn), dyn)


def _run_seen(lowering: Lowering, kept: seen_calls.Seen, values: list, dyn: tuple):
    """``compute`` of a call on ``seen_calls``' short path (its arrays read already): the same
    hooks and executor, and the executor's ``launcher`` for the call's spec, found once per
    remembered call and executor, where its ``run`` would only launch the program."""
    padded_inputs = HOOKS.padded_inputs
    if padded_inputs is not None:
        out = padded_inputs(lowering, kept.spec, values, False)
        if out is not None:
            return out
    growing = HOOKS.growing
    if growing is not None:
        out = growing(lowering, kept.spec, values, dyn, kept.views, False)
        if out is not None:
            return dedupe(out, dyn)
    current = executor.current()
    launcher = kept.launcher
    if launcher is None or launcher[0] is not current:
        launcher = kept.launcher = (current, current.launcher(lowering, kept.viewed))
    fn = launcher[1]
    if fn is None:
        return dedupe(current.run(lowering, kept.viewed, dyn), dyn)
    metrics.count("executions")
    out = launch.run(lowering.op, fn, dyn)
    for x in dyn:  # ``dedupe``'s test, inline: a program may hand an input back
        if out is x:
            return tensors.fresh_copy(out)
    return out


def dedupe(out, inputs):
    """A program may hand an input array back as an output; storages never share a buffer."""
    if isinstance(out, (tuple, list)):
        return _dedupe_all(out, {id(x) for x in inputs})  # foreach ops: many of each
    if out is not None:
        for x in inputs:
            if out is x:
                return tensors.fresh_copy(out)
    return out


def _dedupe_all(out, ids: set):
    if isinstance(out, (tuple, list)):
        return type(out)([_dedupe_all(o, ids) if isinstance(o, (tuple, list)) or id(o) in ids
                          else o for o in out])
    return tensors.fresh_copy(out) if out is not None and id(out) in ids else out


def _functional_handler(op: OpOverload, lowering: Lowering):
    oi = schema.info(op)
    returns_list = len(op._schema.returns) == 1 and str(op._schema.returns[0].type) == "Tensor[]"

    seen: dict = {}  # signature -> [seen_calls.Seen]
    repeatable = not lowering.random  # a random call's key entry depends on its values

    def handle(args, kwargs):
        values, _ = schema.bind(oi, args, kwargs)
        if lowering.data_dependent_shape and lowering.shape_depends_on_values(values):
            return compute_unknown_shape(lowering, oi, values)
        hit = key = None
        if repeatable and HOOKS.capture is None:
            try:
                key = signature(values)
                hit = seen.get(key)
            except TypeError:  # an unhashable constant: the full path
                hit, key = False, None
            if hit:
                found = seen_calls.read(values, hit)
                if found is not None:
                    kept, dyn = found
                    out = _run_seen(lowering, kept, values, dyn)
                    wrap = kept.wrap
                    if wrap is None:
                        wrap = kept.wrap = results.wrapper(kept.result)
                    out = None if out is None else wrap(out)
                    return list(out) if returns_list else out
        result, spec = plan(op, lowering, oi, values)
        # A signature does not tell layouts apart: a contiguous call must not take a
        # channels-last call's result format. One read another way than the signature's
        # remembered calls (a view where they read whole arrays) is kept beside them.
        reads = None if hit is False or key is None or results.formatted(result) \
            else seen_calls.reads_of(spec, values)
        out = results.wrapped(compute(lowering, spec, values), result)
        if reads is not None:
            seen_calls.remember(seen, key, reads, result, spec)
        return list(out) if returns_list else out

    return handle


def compute_unknown_shape(lowering: Lowering, oi: schema.OpInfo, values: list):
    """Run a call whose result shape depends on values, on concrete arrays."""
    refusals.check(oi.op, values)
    spec = Spec(entries_of(oi, values, lowering), None, None, None)
    dyn, views = dynamic_values(values, spec.entries)
    if views:
        spec = with_views(spec, views)
    out = dedupe(executor.current().run_concrete(lowering, spec, dyn), dyn)
    # No meta kernel gives these results' dtypes: each is its array's, but complex32 values
    # compute as complex64 (``device/dtypes.py``), so those of a complex32 call are complex32.
    half = any(isinstance(v, torch.Tensor) and v.dtype is torch.complex32 for v in values)

    def wrap(o):
        return tensors.wrap(o, torch.complex32 if half and o.dtype == np.complex64 else None)

    if isinstance(out, (tuple, list)):
        return tuple(wrap(o) for o in out)
    return wrap(out)


def _flat_targets(values, oi, outs):
    targets = outs if outs else [values[i] for i in oi.written]
    flat = []
    for t in targets:
        flat.extend(t if isinstance(t, (list, tuple)) else [t])
    return targets, flat


def _resize_out(t: torch.Tensor, shape) -> None:
    if tuple(t.shape) != tuple(shape):
        t.resize_(shape)


def _mutating_handler(op: OpOverload, functional: OpOverload, compute_functional,
                      traced: frozenset = frozenset(), lowering: Lowering | None = None):
    """In-place and out= overloads: compute the functional twin, write into the targets.

    ``traced``: the twin's traced number arguments (same positions: the signatures match).
    ``lowering``: the twin's, where its result shape may depend on values (no meta kernel then).
    """
    oi = schema.info(op)
    foi = schema.info(functional)
    # The twins' call keys of one call are equal when their schemas' defaults are: made once
    # for both (an optimizer's foreach call keys ~4 lists of a tensor a parameter).
    shared = (oi.defaults, oi.generator_index) == (foi.defaults, foi.generator_index)

    def handle(args, kwargs):
        values, outs = schema.bind(oi, args, kwargs)
        if outs and lowering is not None and lowering.shape_depends_on_values(values):
            return _write_computed(op, oi, values, outs,
                                   compute_unknown_shape(lowering, foi, values))
        key = meta.call_key(oi, values, traced) if shared else None
        # The mutating op's own meta kernel checks what PyTorch checks (shapes, castability)
        # and says what shape each out= argument must take.
        validated = meta.infer(op, values, outs, traced, known_key=key)
        targets, flat = _flat_targets(values, oi, outs)
        overlap.check_internal(flat, op)
        if outs:
            shapes = [d[0] for d in _leaves(validated)]
            for t, s in zip(flat, shapes):
                if not meta.is_device(t):
                    raise meta.device_error(t)
                _resize_out(t, s)
        overlap.check_between(op, flat, schema.read(oi, values, overlap.read_first(op)))
        arrays = compute_functional(foi, values, [t.dtype for t in flat], key)
        for t, a in zip(flat, schema.flatten(arrays)):
            tensors.write(t, kernels.convert(a, t))
        return schema.returns(op, targets)

    return handle


def _write_computed(op: OpOverload, oi: schema.OpInfo, values: list, outs: list, computed):
    """out= of a call whose result shape depends on values (``masked_select``): the targets take
    the computed results' shapes, as CPU resizes them."""
    targets, flat = _flat_targets(values, oi, outs)
    overlap.check_between(op, flat, schema.read(oi, values, overlap.read_first(op)))
    for t, r in zip(flat, schema.flatten(computed)):
        if not meta.is_device(t):
            raise meta.device_error(t)
        _resize_out(t, r.shape)
        tensors.write(t, kernels.convert(tensors.read(r), t))
    return schema.returns(op, targets)


def _leaves(d):
    if d is None:
        return []
    if results.is_leaf(d):
        return [d]
    out = []
    for x in d:
        out.extend(_leaves(x))
    return out


def _lowered_functional(functional: OpOverload, lowering: Lowering):
    def run(foi, values, target_dtypes, key):
        final = tuple(dtypes.to_jax(d) for d in target_dtypes)
        _, spec = plan(functional, lowering, foi, values, final if len(final) > 1 else final[0],
                       key)
        return computed(compute(lowering, spec, values, writes=True))

    return run


def _decomposed_functional(functional: OpOverload, decomp):
    def run(foi, values, target_dtypes, key):
        args, kwargs = schema.unbind(foi, values)
        return [tensors.read(t) for t in schema.flatten(decomp(*args, **kwargs))]

    return run


_decomposing = threading.local()


def _decomposition_handler(op: OpOverload, decomp):
    oi = schema.info(op) if op._schema.is_mutable else None

    def handle(args, kwargs):
        values, outs = schema.bind(schema.info(op), args, kwargs)
        refusals.check(op, values, outs)
        if oi is not None:  # what the decomposition writes must not overlap what it reads
            overlap.check(op, _flat_targets(values, oi, outs)[1],
                          schema.read(oi, values, overlap.read_first(op)))
        active = getattr(_decomposing, "ops", None)
        if active is None:
            active = _decomposing.ops = set()
        # Some decompositions end in a primitive that calls the op itself again.
        if op in active:
            return fallback.run_on_cpu(op, args, kwargs)
        active.add(op)
        try:
            out = decomp(*args, **kwargs)
        finally:
            active.discard(op)
        if out is NotImplemented:
            return fallback.run_on_cpu(op, args, kwargs)
        if oi is None and results.laid_operand(args):
            # A decomposition computes in contiguous tensors: its results take the layouts
            # the meta kernel gives (max_pool3d's of a channels-last-3d input).
            out = results.relaid(out, meta.infer(op, values))
        return out

    return handle


def _fallback_handler(op: OpOverload):
    def handle(args, kwargs):
        return fallback.run_on_cpu(op, args, kwargs)

    return handle


def handler(op: OpOverload):
    """How op runs on the device; chosen once per overload."""
    handle = op.__dict__.get(_HANDLER)
    if handle is None:
        # The first op starts JAX's backend on this process's device (import does not, so that
        # torchtpu.distributed can start JAX's multi-process runtime before it).
        platform.local_device()
        handle = at_call.widening_byte_targets(
            op, at_call.moving_cpu_indices(op, at_call.checked(op, _choose(op))))
        setattr(op, _HANDLER, handle)
    return handle


def _choose(op: OpOverload):
    lowering = lookup(op)
    if lowering is not None:
        return _functional_handler(op, lowering)
    functional = schema.functional_of(op)
    if functional is not None and functional is not op:
        lowering = lookup(functional)
        if lowering is not None:
            return _mutating_handler(op, functional, _lowered_functional(functional, lowering),
                                     traced_arguments(functional, lowering),
                                     lowering if lowering.data_dependent_shape else None)
    decomp = decomposition_table.get(op)
    if decomp is not None:
        return _decomposition_handler(op, decomp)
    if functional is not None and functional is not op:
        decomp = decomposition_table.get(functional)
        if decomp is not None:
            return _mutating_handler(op, functional, _decomposed_functional(functional, decomp))
    return _fallback_handler(op)


def kernel(op: OpOverload, *args, **kwargs):
    """The boxed PrivateUse1 fallback kernel.

    A call that fails (a check, a meta kernel, a decomposition or JAX refused it) is run on CPU
    copies of its inputs: if CPU refuses it too, CPU's error (type and words) is raised, as the
    user's call would raise it there; if CPU accepts it, the failure is ours and stands. Either
    way it ends at the user's line, one error with no chain, as on CPU; TORCHTPU_DEBUG=1 keeps
    torchtpu's frames and, for CPU's error, ours as its cause.
    """
    try:
        return (op.__dict__.get(_HANDLER) or handler(op))(args, kwargs)
    except Exception as e:
        # Debug's NaN report is about values, which CPU would not refuse; a device out of
        # memory is no error of the call's (and a CPU copy would take as much host memory).
        expected = None if isinstance(e, (FloatingPointError, torch.OutOfMemoryError)) else \
            fallback.cpu_error(op, args, kwargs)
        if expected is None:
            if not errors.show_internals():
                errors.note_hidden_frames(e)
            error = e
        elif errors.show_internals():
            raise expected from e
        else:
            error = expected
    # Raised outside the handler: CPU's error does not chain to ours (a bare raise then adds no
    # frame of this one).
    try:
        raise error
    except Exception:
        errors.trim(error)
        raise


def _needs_device_kernel(op: OpOverload) -> bool:
    try:
        return not torch._C._dispatch_has_kernel_for_dispatch_key(
            op.name(), "CompositeImplicitAutograd"
        )
    except RuntimeError:  # a TorchScript-only overload (``__lshift__.int``): never dispatched
        return False


def _mutating_variants(op: OpOverload) -> list:
    """In-place and out= overloads whose functional twin is op (``add_.Tensor``, ``add.out``)."""
    ns, name = op._schema.name.split("::")
    found = []
    for packet_name in (name, name + "_"):
        packet = getattr(getattr(torch.ops, ns), packet_name, None)
        if packet is None:
            continue
        for overload in packet.overloads():
            variant = getattr(packet, overload)
            if variant._schema.is_mutable and schema.functional_of(variant) is op:
                found.append(variant)
    return found


def register_lowered_ops(lib: torch.library.Library) -> None:
    """Give every lowered op, and its in-place and out= variants, a direct PrivateUse1 kernel.

    Without one, an op that has a CompositeExplicitAutograd kernel (``abs``, ``fill_``, the
    ``_foreach_*_`` ops, whose composite kernel loops over the list one tensor at a time) would
    run that kernel and reach the device piecemeal. CompositeImplicitAutograd ops are left
    alone: a backend kernel would switch off their autograd formula.
    """
    from torchtpu.lowering.registry import TABLE

    for op in list(TABLE):
        for target in [op, *_mutating_variants(op)]:
            # Other namespaces' lowered ops (prims.fma, once Inductor is imported) keep the
            # fallback: lib can register only its own.
            if target.namespace == lib.ns and _needs_device_kernel(target):
                lib.impl(target, functools.partial(kernel, target), "PrivateUse1")
