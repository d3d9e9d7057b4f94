"""What every collective of the tpu_dist process group shares: the group's identity (the names
c10d gives it), which device's tensors it serves (tpu; CPU through its gloo group when made for
CPU too), the header exchange each collective starts with (``protocol``), and launching a bulk
transfer on the communication thread (``work``). The collectives themselves are ``group.py``'s.
"""

from __future__ import annotations

import datetime

import numpy as np
import torch
import torch.distributed as dist
from torch._C._distributed_c10d import AllgatherOptions

from torchtpu.distributed import device_binding, host, peers, protocol
from torchtpu.distributed.protocol import INLINE
from torchtpu.distributed.solo import SoloGroup
from torchtpu.distributed.work import CommThread, Done, Joined, Pending

_BACKEND_NAME = "tpu_dist"


def coalesced(single):
    """The coalesced form of a (output, input) collective: one call per pair, in order."""

    def run(self, outputs: list, inputs: list, opts=None) -> dist.Work:
        works = [single(self, out, inp, opts) for out, inp in zip(outputs, inputs)]
        return self._joined("coalesced collective", works, outputs)

    return run


def nbytes(t: torch.Tensor) -> int:
    return t.numel() * t.element_size()


class GroupCore(dist.ProcessGroup):
    """The state and the shared steps of ``TpuProcessGroup`` (``group.py``)."""

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
        value = host.to_numpy(t) if nbytes(t) <= INLINE else None
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
