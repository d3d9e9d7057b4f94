"""The header every tpu_dist collective exchanges first, so that ranks never run mismatched ones.

Each collective starts with one fixed-size exchange of a packet per rank: a header (call
number, op, reduce op, root, dtype, shape) and, when the data is small, the data itself. Every
rank then compares all headers; any difference raises ``CollectiveMismatchError`` on every rank,
naming this rank's call and the other side's, before any data moves. Because the exchange has
the same size whatever the op, ranks that called different collectives still complete it. Small
collectives (``INLINE`` bytes of data or less) are finished from the packets alone: one exchange,
so their latency stays that of one gloo call.
"""

from __future__ import annotations

import numpy as np
import torch

# Payload bytes carried inside the header packet.
INLINE = 1024
_MAX_DIMS = 6
# seq, op, reduce op, root, dtype, ndim, dims..., shape rule, payload bytes
_WORDS = 6 + _MAX_DIMS + 2
HEADER_BYTES = _WORDS * 8
PACKET_BYTES = HEADER_BYTES + INLINE

OPS = (
    "all_reduce", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "broadcast", "all_to_all", "all_to_all_single", "gather",
    "scatter", "reduce", "barrier", "send", "recv", "program",
)
_OP_CODE = {name: i for i, name in enumerate(OPS)}
# Codes for dtypes: index into this tuple (stable across ranks because it is fixed here).
_DTYPES = (
    torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int8, torch.uint8,
    torch.int16, torch.int32, torch.int64, torch.bool, torch.complex64, torch.complex128,
    torch.uint16, torch.uint32, torch.uint64,
)
_DTYPE_CODE = {d: i for i, d in enumerate(_DTYPES)}
_NO_DTYPE = -1
# Shape rules: the shape must agree across ranks, or only the trailing dims (uneven splits).
SAME_SHAPE, ANY_SHAPE = 0, 1


class CollectiveMismatchError(RuntimeError):
    """Ranks of one group called different collectives (op, shape, dtype, root or order)."""


def header(seq: int, op: str, tensor: torch.Tensor | None, *, reduce_op: int = -1,
           root: int = -1, shape_rule: int = SAME_SHAPE, payload: int = 0) -> np.ndarray:
    """This rank's header words for call number seq."""
    words = np.full(_WORDS, -1, np.int64)
    words[0], words[1], words[2], words[3] = seq, _OP_CODE[op], reduce_op, root
    if tensor is not None:
        words[4] = _DTYPE_CODE.get(tensor.dtype, len(_DTYPES))
        shape = tuple(tensor.shape)
        words[5] = len(shape)
        # Shapes deeper than _MAX_DIMS compare their leading dims and their element count.
        dims = shape if len(shape) <= _MAX_DIMS else (*shape[: _MAX_DIMS - 1], tensor.numel())
        words[6 : 6 + len(dims)] = dims
    else:
        words[4] = _NO_DTYPE
    words[6 + _MAX_DIMS] = shape_rule
    words[7 + _MAX_DIMS] = payload
    return words


def payload(words: np.ndarray) -> int:
    """The payload bytes a header announces."""
    return int(words[7 + _MAX_DIMS])


def describe(words: np.ndarray) -> str:
    """A header in the user's terms: ``all_reduce(SUM) #3 on float32[4, 8]``."""
    op = OPS[int(words[1])] if 0 <= words[1] < len(OPS) else f"op {int(words[1])}"
    extra = []
    if words[2] >= 0:
        extra.append(str(torch.distributed.ReduceOp.RedOpType(int(words[2]))).split(".")[-1])
    if words[3] >= 0:
        extra.append(f"src/dst {int(words[3])}")
    text = f"{op}({', '.join(extra)})" if extra else op
    text += f" call #{int(words[0])}"
    if int(words[4]) != _NO_DTYPE:
        text += f" on {describe_tensor(words)}"
    return text


def describe_tensor(words: np.ndarray) -> str:
    """A header's tensor: ``float32[4, 8]``."""
    code = int(words[4])
    dtype = str(_DTYPES[code]).removeprefix("torch.") if 0 <= code < len(_DTYPES) else "?"
    dims = [int(d) for d in words[6 : 6 + min(int(words[5]), _MAX_DIMS)]]
    return f"{dtype}{dims}"


def _agree(mine: np.ndarray, other: np.ndarray) -> bool:
    if not np.array_equal(mine[:5], other[:5]) or mine[6 + _MAX_DIMS] != other[6 + _MAX_DIMS]:
        return False
    if mine[6 + _MAX_DIMS] == ANY_SHAPE:
        return True
    return np.array_equal(mine[5 : 6 + _MAX_DIMS], other[5 : 6 + _MAX_DIMS])


def check(headers: np.ndarray, rank: int, group: str, ranks: list[int] | None = None) -> None:
    """Raise CollectiveMismatchError unless every rank's header agrees with this rank's."""
    mine = headers[rank]
    if (headers == mine).all():  # the usual case, in one comparison
        return
    for r, other in enumerate(headers):
        if not _agree(mine, other):
            name = (lambda i: f"rank {ranks[i]}") if ranks else (lambda i: f"rank {i}")
            raise CollectiveMismatchError(
                f"torchtpu.distributed: tpu_dist: mismatched collectives in process group "
                f"{group!r}: this rank "
                f"({name(rank)}) called {describe(mine)}, but {name(r)} called "
                f"{describe(other)}. Every rank of a group must call the same collectives, "
                f"in the same order, with the same shapes and dtypes."
            )


def pack(words: np.ndarray, payload: bytes | np.ndarray | None = None) -> np.ndarray:
    """The packet of header words plus up to INLINE payload bytes, as uint8."""
    packet = np.zeros(PACKET_BYTES, np.uint8)
    packet[:HEADER_BYTES] = words.view(np.uint8)
    if payload is not None:
        data = np.frombuffer(payload, np.uint8) if isinstance(payload, bytes) \
            else np.ascontiguousarray(payload).reshape(-1).view(np.uint8)
        packet[HEADER_BYTES : HEADER_BYTES + data.size] = data
    return packet


def unpack(packets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(headers as int64 (world, words), payload bytes (world, INLINE)) of gathered packets."""
    packets = packets.reshape(-1, PACKET_BYTES)
    headers = np.ascontiguousarray(packets[:, :HEADER_BYTES]).view(np.int64)
    return headers, packets[:, HEADER_BYTES:]
