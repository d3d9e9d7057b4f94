"""The tpu_dist process group: torch.distributed's collectives on tpu tensors.

``TpuProcessGroup`` is a Python ``ProcessGroup``: ``dist.*`` calls its methods directly, and
C++ callers (DDP's reducer, the ``_c10d_functional`` ops DTensor and FSDP2 trace) reach them
through PyTorch's trampoline. Every collective first exchanges a header packet
(``protocol``) so mismatched calls raise on every rank; small ones finish inside that packet,
larger ones then move their data through the host transport (``host``). CPU tensors go to the
group's own gloo group when the process group was created for CPU too (``"cpu:gloo,tpu:tpu_dist"``
or no backend named), and are refused otherwise. Collectives complete before they return: a
``Work`` is already done (``wait()`` returns at once, its future holds the tensors).
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

from torchtpu.distributed import host, protocol
from torchtpu.distributed.protocol import ANY_SHAPE, INLINE

_BACKEND_NAME = "tpu_dist"


class Done(dist._Work):
    """A Work for a collective that already ran: ``wait()`` returns at once."""

    def __init__(self, result: list) -> None:
        super().__init__()
        self._result = result
        self._future = torch.futures.Future()
        self._future.set_result(result)

    def wait(self, timeout: datetime.timedelta | None = None) -> bool:
        return True

    def is_completed(self) -> bool:
        return True

    def is_success(self) -> bool:
        return True

    def result(self) -> list:
        return self._result

    def get_future(self) -> torch.futures.Future:
        return self._future


def _coalesced(single):
    """The coalesced form of a (output, input) collective: one call per pair, in order."""

    def run(self, outputs: list, inputs: list, opts=None) -> dist.Work:
        for out, inp in zip(outputs, inputs):
            single(self, out, inp, opts)
        return Done(outputs)

    return run


def _nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class TpuProcessGroup(dist.ProcessGroup):
    def __init__(self, store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
                 global_ranks: list[int] | None = None) -> None:
        super().__init__(rank, size)
        self._timeout = timeout
        self._gloo = dist.ProcessGroupGloo(dist.PrefixStore("tpu_dist/", store), rank, size,
                                           timeout)
        self._seq = 0
        self._ranks = list(global_ranks) if global_ranks else None
        self._cpu_allowed: bool | None = None
        self._name = self._desc = ""

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
                f"torchtpu.distributed: tpu_dist: {op} in process group {self._label()!r} failed: "
                "a rank exited, "
                f"hung past the timeout ({self._timeout.total_seconds():g} s) or called another "
                f"collective: {e}"
            ) from e

    def _exchange(self, op: str, tensor: torch.Tensor | None, payload: np.ndarray | None = None,
                  **fields) -> np.ndarray:
        """The header exchange every collective starts with; the gathered inline payloads."""
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

    # ---- reductions ----

    def allreduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else AllreduceOptions()
        if not self._devices(tensors):
            return self._gloo.allreduce(tensors, opts)
        for t in tensors:
            self._allreduce_one(t, opts.reduceOp)
        return Done(tensors)

    def allreduce_coalesced(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        op = opts.reduceOp if opts is not None else dist.ReduceOp.SUM
        if not self._devices(tensors):
            options = AllreduceOptions()
            options.reduceOp = op
            for t in tensors:
                self._wait("all_reduce", self._gloo.allreduce([t], options))
            return Done(tensors)
        for t in tensors:
            self._allreduce_one(t, op)
        return Done(tensors)

    def _allreduce_one(self, t: torch.Tensor, op) -> None:
        kind, factor = host.reduce_op(op, t.dtype)
        payloads, value = self._start("all_reduce", t, reduce_op=int(kind))
        if value is not None:
            host.write(t, host.reduce_rows(self._rows(payloads, value), kind, factor,
                                           self.size()))
            return
        buf, shared = host.buffer(t)
        host.premultiply(kind, factor, buf)
        options = AllreduceOptions()
        options.reduceOp = host.gloo_op(kind)
        self._wait("all_reduce", self._gloo.allreduce([buf], options))
        host.finish(kind, buf, self.size())
        if not shared:
            host.write(t, buf)

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
        self._reduce_scatter_flat("reduce_scatter", out, whole, opts.reduceOp)
        return Done(outputs)

    def reduce_scatter_single(self, output: torch.Tensor, input: torch.Tensor,
                              opts=None) -> dist.Work:
        opts = opts if opts is not None else ReduceScatterOptions()
        if not self._devices([output, input]):
            return self._gloo._reduce_scatter_base(output, input, opts)
        self._reduce_scatter_flat("reduce_scatter_tensor", output, input, opts.reduceOp)
        return Done([output])

    _reduce_scatter_base = reduce_scatter_single

    reduce_scatter_single_coalesced = _coalesced(reduce_scatter_single)
    reduce_scatter_tensor_coalesced = reduce_scatter_single_coalesced

    def _reduce_scatter_flat(self, op: str, out: torch.Tensor, whole: torch.Tensor,
                             reduce_op) -> None:
        if whole.numel() != out.numel() * self.size():
            raise ValueError(
                f"torchtpu.distributed: tpu_dist: {op}: the input has {whole.numel()} elements, "
                "but the output "
                f"({out.numel()} elements) times the group size ({self.size()}) is "
                f"{out.numel() * self.size()}"
            )
        kind, factor = host.reduce_op(reduce_op, out.dtype)
        self._exchange(op, out, reduce_op=int(kind))
        buf = host.premultiply(kind, factor, host.to_host(whole).reshape(-1))
        shared = host.alias(out)
        result = torch.empty(out.numel(), dtype=out.dtype) if shared is None \
            else shared.reshape(-1)
        options = ReduceScatterOptions()
        options.reduceOp = host.gloo_op(kind)
        self._wait(op, self._gloo._reduce_scatter_base(result, buf, options))
        host.finish(kind, result, self.size())
        if shared is None:
            host.write(out, result)

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
        gathered = self._gather_all("all_gather_into_tensor", input, into=output)
        if gathered is not None:
            host.write(output, gathered)
        return Done([output])

    _allgather_base = all_gather_single

    all_gather_single_coalesced = _coalesced(all_gather_single)
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    def allgather_coalesced(self, outputs, inputs, opts=None) -> dist.Work:
        for outs, inp in zip(outputs, inputs):
            self.allgather([outs], [inp], opts)
        return Done(outputs)

    def _gather_all(self, op: str, t: torch.Tensor, into: torch.Tensor | None = None
                    ) -> np.ndarray | None:
        """Every rank's value of t, stacked: (world, *t.shape); or None once written straight
        into the device tensor ``into`` (a bulk gather whose output can share its buffer)."""
        payloads, value = self._start(op, t)
        if value is not None:
            return self._rows(payloads, value)
        shared = host.alias(into) if into is not None else None
        gathered = torch.empty(self.size() * t.numel(), dtype=t.dtype) if shared is None \
            else shared.reshape(-1)
        self._wait(op, self._gloo._allgather_base(gathered, host.buffer(t)[0].reshape(-1),
                                                  AllgatherOptions()))
        return None if shared is not None else \
            host.as_numpy(gathered).reshape(self.size(), *t.shape)

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
        for t in tensors:
            payloads, value = self._start("broadcast", t, root=opts.rootRank)
            if value is not None:
                if self.rank() != opts.rootRank:
                    host.write(t, self._rows(payloads, value)[opts.rootRank])
                continue
            buf, shared = host.buffer(t)
            options = BroadcastOptions()
            options.rootRank = opts.rootRank
            self._wait("broadcast", self._gloo.broadcast([buf], options))
            if not shared and self.rank() != opts.rootRank:
                host.write(t, buf)
        return Done(tensors)

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

    # ---- point to point and barrier ----

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        if not self._devices(tensors):
            return self._gloo.send(tensors, dst, tag)
        (t,) = tensors
        words = protocol.header(0, "send", t)
        self._wait("send", self._gloo.send([torch.from_numpy(words)], dst, tag))
        verdict = torch.zeros(1, dtype=torch.int64)
        self._wait("send", self._gloo.recv([verdict], dst, tag))
        if verdict.item():
            raise protocol.CollectiveMismatchError(
                f"torchtpu.distributed: tpu_dist: rank {self.rank()} sent "
                f"{protocol.describe(words)} to rank {dst}, "
                f"which expected a tensor of another shape or dtype (see the error on rank "
                f"{dst}); send and recv must agree on shape and dtype"
            )
        self._wait("send", self._gloo.send([host.to_host(t)], dst, tag))
        return Done(tensors)

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        if not self._devices(tensors):
            return self._gloo.recv(tensors, src, tag)
        (t,) = tensors
        theirs = torch.empty(protocol.HEADER_BYTES // 8, dtype=torch.int64)
        self._wait("recv", self._gloo.recv([theirs], src, tag))
        mine = protocol.header(0, "send", t)
        bad = not np.array_equal(theirs.numpy()[4:], mine[4:])
        self._wait("recv", self._gloo.send([torch.tensor([int(bad)])], src, tag))
        if bad:
            raise protocol.CollectiveMismatchError(
                f"torchtpu.distributed: tpu_dist: rank {self.rank()} expected "
                f"{protocol.describe(mine)} from rank "
                f"{src}, but it sent {protocol.describe(theirs.numpy())}; send and recv must "
                f"agree on shape and dtype"
            )
        buf = torch.empty_like(t, device="cpu")
        self._wait("recv", self._gloo.recv([buf], src, tag))
        host.write(t, buf)
        return Done(tensors)

    def recv_anysource(self, tensors, tag):
        raise NotImplementedError(
            "torchtpu.distributed: tpu_dist: recv from any source is not supported; name the "
            "source rank (src=...)"
        )

    def barrier(self, opts=None) -> dist.Work:
        self._exchange("barrier", None)
        return Done([])

    def shutdown(self) -> None:
        self._gloo = None

    def abort(self) -> None:
        self.shutdown()

