"""What CPU's kernels refuse by dtype, asked of CPU once per op and dtype signature.

A lowering computes in any dtype, and a meta kernel checks shapes and type promotion but not
which dtypes the device kernel implements: ``gelu`` of an int64 tensor ("GeluKernelImpl" not
implemented for 'Long'), ``mm(float, long)`` ("expected m1 and m2 to have the same dtype") or
``softmax`` of an integer tensor would return a wrong answer where CPU raises. So where a call
is planned (a miss of ``meta.infer``'s cache, each call of a decomposed op, each node of a
compiled graph), the op runs on CPU on stand-ins: ones of each tensor's dtype (then zeros in
integer tensors, where ones fail: an index of 1 in a dimension of one), of its shape
where that is small, else of a shape shrunk to at most one element per dimension (and, where
the shrunk shapes fail and the call is not too large, again at its shapes). No value is read
from the device. A signature CPU takes (dtypes, ranks and the other arguments:
``signature``) is remembered, so every later call of it costs a set lookup at most.

A stand-in CPU refuses is refused for its dtypes, its (shrunk) shape or its values. The dtypes
are to blame when the refusal is the dtype dispatch's (``NotImplementedError``: "... not
implemented for 'Long'"), or when CPU takes the same stand-ins recast to dtypes almost every
kernel takes (``_controls``: float32, keeping integer indices; one tensor in the first one's
dtype): then the call is refused with CPU's error.
Where every stand-in fails for its shapes or values alike (``segment_reduce``'s lengths must
add up to the data's length), CPU is asked on copies of the call's inputs (once per signature,
in eager mode, where reading them is free: the CPU platform, computed, not too large;
``fallback.cpu_error``); on a TPU such a call proceeds.
Otherwise the call proceeds (what CPU checks of values is the business of the op's ``@check``,
beside its lowering).
The eager dispatcher then words the error as CPU does for the real inputs (``dispatch.kernel``).
"""

from __future__ import annotations

import functools
from collections.abc import Callable

import torch
from torch.utils._python_dispatch import _disable_current_modes

from torchtpu import errors
from torchtpu.device import asserts, ownership
from torchtpu.device.hooks import HOOKS
from torchtpu.eager import fallback, schema
from torchtpu.lowering.registry import SAVED_STATISTICS

OpOverload = torch._ops.OpOverload

# Tensors with at most this many elements are stood in for at their own shape; calls with at
# most LARGE elements in all are asked again at their shapes when shrunk stand-ins fail.
SMALL = 4096
LARGE = 1 << 22

# (op, signature) of every call CPU accepted.
_accepted: set = set()


def _leaf(v, index: int, traced: frozenset):
    if isinstance(v, torch.Tensor):
        return (v.dtype, v.dim(), v.is_cpu)
    if isinstance(v, (list, tuple)):
        return tuple(_leaf(x, index, traced) for x in v)
    if isinstance(v, torch.Generator):
        return "gen"
    if isinstance(v, (int, float, complex)) and not isinstance(v, bool) and index in traced:
        # A traced number changes from call to call (a learning rate): its type and sign count.
        return (type(v), v.real < 0 if isinstance(v, complex) else v < 0)
    return v


def signature(op: OpOverload, values: list, outs: list, traced: frozenset) -> tuple:
    """What decides whether CPU takes op's call: every argument but tensor shapes and values
    (and, for numbers the program traces, their values but their signs)."""
    return (op, tuple(_leaf(v, i, traced) for i, v in enumerate(values)),
            tuple(_leaf(o, -1, traced) for o in outs))


def _big(x) -> bool:
    if isinstance(x, torch.Tensor):
        return not x.is_cpu and x.numel() > SMALL
    return isinstance(x, (list, tuple)) and any(_big(y) for y in x)


