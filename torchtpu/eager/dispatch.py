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

import torch
from torch._decomp import decomposition_table

from torchtpu import errors
from torchtpu.device import dtypes, kernels, overlap, tensors
from torchtpu.device.hooks import HOOKS, MISS
from torchtpu.eager import (
    at_call,
    fallback,
    meta,
    refusals,
    results,
    schema,
    seen_calls,
    seen_lists,
)
from torchtpu.eager.calls import (
    compute,
    compute_unknown_shape,
    forget_plans,
    plan,
    run_seen,
    traced_arguments,
)
from torchtpu.eager.lazy_casts import computed
from torchtpu.lowering.registry import META_STRIDES, Lowering, lookup
from torchtpu.runtime import platform

OpOverload = torch._ops.OpOverload
# The handler chosen for an op lives on the OpOverload itself (an attribute read, not a hash).
_HANDLER = "_torchtpu_handler"


def _functional_handler(op: OpOverload, lowering: Lowering):
    oi = schema.info(op)
    returns_list = len(op._schema.returns) == 1 and str(op._schema.returns[0].type) == "Tensor[]"

    seen: dict = {}  # signature -> [seen_calls.Seen]
    # A random call's key entry depends on its values: one that draws no key (SDPA without
    # dropout) repeats; its spec leads with that entry, so its reads count from 1.
    keyed = bool(lowering.random)
    repeatable = not keyed or callable(lowering.random)
    # A call over tensor lists (``_foreach_norm``, ``cat``) is kept as ``seen_lists`` keeps them.
    lists = _reads_lists(op)
    traced = traced_arguments(op, lowering) if lists else frozenset()
    lookup, reads_of = (seen_lists.functional(oi, traced, not lowering.donates) if lists
                        else (None, seen_calls.reads_of))
    # Bound as ``schema.bind`` binds a call of positional arguments (its common case, inline:
    # a frame and a ``len`` a call fewer); a functional op has no out= arguments.
    optional_from, defaults = oi.optional_from, oi.defaults

    def handle(args, kwargs):
        n = len(args)
        values = [*args, *defaults[n:]] if not kwargs and n >= optional_from \
            else schema.bind(oi, args, kwargs)[0]
        if lowering.data_dependent_shape and lowering.shape_depends_on_values(values):
            return compute_unknown_shape(lowering, oi, values)
        key = None
        if repeatable and HOOKS.capture is None and not (keyed and lowering.draws_key(values)):
            key, found = (lookup or seen_calls.lookup)(values, seen, keyed)
            if found is not None:
                kept, dyn = found
                out = run_seen(lowering, kept, values, dyn)
                wrap = kept.wrap
                if wrap is None:
                    wrap = kept.wrap = results.wrapper(kept.result)
                out = None if out is None else wrap(out)
                return list(out) if returns_list else out
        result, spec = plan(op, lowering, oi, values)
        # A signature holds every tensor's strides, which decide a laid-out result's layout
        # (channels-last, SDPA's output in its query's order): its wrapper lays it out again.
        # One read another way than the signature's remembered calls (a view where they read
        # whole arrays) is kept beside them.
        reads = None if key is None else reads_of(spec, [None, *values] if keyed else values)
        out = results.wrapped(compute(lowering, spec, values), result, op)
        if reads is not None:
            if lists:
                seen_lists.remember(seen, key, spec, reads, result, listed=True)
            else:
                seen_calls.remember(seen, key, reads, result, spec)
        return list(out) if returns_list else out

    # Whether a call's path is a function of its arguments alone (``defer_replay``): a random
    # op's that drew no key (SDPA without dropout), whose rule reads only what the replay
    # checks (the call's signature: ``registry``'s ``random``), and which is kept only where
    # no node took a key.
    handle.replayable = not (keyed and not callable(lowering.random) or lists or returns_list
                             or lowering.data_dependent_shape)
    # A list call's, where its path is a function of its arguments' facts and the bound
    # arguments' traced positions and defaults (``defer_replay_lists``).
    handle.lists = (traced, oi.defaults, ()) if lists and not keyed \
        and not lowering.data_dependent_shape else None
    return handle


