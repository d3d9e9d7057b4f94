"""FSDP2 (``fully_shard``) around an aborted graph capture: its per-step state rolled back.

A captured step (``torch.tpu.graph``, a whole-step ``torch.compile``) runs FSDP2's hooks once
while recording: they all-gather parameters into storages, mark their groups unsharded, claim
the forward's root, queue the post-backward callback. When the capture aborts (a host read
inside the step, after which a whole-step ``torch.compile`` runs the step through Dynamo's
graphs), every storage gets back what it held (``eager/capture.Capture.abort``), but FSDP2's
Python state still says the parameters are gathered: the next forward would skip its
all-gathers and compute with the capture's placeholder arrays, silently wrong. So after an
abort each FSDP2 root whose step state is not clean is reset with ``reset_iter_state()``,
PyTorch's recovery after a failed forward or backward: every group resharded, the step's
trackers cleared (the aborted step's gradients were never computed).
"""

from __future__ import annotations


def _roots() -> list:
    """(module, state) of every live FSDP2 root."""
    from torch.distributed._composable_state import _module_state_mapping
    from torch.distributed.fsdp._fully_shard._fsdp_state import FSDPState

    out = []
    for module, ref in list(_module_state_mapping.items()):
        state = ref()
        if isinstance(state, FSDPState) and state._is_root:
            out.append((module, state))
    return out


def _in_a_step(state) -> bool:
    """Whether a root's step left state behind: a forward it claimed, a queued post-backward
    callback, a module mid-step or a group not sharded."""
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState

    ctx = state._state_ctx
    if ctx.iter_forward_root is not None or ctx.post_backward_final_callback_queued:
        return True
    return any(s._training_state != TrainingState.IDLE
               or any(not g.is_sharded for g in s._fsdp_param_groups)
               for s in ctx.all_states)


def reset_after_abort() -> None:
    """Reset every FSDP2 root that an aborted capture left in a step (see the module doc)."""
    import sys

    if "torch.distributed.fsdp._fully_shard._fsdp_state" not in sys.modules:
        return  # FSDP2 never loaded: no state to roll back
    for _, state in _roots():
        if _in_a_step(state):
            state._reset_iter_state()