def _stand_in(x, shrink: bool, recast: Callable | None, zeros: bool):
    if isinstance(x, torch.Tensor):
        if x.is_cpu:
            return x
        shape = tuple(min(n, 1) for n in x.shape) if shrink else x.shape
        dtype = x.dtype if recast is None else recast(x)
        return (torch.zeros if zeros and _integer(dtype) else torch.ones)(shape, dtype=dtype)
    if isinstance(x, (list, tuple)):
        return type(x)(_stand_in(y, shrink, recast, zeros) for y in x)
    if isinstance(x, torch.Generator):
        return None
    if isinstance(x, torch.device) and x.type == "tpu":
        return torch.device("cpu")
    if isinstance(x, str) and x.startswith("tpu"):
        return "cpu"
    return x


def _device_tensors(values) -> list:
    found = []
    for v in values:
        if isinstance(v, torch.Tensor) and not v.is_cpu:
            found.append(v)
        elif isinstance(v, (list, tuple)):
            found.extend(_device_tensors(v))
    return found


def _integer(dtype: torch.dtype) -> bool:
    return not (dtype.is_floating_point or dtype.is_complex or dtype == torch.bool)


# The controls: the same stand-ins recast to dtypes almost every kernel takes (float32 for all,
# or for all but the integers, or all but int64: the indices), or with one tensor given the
# first one's dtype (``mm(float, long)``; ``index_add``'s int64 source beside its index).
_CONTROLS = (lambda t: torch.float32,
             lambda t: t.dtype if _integer(t.dtype) else torch.float32,
             lambda t: t.dtype if t.dtype == torch.int64 else torch.float32)
_ONE_AT_A_TIME = 4


def _controls(tensors: list) -> list:
    """The recasts (tensor -> dtype) that change the call's dtypes, each once."""
    first = tensors[0].dtype
    one = [functools.partial(_one_recast, t, first) for t in tensors[1:_ONE_AT_A_TIME + 1]]
    seen, found = {tuple(t.dtype for t in tensors)}, []
    for recast in (*_CONTROLS, *one):
        dtypes = tuple(recast(t) for t in tensors)
        if dtypes not in seen:
            seen.add(dtypes)
            found.append(recast)
    return found


def _one_recast(target: torch.Tensor, dtype: torch.dtype, t: torch.Tensor) -> torch.dtype:
    return dtype if t is target else t.dtype


def _on_stand_ins(op: OpOverload, values: list, outs: list, shrink: bool,
                  recast: Callable | None = None, zeros: bool = False) -> Exception | None:
    oi = schema.info(op)
    values = [_stand_in(v, shrink, recast, zeros) for v in values]
    for i in oi.scalar_indices:
        if isinstance(values[i], (bool, int, float, complex)) and oi.tensor_typed[i]:
            # A composite kernel's wrapped number (see ``meta.infer``), as the tensor it stands
            # for: an overload called with a bare number there refuses the number.
            values[i] = torch.tensor(values[i])
    args, kwargs = schema.unbind(oi, values)
    for name, o in zip(oi.out_names, outs):
        kwargs[name] = _stand_in(o, shrink, recast, zeros)
    # (CPU's warnings about stand-ins, a resized out=, are not the user's either.)
    with torch.no_grad():
        return fallback.ask_cpu(op, args, kwargs)


def _dtype_dispatch(error: Exception) -> bool:
    return isinstance(error, NotImplementedError) and " not implemented for '" in str(error)


def _dtypes_refused(op: OpOverload, values: list, outs: list, tensors: list, shrink: bool):
    """CPU's error when the stand-ins' dtypes are to blame; None when CPU takes them; False
    when CPU refuses them recast to the controls' dtypes too (for their shapes or values)."""
    # Ones, then zeros in integer tensors: an index of 1 is out of range in a dimension of one,
    # and a divisor of 0 is refused in integer division.
    for zeros in (False, True):
        error = _on_stand_ins(op, values, outs, shrink, zeros=zeros)
        if error is None:
            return None
        if _dtype_dispatch(error):
            return error
        for recast in _controls(tensors):
            if _on_stand_ins(op, values, outs, shrink, recast, zeros) is None:
                return error
    return False


