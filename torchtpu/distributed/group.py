"""The tpu_dist process group: torch.distributed's collectives on tpu tensors.

``TpuProcessGroup`` is a Python ``ProcessGroup``: ``dist.*`` calls its methods directly, and
C++ callers (DDP's reducer, the ``_c10d_functional`` ops DTensor and FSDP2 trace) reach them
through PyTorch's trampoline. Every collective first exchanges a header packet
(``protocol``) so mismatched calls raise on every rank; small ones finish inside that packet,
larger ones then move their data through the host transport (``host``). CPU tensors go to the
group's own gloo group when the process group was created for CPU too (``"cpu:gloo,tpu:tpu_dist"``
or no backend named), and are refused otherwise.

Bulk all_reduce, broadcast, all_gather_into_tensor and reduce_scatter_tensor run on the group's
communication thread (``work``): they return a pending ``Work`` at once, and the transfer
overlaps whatever the caller dispatches next (DDP's backward, between its buckets). Everything
else, and any collective whose result is a view, runs on the caller's thread after the jobs
before it, and returns a finished ``Work``. What the collectives share (identity, device
routing, the header exchange, launching transfers) is ``group_core.py``'s ``GroupCore``.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import (
    AllgatherOptions,
    AllreduceOptions,
    AllToAllOptions,
    BroadcastOptions,
    GatherOptions,
    ReduceOptions,
    ReduceScatterOptions,
    ScatterOptions,
)

from torchtpu.distributed import host
from torchtpu.distributed.group_core import GroupCore, coalesced, nbytes
from torchtpu.distributed.p2p import PointToPoint
from torchtpu.distributed.protocol import ANY_SHAPE, INLINE
from torchtpu.distributed.work import Done


class TpuProcessGroup(PointToPoint, GroupCore):
    """torch.distributed's collectives on tpu tensors (module doc)."""

    # ---- reductions ----

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else AllreduceOptions()
        if not self._devices(tensors):
            return self._gloo.allreduce(tensors, opts)
        works = [self._allreduce_one(t, opts.reduceOp) for t in tensors]
        return self._joined("all_reduce", works, tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if not self._devices(tensors):
            options = AllreduceOptions()
            options.reduceOp = op
            for t in tensors:
                self._wait("all_reduce", self._gloo.allreduce([t], options))
            return Done(tensors)
        works = [self._allreduce_one(t, op) for t in tensors]
        return self._joined("all_reduce", works, tensors)

    def _allreduce_one(self, t: torch.Tensor, op) -> dist.Work:
        kind, factor = host.reduce_op(op, t.dtype)
        if nbytes(t) <= INLINE:  # finished inside the header exchange
            payloads, value = self._start("all_reduce", t, reduce_op=int(kind))
            host.write(t, host.reduce_rows(self._rows(payloads, value), kind, factor,
                                           self.size()))
            return Done([t])
        staged = host.Staged(t, read=True, write=True)

        def run():
            self._exchange("all_reduce", t, reduce_op=int(kind))
            buf = host.premultiply(kind, factor, staged.output(filled=True))
            options = AllreduceOptions()
            options.reduceOp = host.gloo_op(kind)
            self._wait("all_reduce", self._gloo.allreduce([buf], options))
            staged.commit(host.finish(kind, buf, self.size()))

        return self._launch("all_reduce", run, [staged], [t])

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else ReduceOptions()
        if not self._devices(tensors):
            return self._gloo.reduce(tensors, opts)
        (t,) = tensors
        kind, factor = host.reduce_op(opts.reduceOp, t.dtype)
        self._exchange("reduce", t, reduce_op=int(kind), root=opts.rootRank)
        buf = host.premultiply(kind, factor, host.to_host(t))
        options = ReduceOptions()
        options.reduceOp, options.rootRank = host.gloo_op(kind), opts.rootRank
        self._wait("reduce", self._gloo.reduce([buf], options))
        if self.rank() == opts.rootRank:
            host.write(t, host.finish(kind, buf, self.size()))
        return Done(tensors)

    def reduce_scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                       opts=None) -> dist.Work:
        opts = opts if opts is not None else ReduceScatterOptions()
        if not self._devices([*outputs, *inputs[0]]):
            return self._gloo.reduce_scatter(outputs, inputs, opts)
        (out,), (chunks,) = outputs, inputs
        whole = torch.cat([c.reshape(-1) for c in chunks])
        return self._reduce_scatter_flat("reduce_scatter", out, whole, opts.reduceOp)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts=None) -> dist.Work:
        opts = opts if opts is not None else ReduceScatterOptions()
        if not self._devices([output, input]):
            return self._gloo._reduce_scatter_base(output, input, opts)
        return self._reduce_scatter_flat("reduce_scatter_tensor", output, input, opts.reduceOp)

    _reduce_scatter_base = reduce_scatter_single

    reduce_scatter_single_coalesced = coalesced(reduce_scatter_single)
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_flat(self, op: str, out: torch.Tensor, whole: torch.Tensor,
                             reduce_op) -> dist.Work:
        if whole.numel() != out.numel() * self.size():
            raise ValueError(
                f"torchtpu.distributed: tpu_dist: {op}: the input has {whole.numel()} elements, "
                "but the output "
                f"({out.numel()} elements) times the group size ({self.size()}) is "
                f"{out.numel() * self.size()}"
            )
        kind, factor = host.reduce_op(reduce_op, out.dtype)
        source = host.Staged(whole, read=True, write=False)
        target = host.Staged(out, read=False, write=True)

        def run():
            self._exchange(op, out, reduce_op=int(kind))
            buf = source.input().reshape(-1)
            if factor is not None:  # PREMUL_SUM, out of place: buf may be the input's buffer
                buf = buf * factor
            result = target.output().reshape(-1)
            options = ReduceScatterOptions()
            options.reduceOp = host.gloo_op(kind)
            self._wait(op, self._gloo._reduce_scatter_base(result, buf, options))
            target.commit(host.finish(kind, result, self.size()))

        return self._launch(op, run, [source, target], [out])

    # ---- gathers ----

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts=None) -> dist.Work:
        opts = opts if opts is not None else AllgatherOptions()
        if not self._devices([*outputs[0], *inputs]):
            return self._gloo.allgather(outputs, inputs, opts)
        (outs,), (t,) = outputs, inputs
        for o in outs:
            if o.shape != t.shape or o.dtype != t.dtype:
                raise ValueError(
                    f"torchtpu.distributed: tpu_dist: all_gather: every output must be like the "
                    "input "
                    f"({t.dtype}{list(t.shape)}), got {o.dtype}{list(o.shape)}"
                )
        for o, value in zip(outs, self._gather_all("all_gather", t)):
            host.write(o, value)
        return Done(outputs)

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts=None) -> dist.Work:
        opts = opts if opts is not None else AllgatherOptions()
        if not self._devices([output, input]):
            return self._gloo._allgather_base(output, input, opts)
        if output.numel() != input.numel() * self.size() or output.dtype != input.dtype:
            raise ValueError(
                f"torchtpu.distributed: tpu_dist: all_gather_into_tensor: the output "
                f"({output.dtype}"
                f"{list(output.shape)}) must hold group size ({self.size()}) times the input "
                f"({input.dtype}{list(input.shape)})"
            )
        op = "all_gather_into_tensor"
        if nbytes(input) <= INLINE:  # finished inside the header exchange
            host.write(output, self._gather_all(op, input))
            return Done([output])
        source = host.Staged(input, read=True, write=False)
        target = host.Staged(output, read=False, write=True)

        def run():
            self._exchange(op, input)
            result = target.output().reshape(-1)
            self._wait(op, self._gloo._allgather_base(result, source.input().reshape(-1),
                                                      AllgatherOptions()))
            target.commit(result)

        return self._launch(op, run, [source, target], [output])

    _allgather_base = all_gather_single

    all_gather_single_coalesced = coalesced(all_gather_single)
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        for outs, inp in zip(outputs, inputs):
            self.allgather([outs], [inp], opts)
        return Done(outputs)

    def _gather_all(self, op: str, t: torch.Tensor) -> np.ndarray:
        """Every rank's value of t, stacked: (world, *t.shape)."""
        payloads, value = self._start(op, t)
        if value is not None:
            return self._rows(payloads, value)
        gathered = torch.empty(self.size() * t.numel(), dtype=t.dtype)
        source = host.Staged(t, read=True, write=False)
        try:
            self._wait(op, self._gloo._allgather_base(gathered, source.input().reshape(-1),
                                                      AllgatherOptions()))
        finally:
            source.release()
        return host.as_numpy(gathered).reshape(self.size(), *t.shape)

    def gather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
               opts=None) -> dist.Work:
        opts = opts if opts is not None else GatherOptions()
        root = self.rank() == opts.rootRank
        if not self._devices([*(outputs[0] if root else []), *inputs]):
            return self._gloo.gather(outputs, inputs, opts)
        (t,) = inputs
        self._exchange("gather", t, root=opts.rootRank)
        host_outs = [[torch.empty_like(t, device="cpu") for _ in outputs[0]]] if root else []
        options = GatherOptions()
        options.rootRank = opts.rootRank
        self._wait("gather", self._gloo.gather(host_outs, [host.to_host(t)], options))
        if root:
            for o, value in zip(outputs[0], host_outs[0]):
                host.write(o, value)
        return Done(outputs)

    # ---- one to many ----

    def broadcast(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else BroadcastOptions()
        if not self._devices(tensors):
            return self._gloo.broadcast(tensors, opts)
        works = [self._broadcast_one(t, opts.rootRank) for t in tensors]
        return self._joined("broadcast", works, tensors)

    def _broadcast_one(self, t: torch.Tensor, root: int) -> dist.Work:
        if nbytes(t) <= INLINE:  # finished inside the header exchange
            payloads, value = self._start("broadcast", t, root=root)
            if self.rank() != root:
                host.write(t, self._rows(payloads, value)[root])
            return Done([t])
        staged = host.Staged(t, read=self.rank() == root, write=self.rank() != root)

        def run():
            self._exchange("broadcast", t, root=root)
            buf = staged.input() if self.rank() == root else staged.output()
            options = BroadcastOptions()
            options.rootRank = root
            self._wait("broadcast", self._gloo.broadcast([buf], options))
            if self.rank() != root:
                staged.commit(buf)

        return self._launch("broadcast", run, [staged], [t])

    def scatter(self, outputs: list[torch.Tensor], inputs: list[list[torch.Tensor]],
                opts=None) -> dist.Work:
        opts = opts if opts is not None else ScatterOptions()
        root = self.rank() == opts.rootRank
        if not self._devices([*outputs, *(inputs[0] if root else [])]):
            return self._gloo.scatter(outputs, inputs, opts)
        (out,) = outputs
        self._exchange("scatter", out, root=opts.rootRank)
        buf = torch.empty_like(out, device="cpu")
        options = ScatterOptions()
        options.rootRank = opts.rootRank
        chunks = [[host.to_host(c) for c in inputs[0]]] if root else []
        self._wait("scatter", self._gloo.scatter([buf], chunks, options))
        host.write(out, buf)
        return Done(outputs)

    def alltoall(self, outputs: list[torch.Tensor], inputs: list[torch.Tensor],
                 opts=None) -> dist.Work:
        opts = opts if opts is not None else AllToAllOptions()
        if not self._devices([*outputs, *inputs]):
            return self._gloo.alltoall(outputs, inputs, opts)
        self._exchange("all_to_all", inputs[0], shape_rule=ANY_SHAPE)
        bufs = [torch.empty_like(o, device="cpu") for o in outputs]
        self._wait("all_to_all", self._gloo.alltoall(bufs, [host.to_host(t) for t in inputs],
                                                     AllToAllOptions()))
        for o, b in zip(outputs, bufs):
            host.write(o, b)
        return Done(outputs)

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts=None) -> dist.Work:
        opts = opts if opts is not None else AllToAllOptions()
        if not self._devices([output, input]):
            return self._gloo.alltoall_base(output, input, output_split_sizes,
                                            input_split_sizes, opts)
        self._exchange("all_to_all_single", input, shape_rule=ANY_SHAPE)
        buf = torch.empty_like(output, device="cpu")
        self._wait("all_to_all_single", self._gloo.alltoall_base(
            buf, host.to_host(input), output_split_sizes, input_split_sizes, AllToAllOptions()))
        host.write(output, buf)
        return Done([output])

    alltoall_base = all_to_all_single

    # ---- barrier and the group's lifetime (point to point: p2p) ----

    def barrier(self, opts=None) -> dist.Work:
        self._exchange("barrier", None)
        return Done([])

    def shutdown(self) -> None:
        self._comm.drain()
        self._comm.close()
        self._deliveries.close()
        self._gloo = None

    def abort(self) -> None:
        self.shutdown()

