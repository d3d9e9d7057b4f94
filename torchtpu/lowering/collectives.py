"""The functional collectives (``_c10d_functional.*``, what Dynamo and AOTAutograd trace for DDP,
FSDP2, DTensor and tensor parallelism) as XLA collectives, for programs that hold them.

A program holding them runs as one SPMD program over its group's devices (``compile/spmd.py``,
for groups on the XLA transport): inside it each shard is one rank's value and the group is the
mesh axis ``AXIS``, so these are ``lax.psum`` / ``all_gather`` / ``psum_scatter`` /
``all_to_all`` over that axis, reducing as the host transport does (AVG: the sum divided by the
group size). ``wait_tensor`` is the identity: inside a program XLA orders the collective before
its uses. ``all_to_all_single`` takes equal splits only (the caller keeps uneven ones out of
programs). Registered by ``register()`` (called by ``torchtpu.distributed``), after the eager
kernels are made from the table: eagerly these ops keep PyTorch's own kernels, which call the
process group.
"""

from __future__ import annotations

import jax.numpy as jnp
import torch
from jax import lax

from torchtpu import errors
from torchtpu.lowering.registry import lowers

AXIS = "g"
c10d = torch.ops._c10d_functional


def _size():
    return lax.axis_size(AXIS)


def _reduce(x, reduce_op: str):
    op = reduce_op.lower()
    if x.dtype == jnp.bool_ and op in ("sum", "max", "bor"):
        return lax.pmax(x.astype(jnp.uint8), AXIS).astype(jnp.bool_)
    if op in ("sum", "avg"):
        total = lax.psum(x, AXIS)
        return (total / _size()).astype(x.dtype) if op == "avg" else total
    if op in ("max", "min"):
        return (lax.pmax if op == "max" else lax.pmin)(x, AXIS)
    if op == "product":
        return jnp.prod(lax.all_gather(x, AXIS), axis=0).astype(x.dtype)
    raise NotImplementedError(errors.message(
        "unsupported", f"a compiled all_reduce with reduce_op {reduce_op!r} (sum, avg, max, min "
        "and product run inside programs)"))


def all_reduce(x, reduce_op: str, group_name):
    return _reduce(x, reduce_op)


def all_gather_into_tensor(x, group_size: int, group_name):
    return lax.all_gather(x, AXIS, axis=0, tiled=True)


def reduce_scatter_tensor(x, reduce_op: str, group_size: int, group_name):
    op = reduce_op.lower()
    if op not in ("sum", "avg"):
        rows = lax.all_to_all(x.reshape(group_size, -1), AXIS, 0, 0, tiled=True)
        rows = rows.reshape(group_size, x.shape[0] // group_size, *x.shape[1:])
        fold = {"max": jnp.max, "min": jnp.min, "product": jnp.prod}.get(op)
        if fold is None:
            raise NotImplementedError(errors.message(
                "unsupported", f"a compiled reduce_scatter with reduce_op {reduce_op!r}"))
        return fold(rows, axis=0).astype(x.dtype)
    mine = lax.psum_scatter(x, AXIS, scatter_dimension=0, tiled=True)
    return (mine / group_size).astype(x.dtype) if op == "avg" else mine


def all_to_all_single(x, output_split_sizes, input_split_sizes, group_name):
    n = _size()
    for splits in (output_split_sizes, input_split_sizes):
        if splits and len(set(int(s) for s in splits)) != 1:
            raise NotImplementedError(errors.message(
                "unsupported", f"a compiled all_to_all_single with uneven splits {list(splits)} "
                "(equal splits run inside programs)"))
    return lax.all_to_all(x, AXIS, 0, 0, tiled=True) if n > 1 else x


def broadcast(x, src: int, group_name):
    picked = jnp.where(lax.axis_index(AXIS) == src, x, jnp.zeros_like(x))
    if x.dtype == jnp.bool_:
        return lax.pmax(picked.astype(jnp.uint8), AXIS).astype(jnp.bool_)
    return lax.psum(picked, AXIS)


def wait_tensor(x):
    return x


def register() -> None:
    """Put the functional collectives into the lowering table (idempotent)."""
    from torchtpu.lowering.registry import lookup

    if lookup(c10d.all_reduce.default) is not None:
        return
    lowers(c10d.all_reduce.default)(all_reduce)
    lowers(c10d.all_gather_into_tensor.default)(all_gather_into_tensor)
    lowers(c10d.reduce_scatter_tensor.default)(reduce_scatter_tensor)
    lowers(c10d.all_to_all_single.default)(all_to_all_single)
    lowers(c10d.broadcast.default)(broadcast)
    lowers(c10d.wait_tensor.default)(wait_tensor)
    lowers(c10d.all_reduce_coalesced.default)(
        lambda xs, reduce_op, group_name: [_reduce(x, reduce_op) for x in xs])
    lowers(c10d.all_gather_into_tensor_coalesced.default)(
        lambda xs, group_size, group_name: [all_gather_into_tensor(x, group_size, group_name)
                                            for x in xs])
    lowers(c10d.reduce_scatter_tensor_coalesced.default)(
        lambda xs, reduce_op, group_size, group_name: [
            reduce_scatter_tensor(x, reduce_op, group_size, group_name) for x in xs])
