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
before it, and returns a finished ``Work``.
"""

from __future__ import annotations

import datetime

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

from torchtpu.distributed import device_binding, host, peers, protocol
from torchtpu.distributed.p2p import PointToPoint
from torchtpu.distributed.protocol import ANY_SHAPE, INLINE
from torchtpu.distributed.solo import SoloGroup
from torchtpu.distributed.work import CommThread, Done, Joined, Pending

_BACKEND_NAME = "tpu_dist"


def _coalesced(single):
    """The coalesced form of a (output, input) collective: one call per pair, in order."""

    def run(self, outputs: list, inputs: list, opts=None) -> dist.Work:
        works = [single(self, out, inp, opts) for out, inp in zip(outputs, inputs)]
        return self._joined("coalesced collective", works, outputs)

    return run


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TpuProcessGroup(PointToPoint, dist.ProcessGroup):
    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 global_ranks: list[int] | None = None) -> None:
        super().__init__(rank, size)
        self._timeout = timeout
        self._c10d_store, self._bound = store, False
        # a group of one has no peer, and gloo would open a TCP device for none (solo.py)
        self._gloo = (SoloGroup() if size == 1 else
                      dist.ProcessGroupGloo(dist.PrefixStore("tpu_dist/", store), rank, size,
                                            timeout))
        self._seq = 0
        self._ranks = list(global_ranks) if global_ranks else None
        self._cpu_allowed: bool | None = None
        self._name = self._desc = ""
        self._comm = CommThread(f"rank {rank}")
        self._coalescing: list[dist.Work] | None = None
        self._last_recv: dict[tuple[int, int], dist.Work] = {}
        self._deliveries = CommThread(f"rank {rank} deliveries")

    # ---- identity ----

    # c10d names the group after creating it; the base class would store the name on backends,
    # which a Python group has none of, so the name lives here (functional collectives look
    # groups up by it).
    def getBackendName(self) -> str:
        return _BACKEND_NAME

    def setGroupName(self, name: str) -> None:
        self._name = name

    def getGroupName(self) -> str:
        return self._name

    def setGroupDesc(self, desc: str) -> None:
        self._desc = desc

    def getGroupDesc(self) -> str:
        return self._desc

    def _label(self) -> str:
        return self._desc or self._name

    def _get_backend(self, device: torch.device):
        """The backend behind device's collectives: for tpu, the group's gloo group, once
        device is checked to be this process's (``init_process_group(device_id=...)`` asks
        this; see ``device_binding``)."""
        device = torch.device(device)
        if device.type != "tpu":
            return super()._get_backend(device)
        if not self._bound:  # once, on every rank together (c10d asks at the group's creation)
            device_binding.bind(self._c10d_store, self.rank(), self.size(), device, self._timeout)
            self._bound = True
        return self._gloo

    def _serves_cpu(self) -> bool:
        """Whether CPU tensors go to gloo: the group was made for CPU too, or for any device."""
        if self._cpu_allowed is None:
            entry = dist.distributed_c10d._world.pg_map.get(self)
            if entry is None:  # not registered yet: decide at the next call
                return False
            backend = str(entry[0]).lower()
            self._cpu_allowed = "cpu:" in backend or backend == "undefined"
        return self._cpu_allowed

    @property
    def _device_types(self) -> list[torch.device]:
        # c10d reads this to place object collectives (broadcast_object_list...) and barriers.
        tpu = [torch.device("tpu")]
        return [torch.device("cpu"), *tpu] if self._serves_cpu() else tpu

    # ---- what every collective shares ----

    def _devices(self, tensors: list[torch.Tensor]) -> bool:
        """True for tpu tensors, False for CPU ones gloo serves; raises on anything else."""
        kinds = {t.device.type for t in tensors}
        if kinds == {"tpu"}:
            return True
        self._comm.drain()  # gloo serves CPU tensors directly: after the jobs before them
        if kinds != {"cpu"}:
            raise ValueError(
                f"torchtpu.distributed: tpu_dist: a collective got tensors on {sorted(kinds)}; "
                "pass tpu tensors "
                f"(or CPU tensors alone, with backend='cpu:gloo,tpu:tpu_dist')"
            )
        if not self._serves_cpu():
            raise ValueError(
                "torchtpu.distributed: tpu_dist: a collective got CPU tensors, but this process "
                "group serves tpu "
                "tensors only; move them with .to('tpu'), or create the group with "
                "backend='cpu:gloo,tpu:tpu_dist' (or no backend) to serve CPU tensors by gloo"
            )
        return False

    def _wait(self, op: str, work) -> None:
        try:
            work.wait()
        except RuntimeError as e:
            raise dist.DistBackendError(
                f"torchtpu.distributed: tpu_dist: {op} in process group {self._label()!r} failed "
                f"({peers.describe(self._ranks, e)}); a rank that exits, hangs past the timeout "
                f"({self._timeout.total_seconds():g} s) or calls another collective fails it: {e}"
            ) from e

    def _exchange(self, op: str, tensor: torch.Tensor | None, payload: np.ndarray | None = None,
                  **fields) -> np.ndarray:
        """The header exchange every collective starts with; the gathered inline payloads.
        On the caller's thread it first lets the communication thread finish its jobs."""
        self._comm.drain()
        self._seq += 1
        words = protocol.header(self._seq, op, tensor, payload=0 if payload is None
                                else payload.nbytes, **fields)
        mine = torch.from_numpy(protocol.pack(words, payload))
        gathered = torch.empty(self.size() * protocol.PACKET_BYTES, dtype=torch.uint8)
        self._wait(op, self._gloo._allgather_base(gathered, mine, AllgatherOptions()))
        headers, payloads = protocol.unpack(gathered.numpy())
        protocol.check(headers, self.rank(), self._label(), self._ranks)
        return payloads

    def _start(self, op: str, t: torch.Tensor, **fields) -> tuple[np.ndarray, np.ndarray | None]:
        """The header exchange, carrying t's value when it is small: (the gathered payloads,
        t's host value, or None when the data must follow in bulk)."""
        value = host.to_numpy(t) if _nbytes(t) <= INLINE else None
        return self._exchange(op, t, value, **fields), value

    def _rows(self, payloads: np.ndarray, like: np.ndarray) -> np.ndarray:
        """Each rank's inline value, as (world, *like.shape) of like's dtype."""
        rows = np.ascontiguousarray(payloads[:, : like.nbytes]).view(like.dtype)
        return rows.reshape(self.size(), *like.shape)

    def _launch(self, op: str, run, staged: list[host.Staged], result: list) -> dist.Work:
        """run() (a bulk transfer of staged tensors) on the communication thread, returning a
        pending Work; or now, on this thread, when a result must be written through it."""
        def transfer():
            try:
                run()
            finally:
                for s in staged:
                    s.release()

        if all(s.threadable for s in staged):
            work = Pending(result, op)
            self._comm.submit(transfer, work)
            return self._note(work)
        self._comm.drain()
        transfer()
        return Done(result)

    def _joined(self, op: str, works: list[dist.Work], result: list) -> dist.Work:
        """One Work for several: done when every one is, failing with the first failure."""
        unfinished = [w for w in works if not isinstance(w, Done)]
        if not unfinished:
            return Done(result)
        return unfinished[0] if works == unfinished[:1] else Joined(unfinished, result)

    def _note(self, work: dist.Work) -> dist.Work:
        """work, also recorded for ``_end_coalescing`` while coalescing."""
        if self._coalescing is not None:
            self._coalescing.append(work)
        return work

    # c10d's _coalescing_manager(group, device): the Work of everything issued in between.
    def _start_coalescing(self, device: torch.device) -> None:
        self._coalescing = []

    def _end_coalescing(self, device: torch.device) -> dist.Work:
        works, self._coalescing = self._coalescing or [], None
        return self._joined("coalesced collectives", works, [])

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
        if _nbytes(t) <= INLINE:  # finished inside the header exchange
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

    reduce_scatter_single_coalesced = _coalesced(reduce_scatter_single)
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
        if _nbytes(input) <= INLINE:  # finished inside the header exchange
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

    all_gather_single_coalesced = _coalesced(all_gather_single)
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
        if _nbytes(t) <= INLINE:  # finished inside the header exchange
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