def _flat_targets(values, oi, outs):
    targets = outs if outs else [values[i] for i in oi.written]
    flat = []
    for t in targets:
        flat.extend(t if isinstance(t, (list, tuple)) else [t])
    return targets, flat


def _resize_out(t: torch.Tensor, shape) -> bool:
    """t resized to shape; whether it was (an out= argument of the right shape keeps its own
    strides)."""
    if tuple(t.shape) != tuple(shape):
        t.resize_(shape)
        return True
    return False


def _restride(t: torch.Tensor, functional: OpOverload, values: list, traced: frozenset) -> None:
    """An out= argument CPU resized for a pointwise op, restrided as CPU restrides it: as the
    functional twin's result (``add(a.t(), b.t(), out=empty)`` is transposed). The out=
    overload's own meta kernel leaves it row-major."""
    d = meta.infer(functional, values, traced=traced, strides=True)
    if results.is_leaf(d) and len(d) == 3:
        t.as_strided_(d[0], results.strides_of(d))


def _mutating_handler(op: OpOverload, functional: OpOverload, compute_functional,
                      traced: frozenset = frozenset(), lowering: Lowering | None = None,
                      repeat: Lowering | None = None):
    """In-place and out= overloads: compute the functional twin, write into the targets.

    ``traced``: the twin's traced number arguments (same positions: the signatures match).
    ``lowering``: the twin's, where its result shape may depend on values (no meta kernel then).
    ``repeat``: the twin's, where its in-place calls over tensor lists may take
    ``seen_lists``' short path.
    """
    oi = schema.info(op)
    foi = schema.info(functional)
    # The twins' call keys of one call are equal when their schemas' defaults are: made once
    # for both (an optimizer's foreach call keys ~4 lists of a tensor a parameter).
    shared = (oi.defaults, oi.generator_index) == (foi.defaults, foi.generator_index)
    # A resized out= argument takes the twin's layout (``_restride``) where the twin's lowering
    # lays results out as CPU does (pointwise ops).
    twin = lookup(functional)
    laid = twin is not None and twin.layout is META_STRIDES
    if not shared or oi.out_names:
        repeat = None
    seen: dict = {}  # seen_lists.signature -> seen_calls.Seen

    def handle(args, kwargs):
        values, outs = schema.bind(oi, args, kwargs)
        if outs and lowering is not None and lowering.shape_depends_on_values(values):
            return _write_computed(op, oi, values, outs,
                                   compute_unknown_shape(lowering, foi, values))
        seen_key = None
        if repeat is not None and HOOKS.capture is None:
            try:
                seen_key = seen_lists.signature(values, traced, oi.defaults)
                kept = seen.get(seen_key)
            except (TypeError, AttributeError):  # unhashable, or a None among tensors
                seen_key = kept = None
            if kept is not None:
                dyn = seen_lists.arrays(values, kept.reads)
                if dyn is not None:
                    return _repeat_in_place(op, oi, repeat, kept, values, dyn)
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
                if _resize_out(t, s) and laid:
                    _restride(t, functional, values, traced)
        overlap.check_between(op, flat, schema.read(oi, values, overlap.read_first(op)))
        final = [t.dtype for t in flat]
        reads = None
        if seen_key is not None:  # how the twin reads, before it runs (see ``seen_calls``)
            spec = plan(functional, repeat, foi, values, _final(final), key)[1]
            reads = seen_lists.reads_of(spec, values, oi.written, casts=not repeat.donates)
        arrays = schema.flatten(compute_functional(foi, values, final, key))
        if reads is not None and seen_lists.storable(flat, arrays):
            seen_lists.remember(seen, seen_key, spec, reads)
        for t, a in zip(flat, arrays):
            tensors.write(t, kernels.convert(a, t))
        return schema.returns(op, targets)

    # An in-place list call on ``seen_lists``' short path is replayed as that path leaves it
    # (``defer_replay_lists``).
    handle.lists = (traced, oi.defaults, oi.written) if repeat is not None else None
    return handle


