"""TorchTitan 0.3 on torch 2.13: the one call it makes that this torch lacks, and configs of
TorchTitan's own debug models with the attention tpu runs.

TorchTitan 0.3 tracks PyTorch's development branch. After the first training step it lowers every
process group's timeout with ``torch.distributed.set_timeout`` (unconditionally, on any device),
which torch 2.13 does not have; its private ``_set_pg_timeout`` does the same for the groups
whose backend has a timeout to change (gloo, NCCL) and leaves the others alone (tpu_dist has
none: its collectives wait on the host store with the group's own timeout). Everything else
TorchTitan needs is in torchtpu itself or in TorchTitan's settings (docs, TorchTitan), so this
is applied only by the launcher ``python -m torchtpu.titan``, never at import.

TorchTitan's MoE debug models (``deepseek_v3_debugmodel``) ask for ``flex`` attention, which
stops at FlexAttention's device check; ``deepseek_v3_debugmodel_varlen_attn`` is the same model
and training config with ``varlen`` attention, as TorchTitan's own
``llama3_debugmodel_varlen_attn`` is for llama3: ``--module torchtpu.titan --config
deepseek_v3_debugmodel_varlen_attn`` (``torchtpu.titan`` re-exports it; TorchTitan looks configs
up as attributes of the ``--module`` module). This file imports no torchtpu module, so the CPU
reference (``testing/titan.py``) loads it by path and runs the same configs.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Any

import torch.distributed as dist


def _set_timeout(timeout: timedelta, group: dist.ProcessGroup | None = None) -> None:
    backend = dist.get_backend(group)
    if "gloo" in backend or "nccl" in backend:  # the others have nothing to set (module doc)
        dist.distributed_c10d._set_pg_timeout(timeout, group)


def patch() -> None:
    """Give ``torch.distributed`` the ``set_timeout`` TorchTitan calls, where it has none."""
    if not hasattr(dist, "set_timeout"):
        dist.set_timeout = _set_timeout


def main() -> None:
    """``python -m torchtitan.train`` with :func:`patch` applied (arguments from sys.argv)."""
    patch()
    from torchtitan.train import main as train

    train()


def deepseek_v3_debugmodel_varlen_attn() -> Any:
    """TorchTitan's ``deepseek_v3_debugmodel`` (6 layers, 8 routed experts of which 3 per
    token, 2 shared, MLA attention) with ``varlen`` attention (module doc)."""
    from torchtitan.models.deepseek_v3 import model_registry
    from torchtitan.models.deepseek_v3.config_registry import deepseek_v3_debugmodel

    config = deepseek_v3_debugmodel()
    config.model_spec = model_registry("debugmodel", attn_backend="varlen")
    config.training.disable_cuda_graphs = True  # as TorchTitan's llama3 varlen config
    return config
