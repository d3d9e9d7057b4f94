"""One lowered op call: its static spec and dynamic values, its plan, and its run.

``plan`` turns a bound call into (result shapes and dtypes, program ``Spec``), cached per call
key; ``dynamic_values`` reads the arrays and traced numbers the spec consumes; ``compute`` runs
the lowering through the upper layers' hooks and the current executor, and ``run_seen`` does the
same for a call ``seen_calls`` remembered (its arrays read already). The dispatcher
(``eager/dispatch.py``) chooses which op runs how; the compiled path (``compile/``) splits its
graph's calls with the same ``traced_arguments`` and ``entries_of``.
"""

from __future__ import annotations

import functools
from threading import get_ident

import jax
import numpy as np
import torch

from torchtpu import metrics
from torchtpu.device import constants, dtypes, launch, tensors
from torchtpu.device.hooks import AUTOGRAD, HOOKS, STEADY
from torchtpu.device.random import key_data_for
from torchtpu.eager import executor, meta, refusals, results, schema, seen_calls
from torchtpu.eager.defer import RECORDER
from torchtpu.eager.lazy_casts import settle
from torchtpu.eager.program import CONST, KEY, SCALAR, TENSOR, TENSORS, Spec, with_views
from torchtpu.lowering.registry import META_STRIDES, Lowering

OpOverload = torch._ops.OpOverload
_SEQUENCES = (tuple, list)

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
    shape_only = lowering.shape_only
    for i, v in enumerate(values):
        if shape_only and isinstance(v, torch.Tensor) and oi.names[i] in shape_only:
            # Its shape and dtype are in the call key; its storage is neither read (a
            # never-written one would make a zeros program) nor waited on.
            entries.append((CONST, jax.ShapeDtypeStruct(tuple(v.shape), dtypes.to_jax(v.dtype))))
        elif isinstance(v, torch.Tensor):
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
# attribute read does not: (its plans by call key, its traced argument positions).
_PLANS = "_torchtpu_plans"


def _compute_dtype(described: tuple) -> np.dtype:
    # Checked before the program compiles: libtpu ends the process on a complex128 one.
    if described[1] is torch.complex128:
        dtypes.check_platform(described[1])
    return dtypes.to_jax(described[1])


def forget_plans(op: OpOverload) -> None:
    """op's plans dropped (its results are described anew: ``dispatch.forget``)."""
    op.__dict__.pop(_PLANS, None)


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
                            strides=lowering.layout is META_STRIDES, known_key=key[0])
        if callable(lowering.layout):
            result = results.laid_out(result, lowering.layout(*values))
        compute_dtypes = results.map_described(result, _compute_dtype)
        promote = meta.common_dtype(values) if lowering.promote == "common" else None
        entries = entries_of(oi, values, lowering)
        if lowering.random:
            # No Generator argument: a leading key from the default device generator, or None
            # for a call that draws none.
            entries = ((KEY if lowering.draws_key(values) else CONST, None), *entries)
        # A result CPU lays out in another order than row-major comes out of the program in
        # that order (``program.finished``); a result written into a target (``final``) is
        # written in the target's own layout.
        stored = None if final is not None else results.stored_order(result)
        if stored is not None:
            result = stored[1]
        spec = Spec(entries, compute_dtypes, compute_dtypes if final is None else final, promote,
                    None if stored is None else stored[0])
        if results.is_leaf(result):
            spec.shape = tuple(result[0]) if stored is None \
                else tuple(result[0][d] for d in stored[0])
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
    if lowering.constant is not None:
        out = _host_constant(lowering, spec, values)
        if out is not None:
            return out
    # A donated argument's buffer must be its own: a lazy cast's source is another's.
    dyn, views = dynamic_values([None, *values] if lowering.random else values, spec.entries,
                                not lowering.donates)
    growing = HOOKS.growing
    if growing is not None:
        out = growing(lowering, spec, values, dyn, views, writes)
        if out is not None and out is not STEADY and out is not AUTOGRAD:
            return dedupe(out, dyn)
    if views:
        spec = with_views(spec, views)
    return dedupe(executor.current().run(lowering, spec, dyn), dyn)


def _host_constant(lowering: Lowering, spec: Spec, values: list):
    """The result of a call whose lowering record declares it a ``constant``, sent from the
    host (``constants.host_constant``), where it reads no tensor and draws no key; else None. A
    recording keeps its call (DeferAndFuse fuses it into its reader's program, which compiles
    nothing of its own for it; a capture's replays repeat it); a result stored in another order
    than row-major is left to its program. (The thread making an optimizer's state outside
    DeferAndFuse's recording, ``Recorder.making``, is sent its constants as without a recorder.)"""
    deferrer = HOOKS.deferrer
    if (deferrer is not None and (deferrer is not RECORDER or RECORDER.making != get_ident())
            or HOOKS.capture is not None or spec.order is not None
            or spec.shape is None or any(kind in _READS for kind, _ in spec.entries)):
        return None
    return constants.host_constant(spec.shape, spec.final, lowering.constant(*values))


_READS = (TENSOR, TENSORS, KEY)
# -1 unless autograd's engine runs the calling thread's call (a backward's).
_graph_task_id = torch._C._current_graph_task_id


def run_seen(lowering: Lowering, kept: seen_calls.Seen, values: list, dyn: tuple,
             writes: bool = False):
    """``compute`` of a call on ``seen_calls``' (or ``seen_lists``') short path (its arrays
    read already): the same hooks and executor, and the executor's ``launcher`` for the call's
    spec, found once per remembered call and executor, where its ``run`` would only launch the
    program."""
    padded_inputs = HOOKS.padded_inputs
    if padded_inputs is not None:
        out = padded_inputs(lowering, kept.spec, values, writes)
        if out is not None:
            return out
    if lowering.constant is not None:
        out = _host_constant(lowering, kept.spec, values)
        if out is not None:
            return out
    growing = HOOKS.growing
    if growing is not None:
        # Not asked again while its steady answer for this call stands (the hook's epoch).
        # Nor while autograd's engine runs it, where this hook answered so (``AUTOGRAD``).
        epoch = HOOKS.growing_epoch
        steady = kept.steady
        if (steady is None or steady[0] is not growing or steady[1] != epoch) and not (
                kept.autograd is growing and _graph_task_id() != -1):
            out = growing(lowering, kept.spec, values, dyn, kept.views, writes)
            if out is STEADY:
                kept.steady = (growing, epoch)
            elif out is AUTOGRAD:
                kept.autograd = growing
            elif out is not None:
                return dedupe(out, dyn)
    current = executor.current()
    launcher = kept.launcher
    if launcher is None or launcher[0] is not current:
        viewed = kept.viewed
        launcher = kept.launcher = (current, current.launcher(lowering, viewed),
                                    current.holder(lowering, viewed))
    hold = launcher[2]
    if hold is not None:  # a held value is no input: nothing to dedupe
        out = hold(dyn)
        if out is not None:
            metrics.count_execution()
            return out
    fn = launcher[1]
    if fn is None:
        return dedupe(current.run(lowering, kept.viewed, dyn), dyn)
    metrics.count_execution()
    out = launch.run(lowering.op, fn, dyn)
    keeps = kept.viewed.keeps
    if keeps:  # (an autocast product over its two casts: they become its program's values)
        out = settle(keeps, dyn, out)
    if out.__class__ in _SEQUENCES:
        return _dedupe_all(out, {id(x) for x in dyn})
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
