"""Point-to-point on tpu tensors: send, recv (from a named rank or any), batched isend/irecv.

Both sides post their headers and return; nothing blocks until ``wait()``, so ranks may post
sends and receives in any order and then wait (``batch_isend_irecv``, ring exchanges). A send
posts its header (dtype, shape, bytes), its data and the receive of the receiver's header; a
recv posts its own header (what it expects) and the receive of the sender's. Waiting compares
the two on each side (a send does not wait for its data to arrive: it sent a copy). When they
agree the recv receives the data; when they do not, it receives the sender's bytes into
scratch (so the channel stays in step) and both sides raise ``CollectiveMismatchError`` naming
both. A recv receives its data only after the recvs posted before it from the same peer and tag
did, so data meets its recvs in the order of the calls, as in gloo. Headers travel under tags
of their own (the user's tag plus ``_SENT`` or ``_EXPECTED``), so they never meet data
messages. A recv from any source learns its sender from the first header: it blocks at the
call until one arrives.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.distributed as dist

from torchtpu.distributed import host, protocol
from torchtpu.distributed.work import Later, Pending

_TAG_BITS = 29
_SENT, _EXPECTED = 1 << _TAG_BITS, 2 << _TAG_BITS


def _check_tag(tag: int) -> None:
    if not 0 <= tag < 1 << _TAG_BITS:
        raise ValueError(f"torchtpu.distributed: tpu_dist: send/recv tag {tag} is out of range; "
                         f"use a tag in [0, 2**{_TAG_BITS})")


def _header(t: torch.Tensor) -> np.ndarray:
    return protocol.header(0, "send", t, payload=t.numel() * t.element_size())


def _mismatch(rank: int, peer: int, sent: np.ndarray, expected: np.ndarray, sender: bool
              ) -> protocol.CollectiveMismatchError:
    sent, expected = protocol.describe_tensor(sent), protocol.describe_tensor(expected)
    what = f"rank {rank} sent {sent} to rank {peer}, which expected {expected}" if sender \
        else f"rank {rank} expected {expected} from rank {peer}, but it sent {sent}"
    return protocol.CollectiveMismatchError(
        f"torchtpu.distributed: tpu_dist: {what}; send and recv must agree on shape and dtype")


def _agree(a: np.ndarray, b: np.ndarray) -> bool:
    return np.array_equal(a[4:], b[4:])  # dtype, shape and bytes; not the call number


class PointToPoint:
    """send/recv/recv_anysource of ``TpuProcessGroup`` (whose ``GroupCore`` provides ``_gloo``,
    ``_comm``, ``_devices``, ``_wait``, ``_note``, ``_deliveries`` (a ``CommThread`` that waits
    for sent data) and ``_last_recv``: each (peer, tag)'s latest recv)."""

    def send(self, tensors: list[torch.Tensor], dst: int, tag: int) -> dist.Work:
        if not self._devices(tensors):
            return self._gloo.send(tensors, dst, tag)
        _check_tag(tag)
        self._comm.drain()  # after the collectives before it
        (t,) = tensors
        words = _header(t)
        expected = torch.empty(protocol.HEADER_BYTES // 8, dtype=torch.int64)
        works = [self._gloo.send([torch.from_numpy(words)], dst, tag + _SENT),
                 self._gloo.recv([expected], dst, tag + _EXPECTED)]
        # The data arrives when the recv is waited for; the sender need not wait for that (its
        # buffer is a copy): the group's delivery thread holds the transfer until it completes.
        data = self._gloo.send([host.to_host(t)], dst, tag)
        self._deliveries.submit(data.wait, Pending([], "send"))

        def finish() -> int:
            for work in works:
                self._wait("send", work)
            if not _agree(words, expected.numpy()):
                raise _mismatch(self.rank(), dst, words, expected.numpy(), sender=True)
            return dst

        return self._note(Later("send", finish, tensors, works))

    def recv(self, tensors: list[torch.Tensor], src: int, tag: int) -> dist.Work:
        if not self._devices(tensors):
            return self._gloo.recv(tensors, src, tag)
        return self._recv(tensors, src, tag)

    def recv_anysource(self, tensors: list[torch.Tensor], tag: int) -> dist.Work:
        if not self._devices(tensors):
            return self._gloo.recv_anysource(tensors, tag)
        return self._recv(tensors, None, tag)

    def _recv(self, tensors: list[torch.Tensor], src: int | None, tag: int) -> dist.Work:
        _check_tag(tag)
        self._comm.drain()
        (t,) = tensors
        words = _header(t)
        sent = torch.empty(protocol.HEADER_BYTES // 8, dtype=torch.int64)
        if src is None:
            heard = self._gloo.recv_anysource([sent], tag + _SENT)
            self._wait("recv", heard)
            src = heard._source_rank()
            heard = None  # waited for: a gloo receive waited for again waits for another message
        else:
            heard = self._gloo.recv([sent], src, tag + _SENT)
        told = self._gloo.send([torch.from_numpy(words)], src, tag + _EXPECTED)
        before = self._last_recv.get((src, tag))

        def finish() -> int:
            if before is not None:
                try:
                    before.wait()
                except Exception:  # noqa: BLE001 (raised where that recv is waited for)
                    pass
            if heard is not None:
                self._wait("recv", heard)
            self._wait("recv", told)
            theirs = sent.numpy()
            if not _agree(theirs, words):
                scratch = torch.empty(protocol.payload(theirs), dtype=torch.uint8)
                self._wait("recv", self._gloo.recv([scratch], src, tag))
                raise _mismatch(self.rank(), src, theirs, words, sender=False)
            buf = torch.empty_like(t, device="cpu")
            self._wait("recv", self._gloo.recv([buf], src, tag))
            host.write(t, buf)
            return src

        work = Later("recv", finish, tensors, [told] if heard is None else [heard, told])
        self._last_recv[(src, tag)] = work
        return self._note(work)