def _repeat_in_place(op: OpOverload, oi: schema.OpInfo, lowering: Lowering,
                     kept: seen_calls.Seen, values: list, dyn: tuple):
    """An in-place call on ``seen_lists``' short path: the twin run from the read arrays, each
    result its target's storage's array (no overlap to check: see ``seen_lists``)."""
    targets, flat = _flat_targets(values, oi, ())
    out = schema.flatten(computed(run_seen(lowering, kept, values, dyn, writes=True)))
    for t, a in zip(flat, out):
        t.untyped_storage()._tpu_array = a
    return schema.returns(op, targets)


def _final(target_dtypes: list):
    final = tuple(dtypes.to_jax(d) for d in target_dtypes)
    return final if len(final) > 1 else final[0]


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
        _, spec = plan(functional, lowering, foi, values, _final(target_dtypes), key)
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


def _over_lists(op: OpOverload) -> bool:
    """Whether op writes tensor lists in place (the ``_foreach_*_`` ops)."""
    return any(a.alias_info is not None and a.alias_info.is_write
               and str(a.type).startswith("List[Tensor]") for a in op._schema.arguments)


def _reads_lists(op: OpOverload) -> bool:
    return any(str(a.type).startswith("List[Tensor]") for a in op._schema.arguments)


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


def forget(op: OpOverload) -> None:
    """Drop what was kept about op's calls: its handler (with the signatures it saw) and its
    plans. Its fake kernel was registered again (``jax_op``'s ``register_fake``), which
    describes its results anew (``meta.infer`` keys them by that kernel)."""
    op.__dict__.pop(_HANDLER, None)
    forget_plans(op)


def _choose(op: OpOverload):
    lowering = lookup(op)
    if lowering is not None:
        return _functional_handler(op, lowering)
    functional = schema.functional_of(op)
    if functional is not None and functional is not op:
        lowering = lookup(functional)
        if lowering is not None:
            return _mutating_handler(
                op, functional, _lowered_functional(functional, lowering),
                traced_arguments(functional, lowering),
                lowering if lowering.data_dependent_shape else None,
                None if lowering.random or lowering.data_dependent_shape or not _over_lists(op)
                else lowering)
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
    replay = HOOKS.replay
    if replay is not None:  # DeferAndFuse records: a call repeating a kept one is appended
        out = replay.repeat(op, args, kwargs)
        if out is not MISS:
            return out
        mark = replay.mark(op, args)
    try:
        out = (op.__dict__.get(_HANDLER) or handler(op))(args, kwargs)
        if replay is not None:
            replay.keep(op, args, kwargs, out, mark)
        return out
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
    """Whether op's lowering gets a PrivateUse1 kernel: not for a CompositeImplicitAutograd op,
    whose autograd formula a backend kernel would switch off, unless CPU has a kernel of its own
    for it (``silu_backward``, which autograd calls only with grad mode off): CPU's autograd
    then sees no formula either."""
    name = op.name()
    try:
        return not torch._C._dispatch_has_kernel_for_dispatch_key(
            name, "CompositeImplicitAutograd"
        ) or torch._C._dispatch_has_kernel_for_dispatch_key(name, "CPU")
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
    alone (``_needs_device_kernel``).
    """
    from torchtpu.lowering.registry import TABLE

    for op in list(TABLE):
        for target in [op, *_mutating_variants(op)]:
            # Other namespaces' lowered ops (prims.fma, once Inductor is imported) keep the
            # fallback: lib can register only its own.
            if target.namespace == lib.ns and _needs_device_kernel(target):
                lib.impl(target, functools.partial(kernel, target), "PrivateUse1")