def refusal(op: OpOverload, values: list, outs: list = (), traced: frozenset = frozenset(),
            read_values: bool = True) -> Exception | None:
    """CPU's error for a call it refuses for its dtypes, or None if it takes them.
    ``read_values``: where no stand-in decides, the call's own values may be read (eager)."""
    try:
        key = signature(op, values, outs, traced)
        if key in _accepted:
            return None
    except TypeError:  # an unhashable argument: asked every time
        key = None
    error = None
    tensors = _device_tensors((*values, *outs))
    if tensors and torch._C._dispatch_has_computed_kernel_for_dispatch_key(op.name(), "CPU"):
        # (No CPU kernel, as for the fused attention kernels: nothing to ask.)
        shrink = any(_big(t) for t in tensors)
        # A dispatch mode (a compiled graph's fake tensors, a user's FlopCounterMode) is not
        # the stand-ins' to meet.
        with _disable_current_modes():
            error = _dtypes_refused(op, values, outs, tensors, shrink)
            if error is False and shrink and sum(t.numel() for t in tensors) <= LARGE:
                # Shrunk stand-ins broke the shapes (a pooling window, groups of channels):
                # asked again at the call's shapes, once per signature.
                error = _dtypes_refused(op, values, outs, tensors, False)
        if error and op in SAVED_STATISTICS and _statistics_taken(op, values, outs, tensors,
                                                                  shrink):
            error = None
        if error is False and read_values:
            error = _on_its_values(op, values, outs, tensors)
    if error is False:
        return None  # asked again next time: nothing known
    if error is None and key is not None:
        _accepted.add(key)
    return error


def _statistics_taken(op: OpOverload, values: list, outs: list, tensors: list,
                      shrink: bool) -> bool:
    """Whether CPU takes the call with the forward's saved statistics in the input's dtype, as
    its own forward makes them (``registry.saved_statistics``): the meta kernel's float32 ones,
    which every executor here makes, are no dtype of the user's."""
    stats = {id(values[i]) for i in SAVED_STATISTICS[op] if isinstance(values[i], torch.Tensor)}
    dtype = tensors[0].dtype

    def recast(t: torch.Tensor) -> torch.dtype:
        return dtype if id(t) in stats else t.dtype

    return _on_stand_ins(op, values, outs, shrink, recast) is None


def _on_its_values(op: OpOverload, values: list, outs: list, tensors: list):
    """CPU's error for the call on copies of its inputs, None when it takes it; False when they
    cannot be read now: not for free (a capture, pending in a recording, on a TPU, too large),
    or not without raising a device check still pending (which would be lost)."""
    if (HOOKS.capture is not None or asserts.host_reads_stall() or asserts.pending()
            or sum(t.numel() for t in tensors) > LARGE
            or not all(ownership.is_materialized(t) for t in tensors)):
        return False
    oi = schema.info(op)
    args, kwargs = schema.unbind(oi, list(values))
    kwargs.update(zip(oi.out_names, outs))
    error = fallback.cpu_error(op, tuple(args), kwargs)
    if error is not None and all(
            type(e) is type(error) and str(e) == str(error)
            for e in (_on_stand_ins(op, values, outs, False),
                      _on_stand_ins(op, values, outs, False, _CONTROLS[0]))):
        # CPU refuses the op in the same words whatever its inputs and dtypes (a device-only
        # op's stub CPU kernel): that says nothing about them.
        return None
    return error


def check(op: OpOverload, values: list, outs: list = (), traced: frozenset = frozenset(),
          read_values: bool = True) -> None:
    """Raise CPU's error for a call CPU refuses for its dtypes."""
    error = refusal(op, values, outs, traced, read_values)
    if error is not None:
        raise errors.from_cpu(error)
