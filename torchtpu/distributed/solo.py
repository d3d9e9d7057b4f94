"""A process group of one process, with no transport: every collective is a local copy.

gloo, which ``tpu_dist`` moves host data through and which vLLM asks for beside every device
group, opens a TCP device even for a group of one process; a machine that refuses internet
sockets (a sandboxed TPU host refuses them all, loopback included) then cannot make any group.
A group of one needs no peer, so :class:`SoloGroup` serves it: a reduction leaves its tensors as
they are, a gather or scatter copies the one rank's input to its output, a barrier returns.

``tpu_solo`` is its backend name (registered with :func:`register`), for callers that name a
backend for a group that is known to hold one process (vLLM's CPU groups at world size 1:
``torchtpu/integrations/vllm/worker.py``).
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from torchtpu.distributed.work import Done

BACKEND = "tpu_solo"


def _copy(out: torch.Tensor, source: torch.Tensor) -> None:
    if out is not source:
        out.copy_(source.reshape(out.shape))


class SoloGroup(dist.ProcessGroup):
    """Rank 0 of a group of one: collectives without communication (see the module doc).

    It also stands where c10d asks a group for its device backend (``tpu_dist``'s
    ``_get_backend``), which c10d asks what a backend supports."""

    supports_splitting = supports_coalescing = supports_time_estimate = False

    def __init__(self, rank: int = 0, size: int = 1) -> None:
        if size != 1 or rank != 0:
            raise ValueError(f"torchtpu.distributed: a SoloGroup holds one process (rank 0 of "
                             f"1), not rank {rank} of {size}")
        super().__init__(rank, size)
        self._name = self._desc = ""

    def getBackendName(self) -> str:  # noqa: N802 (c10d's names)
        return BACKEND

    def setGroupName(self, name: str) -> None:  # noqa: N802
        self._name = name

    def getGroupName(self) -> str:  # noqa: N802
        return self._name

    def setGroupDesc(self, desc: str) -> None:  # noqa: N802
        self._desc = desc

    def getGroupDesc(self) -> str:  # noqa: N802
        return self._desc

    # reductions and broadcasts of one rank leave their tensors as they are
    def allreduce(self, tensors: list, opts=None) -> dist.Work:
        return Done(tensors)

    def allreduce_coalesced(self, tensors: list, opts=None) -> dist.Work:
        return Done(tensors)

    def reduce(self, tensors: list, opts=None) -> dist.Work:
        return Done(tensors)

    def broadcast(self, tensors: list, opts=None) -> dist.Work:
        return Done(tensors)

    # gathers, scatters and exchanges: the one rank's input is its output
    def allgather(self, outputs: list, inputs: list, opts=None) -> dist.Work:
        for outs, inp in zip(outputs, inputs):
            _copy(outs[0], inp)
        return Done(outputs)

    def _allgather_base(self, output: torch.Tensor, input: torch.Tensor,
                        opts=None) -> dist.Work:
        _copy(output, input)
        return Done([output])

    gather = allgather  # to the one rank, a gather is its allgather

    def scatter(self, outputs: list, inputs: list, opts=None) -> dist.Work:
        for out, ins in zip(outputs, inputs):
            _copy(out, ins[0])
        return Done(outputs)

    reduce_scatter = scatter
    _reduce_scatter_base = _allgather_base

    def alltoall(self, outputs: list, inputs: list, opts=None) -> dist.Work:
        for out, inp in zip(outputs, inputs):
            _copy(out, inp)
        return Done(outputs)

    def alltoall_base(self, output: torch.Tensor, input: torch.Tensor, output_split_sizes,
                      input_split_sizes, opts=None) -> dist.Work:
        _copy(output, input)
        return Done([output])

    def barrier(self, opts=None) -> dist.Work:
        return Done([])

    def _refuse_p2p(self, *args, **kwargs) -> dist.Work:
        raise RuntimeError("torchtpu.distributed: a group of one process has no peer to send "
                           "to or receive from")

    send = recv = recv_anysource = _refuse_p2p


def _create(options, backend_options=None) -> SoloGroup:
    return SoloGroup(options.group_rank, options.group_size)


def register() -> None:
    """Register ``tpu_solo`` with torch.distributed for CPU and tpu tensors; idempotent."""
    if BACKEND.upper() not in dist.Backend._plugins:
        dist.Backend.register_backend(BACKEND, _create, extended_api=True,
                                      devices=["cpu", "tpu"])
