"""``all_to_all_single`` with uneven splits as one XLA program (the XLA transport's).

An XLA all-to-all moves equal blocks, and a program over several processes needs the same
shapes on every rank. Expert parallelism sends each rank a different number of tokens per
expert, and each step other numbers (TorchTitan's MoE dispatch and combine), so the ranks first
agree in the header exchange on a padded layout: ``m`` rows per (sender, receiver) chunk, the
largest chunk any rank sends; every input padded to ``r_in`` rows and every output computed at
``r_out`` rows, the most any rank has. Each of the three is rounded up to a size bucket (at most
1/8 more, ``bucket``), so that the varying counts of a training run reuse a few programs instead
of compiling one per step. The program (one ``shard_map`` over the group's mesh) slices this
rank's chunks into ``[n, m]`` rows by its input splits, runs one ``all_to_all``, and writes the
received chunks in place by its output splits; the splits travel as a small int32 argument, so
new splits in the same buckets run the same program. It moves n * m rows per rank where the
host path moves the real ones, and copies the data a few times on the device: on XLA:CPU it is
slower than the host path for large skewed exchanges (bench/RESULTS.md, session 16); on a TPU
those copies are HBM's and the transfer ICI's, with no trip through host memory.

The exchanged row (``row``) carries each rank's splits when they fit the header's inline
payload (groups of up to 58 ranks): ranks whose splits do not pair up (rank i's output split j
is not rank j's input split i) raise ``CollectiveMismatchError`` on every rank instead of
moving garbage. What the layout cannot serve (splits that do not sum to the tensors' rows,
other trailing dims or dtypes) keeps the host transport, which names the problem.

Inside a graph capture the exchange is recorded as one call (``captured``), this rank's splits
built into it as constants, as the capture takes every Python number: the replay repeats the
captured splits. Each rank's program then has its own input and output rows (its own program:
the ranks compare only the collectives' signature, ``m`` rows a chunk, not the splits, which
the header exchange at capture already paired up); the chunks are sliced and padded by static
bounds, the all_to_all runs over the capture's mesh axis.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import torch
from jax import lax
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torchtpu.device import launch
from torchtpu.distributed.protocol import INLINE, CollectiveMismatchError
from torchtpu.lowering.collectives import AXIS

HOST, UNEVEN, EVEN = 0, 1, 2   # what a rank's tensors allow (the row's first word)
_TRAILING = 7                  # trailing dims carried in the row (deeper tensors: host)
_FIXED = 2 + _TRAILING + 3     # flag, ndim, trailing dims, rows in, rows out, largest chunk


def bucket(n: int) -> int:
    """n rounded up to a size bucket: exact up to 16, then at most 1/8 more."""
    if n <= 16:
        return max(n, 1)
    step = 1 << (n.bit_length() - 4)
    return -(-n // step) * step


def _splits(given: list[int], rows: int, n: int) -> list[int] | None:
    if not given:
        return [rows // n] * n if rows % n == 0 else None
    if len(given) != n or any(s < 0 for s in given) or sum(given) != rows:
        return None
    return [int(s) for s in given]


def row(output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
        input_splits: list[int], n: int) -> np.ndarray:
    """This rank's words for the header exchange: what its tensors allow, their shapes, its
    largest chunk and (when they fit) its splits."""
    ins = _splits(input_splits, input.shape[0], n) if input.dim() else None
    outs = _splits(output_splits, output.shape[0], n) if output.dim() else None
    rest = tuple(input.shape[1:])
    ok = (ins is not None and outs is not None and output.dtype == input.dtype
          and tuple(output.shape[1:]) == rest and len(rest) <= _TRAILING)
    flag = HOST
    if ok:
        even = len(set(ins)) == 1 and len(set(outs)) == 1 and output.numel() == input.numel()
        flag = EVEN if even else UNEVEN
    words = [flag, input.dim(), *rest[:_TRAILING], *[0] * (_TRAILING - len(rest[:_TRAILING])),
             input.shape[0] if input.dim() else 0, output.shape[0] if output.dim() else 0,
             max(ins) if ok else 0]
    if _FIXED + 2 * n <= INLINE // 8:
        words += [*(ins if ok else [0] * n), *(outs if ok else [0] * n)]
    return np.array(words, np.int64)


def agree(rows: np.ndarray, rank: int, label: str) -> int:
    """How every rank runs the collective, from every rank's row (the same on each): ``EVEN``
    (one plain all_to_all), ``UNEVEN`` (the padded program) or ``HOST``."""
    n = rows.shape[0]
    if (rows[:, 0] == HOST).any() or not (rows[:, 1 : 2 + _TRAILING] == rows[0, 1 : 2 + _TRAILING]
                                          ).all():
        return HOST
    if rows.shape[1] > _FIXED:
        ins, outs = rows[:, _FIXED : _FIXED + n], rows[:, _FIXED + n :]
        if not (outs == ins.T).all():
            bad = sorted({int(r) for r in np.argwhere(outs != ins.T)[:, 0]})
            raise CollectiveMismatchError(
                f"torchtpu.distributed: tpu_dist: all_to_all_single in process group {label!r}: "
                f"the split sizes do not pair up: rank i's output_split_sizes[j] must equal "
                f"rank j's input_split_sizes[i]; input splits by rank {ins.tolist()}, output "
                f"splits by rank {outs.tolist()} (rank(s) {bad} expect other sizes; this is "
                f"rank {rank})")
    if (rows[:, 0] == EVEN).all() and (rows[:, _FIXED - 3] == rows[0, _FIXED - 3]).all():
        return EVEN
    return UNEVEN


@functools.lru_cache(maxsize=256)
def _program(devices: tuple, n: int, r_in: int, r_out: int, m: int):
    mesh = Mesh(np.array(devices, dtype=object), (AXIS,))

    def body(b, splits):
        s_in, s_out = splits[:n], splits[n:]
        rest = b.shape[1:]
        # Pack: chunk j is the m rows from its start (rows past its split are whatever
        # follows: padding no one reads), sliced, not gathered (a gather of every row costs
        # ~7x the all_to_all itself on XLA:CPU). m rows of zeros after the input keep every
        # slice inside it.
        b = jnp.concatenate([b, jnp.zeros((m, *rest), b.dtype)])
        starts = jnp.cumsum(s_in) - s_in
        packed = jnp.stack([lax.dynamic_slice_in_dim(b, starts[j], m) for j in range(n)])
        got = lax.all_to_all(packed, AXIS, 0, 0)  # got[j]: rank j's chunk for this rank
        # Unpack: chunk j written at its output start, in order, so that chunk j + 1
        # overwrites chunk j's padding; the last one's lies past this rank's rows.
        at = jnp.cumsum(s_out) - s_out
        out = jnp.zeros((r_out + m, *rest), b.dtype)
        for j in range(n):
            out = lax.dynamic_update_slice_in_dim(out, got[j], at[j], 0)
        return out[:r_out]

    spec = P(AXIS)
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=(spec, spec), out_specs=spec,
                                 check_vma=False)), NamedSharding(mesh, spec)


@functools.lru_cache(maxsize=256)
def _pad(rows: int):
    return jax.jit(lambda x: jnp.pad(x, ((0, rows - x.shape[0]),) + ((0, 0),) * (x.ndim - 1)))


def run(devices: tuple, rows: np.ndarray, value: jax.Array, mine: np.ndarray) -> jax.Array:
    """This rank's output rows of the padded program on value (its input), every rank's row
    given (``row``'s words) and mine (its own splits: input then output)."""
    n = rows.shape[0]
    r_in, r_out = bucket(int(rows[:, _FIXED - 3].max())), bucket(int(rows[:, _FIXED - 2].max()))
    m = bucket(int(rows[:, _FIXED - 1].max()))
    fn, sharding = _program(devices, n, r_in, r_out, m)
    if value.shape[0] != r_in:
        value = _pad(r_in)(value)
    device = next(iter(value.devices()))
    splits = jax.device_put(mine.astype(np.int32), device)
    args = [jax.make_array_from_single_device_arrays((n * a.shape[0], *a.shape[1:]), sharding,
                                                     [a]) for a in (value, splits)]
    return launch.run("all_to_all_uneven", fn, tuple(args)).addressable_data(0)


def chunk(rows: np.ndarray) -> int:
    """The rows of one padded chunk: the largest any rank sends, at least 1 (every rank's row
    given)."""
    return max(int(rows[:, _FIXED - 1].max()), 1)


def captured(b, *, n: int, s_in: tuple, s_out: tuple, m: int, axis: str = AXIS,
             exchange: bool = True):
    """The exchange as a capture records it (``distributed/xla.py``): this rank's input rows
    b, its splits static; ``exchange=False``: the same local work without the all_to_all
    (``bench/sharded.py``'s stand-in)."""
    rest = b.shape[1:]
    starts = np.cumsum((0, *s_in))
    packed = jnp.stack([jnp.pad(b[starts[j] : starts[j] + s_in[j]],
                                ((0, m - s_in[j]),) + ((0, 0),) * len(rest)) for j in range(n)])
    got = lax.all_to_all(packed, axis, 0, 0) if exchange else packed  # got[j]: rank j's chunk
    return jnp.concatenate([got[j, : s_out[j]] for j in range(n)])


def splits_of(output: torch.Tensor, input: torch.Tensor, output_splits: list[int],
              input_splits: list[int], n: int) -> np.ndarray:
    """This rank's input splits then output splits (empty lists: equal shares)."""
    return np.array([*_splits(input_splits, input.shape[0], n),
                     *_splits(output_splits, output.shape[0], n)], np.int64)
