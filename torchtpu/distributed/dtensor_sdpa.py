"""DTensor sharding rules for the tpu's fused SDPA op, so tensor-parallel attention runs fused.

On tpu ``F.scaled_dot_product_attention`` becomes ``aten._scaled_dot_product_fused_attention_
overrideable`` (``eager/sdpa_routing.py``), also for DTensors, and PyTorch registers sharding
rules only for CUDA's flash and efficient forms. These are the same rules for the overrideable
pair, on each mesh dimension: everything replicated; q, k, v (and so out, logsumexp and their
gradients) sharded on the heads dim (tensor parallelism); or all sharded on the batch dim. A
mask shards with them where it has that dim, and is replicated where it is broadcast over it
(its gradient is then a partial sum). ``register()`` runs when ``torch.distributed.tensor`` is
first imported.
"""

from __future__ import annotations

import torch

aten = torch.ops.aten


def _mask_placements(mask, dim: int):
    """(the mask's placement, its gradient's) when q, k, v are sharded on dim."""
    from torch.distributed.tensor import Partial, Replicate, Shard

    if mask is None:
        return None, None
    if mask.ndim == 4 and mask.shape[dim] > 1:
        return Shard(dim), Shard(dim)
    return Replicate(), Partial()


def _forward_rules(op_schema) -> list:
    from torch.distributed.tensor import Replicate, Shard

    mask = op_schema.args_schema[3] if len(op_schema.args_schema) > 3 else None
    rules = []
    for dim in (None, 1, 0):  # replicated, heads (tensor parallel), batch
        p = Replicate() if dim is None else Shard(dim)
        m = Replicate() if dim is None else _mask_placements(mask, dim)[0]
        # out, logsumexp, cum_seq_q, cum_seq_k, max_q, max_k, philox_seed, philox_offset,
        # debug mask (None: never asked for), then the inputs q, k, v and the mask.
        rule = [p, p, None, None, None, None, Replicate(), Replicate(), None, p, p, p]
        rules.append(rule + ([m] if mask is not None else []))
    return rules


def _backward_rules(op_schema) -> list:
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor._op_schema import OpStrategy

    args = op_schema.args_schema
    mask = args[4]
    # Tensor inputs: grad_out, q, k, v, [mask], out, logsumexp, [cum_seq_q, cum_seq_k],
    # philox_seed, philox_offset.
    cum = sum(isinstance(a, OpStrategy) for a in args[8:10])
    rules = []
    for dim in (None, 1, 0):
        p = Replicate() if dim is None else Shard(dim)
        m, dm = (Replicate(), Replicate()) if dim is None else _mask_placements(mask, dim)
        rule = [p, p, p, dm if mask is not None else None, p, p, p, p]
        if mask is not None:
            rule.append(m)
        rules.append(rule + [p, p] + [Replicate()] * (cum + 2))
    return rules


def register() -> None:
    """Register both rules with DTensor's sharding propagator (idempotent)."""
    from torch.distributed.tensor._op_schema import RuntimeSchemaInfo
    from torch.distributed.tensor._ops.utils import (
        expand_to_full_mesh_op_strategy,
        register_op_strategy,
    )

    forward = aten._scaled_dot_product_fused_attention_overrideable.default
    backward = aten._scaled_dot_product_fused_attention_overrideable_backward.default

    @register_op_strategy(forward, schema_info=RuntimeSchemaInfo(4))
    def forward_strategy(op_schema):
        return expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(), op_schema, _forward_rules(op_schema), input_index=9)

    @register_op_strategy(backward)
    def backward_strategy(op_schema):
        return expand_to_full_mesh_op_strategy(
            op_schema.get_mesh_from_args(validate=False), op_schema, _backward_rules(op_schema),
            input_index=4)
