"""``xm.all_reduce`` / ``all_gather`` / ``reduce_scatter`` on ``torch.distributed`` (``tpu_dist``).

PyTorch/XLA's replica groups (``groups=[[0, 1], [2, 3]]``) become ``torch.distributed`` sub-groups,
made once per grouping (every rank makes every group, as ``new_group`` needs). Reduce types are
PyTorch/XLA's strings (``xm.REDUCE_SUM`` ...). Semantics follow PyTorch/XLA's documentation: a
tensor passed to ``all_reduce`` gives a new tensor, a list is reduced in place; ``scale``
multiplies the result; with one replica ``all_reduce`` is a copy (no scale, as there).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.distributed as dist

from torchtpu.integrations.torch_xla import runtime

REDUCE_SUM, REDUCE_MUL, REDUCE_AND, REDUCE_OR, REDUCE_MIN, REDUCE_MAX = (
    "sum", "mul", "and", "or", "min", "max")
_OPS = {REDUCE_SUM: dist.ReduceOp.SUM, REDUCE_MUL: dist.ReduceOp.PRODUCT,
        REDUCE_AND: dist.ReduceOp.BAND, REDUCE_OR: dist.ReduceOp.BOR,
        REDUCE_MIN: dist.ReduceOp.MIN, REDUCE_MAX: dist.ReduceOp.MAX}
_groups: dict[tuple, object] = {}


def _op(reduce_type: str) -> dist.ReduceOp:
    if reduce_type not in _OPS:
        raise ValueError(f"torchtpu.argument: reduce_type {reduce_type!r} is not one of "
                         f"{', '.join(map(repr, _OPS))} (xm.REDUCE_SUM ...)")
    return _OPS[reduce_type]


def group(groups: Sequence[Sequence[int]] | None):
    """The process group of this rank for PyTorch/XLA's replica groups (None: every rank)."""
    if not groups:
        return None
    key = tuple(tuple(int(r) for r in g) for g in groups)
    if key not in _groups:
        ranks = sorted(r for g in key for r in g)
        if ranks != list(range(runtime.world_size())):
            raise ValueError(f"torchtpu.argument: groups={[list(g) for g in key]} must hold each "
                             f"of the {runtime.world_size()} ranks exactly once")
        _groups[key], _ = dist.new_subgroups_by_enumeration([list(g) for g in key])
    return _groups[key]


def _size(g) -> int:
    return dist.get_world_size(g) if g is not None else runtime.world_size()


def _reduce_flat(tensors: list[torch.Tensor], op, scale: float, g) -> None:
    """All-reduce tensors in place, one collective per dtype (a flat buffer), then scale."""
    by_dtype: dict[torch.dtype, list[torch.Tensor]] = {}
    for t in tensors:
        by_dtype.setdefault(t.dtype, []).append(t)
    for same in by_dtype.values():
        flat = torch.cat([t.reshape(-1) for t in same])
        dist.all_reduce(flat, op=op, group=g)
        if scale != 1.0:
            flat.mul_(scale)
        for t, part in zip(same, flat.split([t.numel() for t in same])):
            t.copy_(part.view_as(t))


def all_reduce(reduce_type: str, inputs, scale: float = 1.0, groups=None, pin_layout: bool = True):
    """Reduce across replicas: a tensor gives a new tensor, a list is reduced in place."""
    op = _op(reduce_type)
    single = isinstance(inputs, torch.Tensor)
    if runtime.world_size() == 1:
        return inputs.clone() if single else inputs
    g = group(groups)
    if single:
        out = inputs.clone()
        _reduce_flat([out], op, scale, g)
        return out
    _reduce_flat([t for t in inputs], op, scale, g)
    return inputs


def all_gather(value: torch.Tensor, dim: int = 0, groups=None, output=None,
               pin_layout: bool = True, **_) -> torch.Tensor:
    """Every replica's value, concatenated along dim (into output when given)."""
    g = group(groups)
    n = _size(g)
    if n == 1:
        gathered = value.clone()
    else:
        parts = [torch.empty_like(value) for _ in range(n)]
        dist.all_gather(parts, value.contiguous(), group=g)
        gathered = torch.cat(parts, dim=dim)
    if output is not None:
        output.copy_(gathered)
        return output
    return gathered


def reduce_scatter(reduce_type: str, input, scale: float, scatter_dim: int, shard_count: int,
                   groups=None, output=None, pin_layout: bool = True, **_):
    """Reduce across replicas, then keep this replica's shard of scatter_dim (times scale)."""
    op = _op(reduce_type)
    if not isinstance(input, torch.Tensor):
        outs = output if output is not None else [None] * len(input)
        return [reduce_scatter(reduce_type, t, scale, scatter_dim, shard_count, groups, o)
                for t, o in zip(input, outs)]
    g = group(groups)
    n = _size(g)
    if shard_count != n:
        raise ValueError(f"torchtpu.argument: reduce_scatter shard_count={shard_count} but the "
                         f"group has {n} replicas")
    if input.shape[scatter_dim] % n:
        raise ValueError(f"torchtpu.argument: reduce_scatter dimension {scatter_dim} of size "
                         f"{input.shape[scatter_dim]} does not split into {n} shards")
    moved = input.movedim(scatter_dim, 0).contiguous()
    if n == 1:
        shard = moved.clone()
    else:
        shard = moved.new_empty((moved.shape[0] // n, *moved.shape[1:]))
        dist.reduce_scatter_tensor(shard, moved, op=op, group=g)
    if scale != 1.0:
        shard = shard * scale
    shard = shard.movedim(0, scatter_dim)
    if output is not None:
        output.copy_(shard)
        return output
    return shard
