"""What is checked and adjusted at an op's call before the device runs it.

- The op's check (``@check``, beside its lowering): what CPU refuses that meta kernels do not,
  raised at the user's line; a check of data whose values the host cannot read without stalling the
  device runs on the device instead (``device/asserts.py``).
- CUDA's rule for advanced indexing: CPU index tensors move to the device, counted.
- NLL loss's uint8 targets, which CPU takes, widen to int64 for PyTorch's meta kernels.
"""

from __future__ import annotations

import functools

import jax
import numpy as np
import torch

from torchtpu import errors, metrics
from torchtpu.device import asserts, dtypes, ownership, tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.eager import executor, schema
from torchtpu.lowering import checks

OpOverload = torch._ops.OpOverload


@functools.cache
def _host_values(t: torch.Tensor):
    if t.is_cpu:  # a CPU scalar, or an operand the op refuses for its device afterwards
        return t.detach().numpy()
    # Inside a capture the values are the capture's, not a replay's, and a view of them would
    # be read through the recording (a host read there): the check goes to the device, which
    # skips it in a capture (see _check_on_device).
    if HOOKS.capture is not None or asserts.host_reads_stall():
        return None
    # A padded value (``compile/padded_values.py``) gives its real elements without being cut
    # into its storage, which would undo its padding for the op this check guards.
    # (Asked of its type: DeferAndFuse's pending value would run to answer an attribute read.)
    array = t.untyped_storage()._tpu_array
    host_view = getattr(type(array), "host_view", None)
    if host_view is not None:
        return host_view(array, t)
    if not ownership.is_materialized(t):
        return None
    if HOOKS.deferrer is not None and not tensors.reads_whole(t):
        # DeferAndFuse records a view's read: reading it would run the recording here, in the
        # middle of a step (nll_loss's flattened targets). The view is taken on the host.
        return _view_on_host(t)
    return np.asarray(tensors.read(t))


def _view_on_host(t: torch.Tensor):
    """View t's elements in the host values of its storage's computed array (None for a view
    of other dtype or with lazy bits: the device checks those)."""
    array = tensors.stored_array(t.untyped_storage())
    if t.is_conj() or t.is_neg() or array.dtype != dtypes.to_jax(t.dtype):
        return None
    flat = np.asarray(array).reshape(-1)
    return np.lib.stride_tricks.as_strided(flat[t.storage_offset():], tuple(t.shape),
                                           [s * flat.itemsize for s in t.stride()],
                                           writeable=False)


def _arg(v, on_device: list):
    if isinstance(v, torch.Tensor):
        return checks.Arg(v.shape, v.dtype, functools.partial(_host_values, v),
                          lambda find, error: on_device.append((v, find, error)))
    if isinstance(v, (list, tuple)) and any(isinstance(x, torch.Tensor) for x in v):
        return [_arg(x, on_device) for x in v]
    return v


@functools.cache
def _device_check(find):
    return jax.jit(find)


def _check_on_device(op: OpOverload, on_device: list) -> None:
    """Give the device the data checks a check handed it (none inside a capture, whose replays
    could not raise them). Debug mode waits for every op anyway, so it reads the flags at once
    and raises at the user's line, on a TPU as on the CPU platform; the other modes raise at the
    next host read, as CUDA's device-side asserts do."""
    if HOOKS.capture is not None:
        return
    at_once = isinstance(executor.current(), executor.Debug)
    where = executor.user_location()
    for t, find, error in on_device:
        flags = tensors.call(_device_check(find), tensors.read(t))
        if at_once:
            bad, value = (int(v) for v in np.asarray(flags))
            if bad:
                raise check_error(op, error, value)
        else:
            asserts.add(flags, functools.partial(check_error, op, error), where)


def check_error(op: OpOverload, error, value: int | None = None) -> Exception:
    """The check's error (or, given a device check's value, ``error(value)``) for op, prefixed."""
    if value is not None:
        error = error(value)
    return type(error)(errors.message("check", f"{op}: {error}"))


def checked(op: OpOverload, handle):
    """handle, after the op's check (``lowering/checks.py``), or its functional twin's on the
    same leading arguments, if it has one."""
    functional = schema.functional_of(op)
    own = checks.find(op)
    check = own or (checks.find(functional) if functional is not None else None)
    if check is None:
        return handle
    oi = schema.info(op)
    n = len(schema.info(functional).names) if own is None else None

    def run(args, kwargs):
        values, outs = schema.bind(oi, args, kwargs)
        on_device: list = []
        # An op's own check also gets its out= arguments, after the others.
        error = check(*(_arg(v, on_device)
                        for v in (values[:n] if own is None else [*values, *outs])))
        if error is not None:
            raise check_error(op, error)
        if on_device:
            _check_on_device(op, on_device)
        return handle(args, kwargs)

    return run


# CUDA's rule for advanced indexing (ATen's AdvancedIndex): index tensors may live on CPU and
# are moved to the indexed tensor's device. Only for these ops: any other CPU operand (but a
# 0-dim one, as in TensorIterator) still raises "Expected all tensors to be on the same device".
_CPU_INDICES = frozenset({"index", "index_put", "index_put_", "_index_put_impl_",
                          "_unsafe_index", "_unsafe_index_put"})


def moving_cpu_indices(op: OpOverload, handle):
    if op._schema.name.split("::")[-1] not in _CPU_INDICES:
        return handle

    def move(i):
        if isinstance(i, torch.Tensor) and i.is_cpu:
            metrics.count("implicit_index_transfers")
            return i.to("tpu")
        return i

    def run(args, kwargs):
        indexed = args[0] if args else kwargs.get("self")
        if isinstance(indexed, torch.Tensor) and indexed.is_cpu:  # tpu indices into a CPU tensor
            raise RuntimeError("torchtpu.placement: indices should be either on cpu or on the "
                               f"same device as the indexed tensor ({indexed.device})")
        if len(args) > 1:
            args = (args[0], [move(i) for i in args[1]], *args[2:])
        elif "indices" in kwargs:
            kwargs = {**kwargs, "indices": [move(i) for i in kwargs["indices"]]}
        return handle(args, kwargs)

    return run


# CPU's NLL loss kernels take a uint8 target (its 2-d ones do not); PyTorch's meta kernels for
# them (decompositions that gather and scatter with it) want int64, so shape inference would
# refuse the call. The target is widened at the call (its values, class indices, are the same).
_BYTE_TARGETS = frozenset({"nll_loss_forward", "nll_loss_backward"})


def widening_byte_targets(op: OpOverload, handle):
    if op._schema.name.split("::")[-1] not in _BYTE_TARGETS:
        return handle
    at = schema.info(op).names.index("target")

    def widen(t):
        return t.long() if isinstance(t, torch.Tensor) and t.dtype == torch.uint8 else t

    def run(args, kwargs):
        if len(args) > at:
            args = (*args[:at], widen(args[at]), *args[at + 1:])
        elif "target" in kwargs:
            kwargs = {**kwargs, "target": widen(kwargs["target"])}
        return handle(args, kwargs)

    return run
