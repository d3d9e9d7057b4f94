"""The XLA transport: tpu_dist collectives as XLA collective programs over the group's devices.

Each process drives one device of JAX's global device list (``jax_runtime`` starts the
multi-process runtime); a group's devices, in group-rank order, form a 1-D mesh with axis
``"g"``. A collective assembles the global array whose shard on each device is that rank's
value (``jax.make_array_from_single_device_arrays``, no copy), runs one jitted ``shard_map``
over the mesh (``psum``, ``psum_scatter``, ``all_gather``, ``all_to_all``), and stores this
process's shard of the result into the output tensor. On a TPU that is ICI, on GPUs NVLink, on
XLA:CPU JAX's gloo collectives. Programs are built once per (op, shapes, dtype, reduce op,
group). They run on the caller's thread: the header exchange waits for the other ranks, then
JAX dispatches the program asynchronously, so the returned Work is done while the device still
runs the collective (later ops on the result queue behind it on the device).

The header exchange (``protocol``, through the group's gloo group) still runs first, so ranks
that called different collectives raise ``CollectiveMismatchError`` before any XLA collective
starts, and a rank that is missing makes the others time out in Python. all_to_all_single with
uneven splits runs one padded program (``uneven``). gather, scatter, point-to-point, all_to_all
with lists and CPU tensors keep the host transport (``TpuProcessGroup``, which this extends).

Inside a graph capture (``torch.tpu.graph``, a whole-step ``torch.compile``) a collective runs
nothing: after the same header exchange it is recorded into the capture as its per-shard
computation over the mesh axis, and the captured step becomes one SPMD program over this
group's mesh (``eager/spanning.py``), the collectives inside it with the step's compute.
Programs holding this group's collectives (captured or compiled graphs) run where ``spmd``
says, and ``check_program`` compares their collective signatures across ranks at first run.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
import torch
import torch.distributed as dist
from jax import lax
from jax._src import core as jax_core
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P
from torch._C._distributed_c10d import ReduceOptions

from torchtpu.device import launch, ownership, tensors
from torchtpu.device.hooks import HOOKS
from torchtpu.distributed import host, uneven
from torchtpu.distributed.group import TpuProcessGroup
from torchtpu.distributed.group_core import coalesced
from torchtpu.distributed.protocol import ANY_SHAPE, CollectiveMismatchError
from torchtpu.distributed.work import Done
from torchtpu.eager.spmd import Spmd, axis_of, standins
from torchtpu.lowering.collectives import AXIS as _AXIS
from torchtpu.runtime import platform

RedOpType = dist.ReduceOp.RedOpType
_SUMS = (RedOpType.SUM, RedOpType.AVG, RedOpType.PREMUL_SUM)
_FOLD = {
    RedOpType.SUM: jnp.sum, RedOpType.AVG: jnp.sum, RedOpType.PREMUL_SUM: jnp.sum,
    RedOpType.PRODUCT: jnp.prod, RedOpType.MIN: jnp.min, RedOpType.MAX: jnp.max,
    RedOpType.BAND: jnp.bitwise_and.reduce, RedOpType.BOR: jnp.bitwise_or.reduce,
    RedOpType.BXOR: jnp.bitwise_xor.reduce,
}
_BITS = {1: jnp.uint8, 2: jnp.uint16, 4: jnp.uint32, 8: jnp.uint64}


def _block(shape: tuple) -> tuple:
    """A rank's shard shape for a value of this shape (a scalar travels as one element)."""
    return shape if shape else (1,)


# ---- the per-shard computations (b: this rank's block, n: the group size, axis: the mesh axis
# the group's devices run along: "g" in its own programs, its axis of a 2-D captured program) ----

def _fold(kind, factor, n: int, rows):
    """Every rank's value (rows[r]) reduced along axis 0, as the host transport reduces them."""
    rows = host.premultiply(kind, factor, rows)
    return host.finish(kind, _FOLD[kind](rows, axis=0).astype(rows.dtype), n)


def _all_reduce(b, *, kind, factor, n, axis=_AXIS):
    if kind in _SUMS and b.dtype != jnp.bool_:
        return host.finish(kind, lax.psum(host.premultiply(kind, factor, b), axis), n)
    if kind in (RedOpType.MIN, RedOpType.MAX) and b.dtype != jnp.bool_:
        return (lax.pmin if kind == RedOpType.MIN else lax.pmax)(b, axis)
    return _fold(kind, factor, n, lax.all_gather(b, axis))


def _reduce_scatter(b, *, kind, factor, n, out, axis=_AXIS):
    rows = b.reshape(n, -1)
    if kind in _SUMS and b.dtype != jnp.bool_:
        mine = lax.psum_scatter(host.premultiply(kind, factor, rows), axis, scatter_dimension=0)
        return host.finish(kind, mine, n).reshape(out)
    # Row r of what all_to_all returns is rank r's chunk for this rank.
    return _fold(kind, factor, n, lax.all_to_all(rows, axis, 0, 0)).reshape(out)


def _broadcast(b, *, root, n, axis=_AXIS):
    if jnp.iscomplexobj(b):
        return lax.all_gather(b, axis)[root]
    # A sum of the root's bits and zeros: exact for every value (-0.0, NaN payloads included).
    bits = lax.bitcast_convert_type(b, _BITS[b.dtype.itemsize]) if b.dtype != jnp.bool_ \
        else b.astype(jnp.uint8)
    bits = lax.psum(jnp.where(lax.axis_index(axis) == root, bits, 0), axis)
    return lax.bitcast_convert_type(bits, b.dtype) if b.dtype != jnp.bool_ \
        else bits.astype(jnp.bool_)


def _all_gather(b, *, out=None, axis=_AXIS):
    rows = lax.all_gather(b, axis)
    return tuple(rows) if out is None else rows.reshape(out)


def _all_to_all(b, *, n, out, axis=_AXIS):
    return lax.all_to_all(b.reshape(n, -1), axis, 0, 0).reshape(out)


_BODIES = {"all_reduce": _all_reduce, "reduce_scatter": _reduce_scatter,
           "broadcast": _broadcast, "all_gather": _all_gather, "all_to_all": _all_to_all,
           "all_to_all_uneven": uneven.captured}


@functools.lru_cache(maxsize=256)
def _mesh(devices: tuple) -> Mesh:
    return Mesh(np.array(devices, dtype=object), (_AXIS,))


@functools.lru_cache(maxsize=1024)
def _program(op: str, devices: tuple, outputs: int | None, **params):
    """The jitted collective op over devices' mesh: one sharded result, or a tuple of
    ``outputs`` of them."""
    mesh = _mesh(devices)
    body = functools.partial(_BODIES[op], **params)
    out_specs = P(_AXIS) if outputs is None else (P(_AXIS),) * outputs
    # check_vma off: every output is per-shard (P("g")), whatever replication JAX could infer.
    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(_AXIS), out_specs=out_specs,
                                 check_vma=False))


def _axis_bound(axis: str) -> bool:
    try:
        lax.axis_size(axis)
    except NameError:
        return False
    return True


class _Recorded:
    """op's per-shard computation on one rank's value, as a call a capture records (the SPMD
    program the capture becomes binds the mesh axis: ``"g"``, or the group's axis of a 2-D
    mesh when the capture spans two groups, asked of ``eager/spmd.axis_of`` by the group's
    ``key`` when the program is traced). Calls of one ``merge_key`` (one group's) whose inputs
    are ready before any of their results is used may run as one collective over their
    concatenated values (``merge``, asked by ``eager/spanning.py``): each cross-process
    collective costs a fixed latency, as ``compile/spmd.combine`` explains for compiled graphs."""

    def __init__(self, op: str, size: int, block: tuple, dtype, key: tuple, params: dict
                 ) -> None:
        self.op, self.size, self.block, self.key, self.params = op, size, block, key, params
        self.nbytes = math.prod(block) * dtype.itemsize
        mergeable = op in ("all_reduce", "reduce_scatter") or (
            op == "all_gather" and params.get("out") is not None)
        self.merge_key = (op, str(dtype), key, tuple(sorted(
            (k, v) for k, v in params.items() if k != "out"))) if mergeable else None

    def __call__(self, value):
        return self._bound(self.params, value.reshape(self.block))

    def _bound(self, params: dict, value):
        if standins():
            return _standin(self.op, value, **{"n": self.size, **params})
        axis = axis_of(self.key)
        body = functools.partial(_BODIES[self.op], **params, axis=axis)
        if _axis_bound(axis):
            return body(value)
        # Recording asks for the result's shape, before any program binds the axis.
        with jax_core.extend_axis_env_nd([(axis, self.size)]):
            return body(value)

    def merge(self, calls: list[_Recorded], values: list) -> list:
        """What each of calls (all of this merge_key) gives for its value, from one collective."""
        n, blocks = self.size, [v.reshape(c.block) for c, v in zip(calls, values, strict=True)]
        if self.op == "reduce_scatter":  # each rank's chunk of every value side by side
            rows = jnp.concatenate([b.reshape(n, -1) for b in blocks], axis=1)
            sizes = [r // n for r in (b.size for b in blocks)]
            done = self._bound({**self.params, "out": (sum(sizes),)}, rows)
        else:
            flat = jnp.concatenate([b.reshape(-1) for b in blocks])
            sizes = [b.size for b in blocks]
            done = self._bound(self.params if self.op == "all_reduce"
                               else {"out": (n, flat.size)}, flat)
        axis = 1 if self.op == "all_gather" else 0  # gathered: [n, sum of sizes]
        parts = jnp.split(done, np.cumsum(sizes)[:-1], axis=axis)
        return [p.reshape(c.params.get("out") or c.block) for c, p in zip(calls, parts)]


def _standin(op: str, b, *, n: int, out=None, **_):
    """Local work in place of op's collective, reading and writing as many bytes on this
    device (``bench/sharded.py`` measures a program against itself with these: what the
    collectives cost, and so how much of it XLA overlaps)."""
    if op == "all_reduce":
        return b * n
    if op == "reduce_scatter":
        return b.reshape(n, -1).sum(0).reshape(out)
    if op == "all_gather":
        rows = jnp.broadcast_to(b, (n, *b.shape)) + 0
        return tuple(rows) if out is None else rows.reshape(out)
    if op == "all_to_all_uneven":
        return uneven.captured(b, n=n, exchange=False, **_)
    return b.reshape(out) if out is not None else b  # all_to_all, broadcast


@functools.lru_cache(maxsize=1024)
def _recorded(op: str, size: int, block: tuple, dtype, key: tuple, **params) -> _Recorded:
    return _Recorded(op, size, block, dtype, key, params)


@functools.lru_cache(maxsize=256)
def _reshape(shape: tuple):
    return jax.jit(lambda x: x.reshape(shape))


class XlaProcessGroup(TpuProcessGroup):
    """A tpu_dist group whose bulk collectives run as XLA collectives (see the module doc)."""

    def __init__(self, store: dist.Store, rank: int, size: int, timeout, global_ranks=None
                 ) -> None:
        super().__init__(store, rank, size, timeout, global_ranks)
        # Each rank names its own device: a process that sees several (a TPU host without
        # per-process chip limits) drives the one platform.local_device picked.
        store.set(f"tpu_dist/xla_device/{rank}", str(platform.local_device().id))
        by_id = {d.id: d for d in jax.devices(platform.platform())}
        self._mesh_devices = tuple(by_id[int(store.get(f"tpu_dist/xla_device/{r}"))]
                                   for r in range(size))
        self._sharding = NamedSharding(_mesh(self._mesh_devices), P(_AXIS))

    @property
    def spmd(self) -> Spmd:
        """Where a program holding this group's collectives runs: the group's mesh, and the
        ranks' comparison of its collective signature before its first run."""
        ranks = tuple(self._ranks or range(self.size()))
        return Spmd(mesh=_mesh(self._mesh_devices), check=self.check_program,
                    axes=((self._mesh_devices, _AXIS),), ranks=ranks, gather=self._gather)

    def _gather(self, mine: np.ndarray) -> np.ndarray:
        """Each rank's int64 row (mine on this rank), by group rank: one header exchange."""
        return self._rows(self._exchange("program", None, mine), mine)

    def check_program(self, signature: bytes) -> None:
        """Raise on every rank unless every rank's program has this collective signature."""
        mine = np.frombuffer(signature, np.uint8)
        rows = self._exchange("program", None, mine)[:, : mine.size]
        differ = [r for r in range(self.size()) if not np.array_equal(rows[r], mine)]
        if differ:
            raise CollectiveMismatchError(
                f"torchtpu.distributed: tpu_dist: mismatched compiled programs in process group "
                f"{self._label()!r}: the program this rank (rank {self.rank()}) is about to run "
                f"holds other collectives (ops, shapes, dtypes or order) than rank(s) {differ}'s. "
                "Every rank must compile the same collectives; a rank that traced different "
                "code around them runs a different program.")

    def _shards(self, op: str, inputs: list[torch.Tensor], outputs: int | None = None,
                **params) -> list:
        """This rank's shards of op's program on the inputs: run now, or recorded into the
        graph capture in progress (see the module doc)."""
        capture = HOOKS.capture
        if capture is None:
            return self._run(op, inputs, [host.read_now(t) for t in inputs], outputs, **params)
        (t,) = inputs
        block = _block(tuple(t.shape))
        spmd = self.spmd
        # Which group, as every group along one mesh dim names it: its ranks' offsets.
        dim = tuple(r - min(spmd.ranks) for r in spmd.ranks)
        described = f"{op}({sorted(params.items())}) {outputs} {t.dtype}{list(t.shape)} on {dim}"
        out = capture.record_spanning(spmd, described,
                                      _recorded(op, self.size(), block, t.dtype,
                                                self._mesh_devices, **params),
                                      (tensors.read(t),))
        return [out] if outputs is None else list(out)

    def _run(self, op: str, inputs: list[torch.Tensor], values: list[jax.Array],
             outputs: int | None = None, **params) -> list:
        """op's program on the inputs' values (one global array each); this rank's shards of
        its results."""
        n = self.size()
        args = []
        for t, value in zip(inputs, values):
            block = _block(tuple(t.shape))
            if value.shape != block:
                value = value.reshape(block)
            args.append(jax.make_array_from_single_device_arrays(
                (n * block[0], *block[1:]), self._sharding, [value]))
        fn = _program(op, self._mesh_devices, outputs, **params)
        result = launch.run(op, fn, tuple(args))
        results = (result,) if outputs is None else result
        return [r.addressable_data(0) for r in results]

    def _collective(self, op: str, header: dict, program: str, inputs: list[torch.Tensor],
                    targets: list, result: list, **params) -> dist.Work:
        """The header exchange (``header``: the tensor and fields it names), then the program
        on the inputs, its shards stored into targets (None: this rank keeps nothing).

        All on the caller's thread, in the order of its other work: the program is dispatched
        right after its inputs are read, so no later op can donate an input's buffer before the
        program has it. (Run on the communication thread, as the host transport's bulk
        collectives are, a buffer read here could be donated by the caller's next in-place op
        before the program ran; that version failed DDP runs intermittently.) JAX dispatches
        the program
        asynchronously, so only the header exchange waits for the other ranks."""
        fields = dict(header)
        self._exchange(op, fields.pop("tensor"), **fields)
        shards = self._shards(program, inputs, **params)
        for o, value in zip(targets, shards):
            if o is not None:
                self._write_result(o, value)
        return Done(result)

    @staticmethod
    def _write_result(t: torch.Tensor, value: jax.Array) -> None:
        if tuple(value.shape) != tuple(t.shape):
            value = tensors.call(_reshape(tuple(t.shape)), value) \
                if isinstance(value, ownership.Deferred) else value.reshape(tuple(t.shape))
        tensors.write(t, value)

    # ---- reductions ----

    def _allreduce_one(self, t: torch.Tensor, op) -> dist.Work:
        kind, factor = host.reduce_op(op, t.dtype)
        return self._collective("all_reduce", dict(tensor=t, reduce_op=int(kind)), "all_reduce",
                                [t], [t], [t], kind=kind, factor=factor, n=self.size())

    def reduce(self, tensors: list[torch.Tensor], opts=None) -> dist.Work:
        opts = opts if opts is not None else ReduceOptions()
        if not _on_device(tensors):
            return super().reduce(tensors, opts)
        (t,) = tensors
        kind, factor = host.reduce_op(opts.reduceOp, t.dtype)
        root = opts.rootRank
        return self._collective("reduce", dict(tensor=t, reduce_op=int(kind), root=root),
                                "all_reduce", [t], [t if self.rank() == root else None],
                                tensors, kind=kind, factor=factor, n=self.size())

    def _reduce_scatter_flat(self, op: str, out: torch.Tensor, whole: torch.Tensor,
                             reduce_op) -> dist.Work:
        if whole.numel() != out.numel() * self.size():  # the host path names the problem
            return super()._reduce_scatter_flat(op, out, whole, reduce_op)
        kind, factor = host.reduce_op(reduce_op, out.dtype)
        return self._collective(op, dict(tensor=out, reduce_op=int(kind)), "reduce_scatter",
                                [whole], [out], [out], kind=kind, factor=factor,
                                n=self.size(), out=_block(tuple(out.shape)))

    # ---- gathers ----

    def allgather(self, outputs: list[list[torch.Tensor]], inputs: list[torch.Tensor],
                  opts=None) -> dist.Work:
        (outs,), (t,) = outputs, inputs
        if not _on_device([*outs, t]) or any(o.shape != t.shape or o.dtype != t.dtype
                                             for o in outs):
            return super().allgather(outputs, inputs, opts)
        return self._collective("all_gather", dict(tensor=t), "all_gather", [t], outs,
                                outputs, outputs=len(outs))

    def all_gather_single(self, output: torch.Tensor, input: torch.Tensor,
                          opts=None) -> dist.Work:
        if not _on_device([output, input]) or output.dtype != input.dtype \
                or output.numel() != input.numel() * self.size():
            return super().all_gather_single(output, input, opts)
        # Every shard holds the whole gathered value, in the output's shape.
        return self._collective("all_gather_into_tensor", dict(tensor=input), "all_gather",
                                [input], [output], [output], out=_block(tuple(output.shape)))

    _allgather_base = all_gather_single
    # The base class's coalesced forms call its own all_gather_single: rebind them to this one.
    all_gather_single_coalesced = coalesced(all_gather_single)
    allgather_into_tensor_coalesced = all_gather_single_coalesced

    # ---- one to many ----

    def _broadcast_one(self, t: torch.Tensor, root: int) -> dist.Work:
        return self._collective("broadcast", dict(tensor=t, root=root), "broadcast", [t],
                                [t if self.rank() != root else None], [t], root=root,
                                n=self.size())

    def all_to_all_single(self, output: torch.Tensor, input: torch.Tensor,
                          output_split_sizes: list[int], input_split_sizes: list[int],
                          opts=None) -> dist.Work:
        if not _on_device([output, input]):
            return super().all_to_all_single(output, input, output_split_sizes,
                                             input_split_sizes, opts)
        # Equal splits and shapes on every rank: one XLA all_to_all; uneven ones: the padded
        # program of ``uneven``. Which, every rank learns from the header exchange, so every
        # rank takes the same path.
        n = self.size()
        mine = uneven.row(output, input, output_split_sizes, input_split_sizes, n)
        rows = self._rows(self._exchange("all_to_all_single", input, mine,
                                         shape_rule=ANY_SHAPE), mine)
        how = uneven.agree(rows, self.rank(), self._label())
        if how == uneven.HOST:
            return super().all_to_all_single(output, input, output_split_sizes,
                                             input_split_sizes, opts)
        if how == uneven.EVEN:
            (value,) = self._shards("all_to_all", [input], n=n,
                                    out=_block(tuple(output.shape)))
        elif HOOKS.capture is not None:
            splits = uneven.splits_of(output, input, output_split_sizes, input_split_sizes, n)
            value = self._record_uneven(input, uneven.chunk(rows), splits)
        else:
            value = uneven.run(self._mesh_devices, rows, host.read_now(input),
                               uneven.splits_of(output, input, output_split_sizes,
                                                input_split_sizes, n))
            if value.shape[0] != output.shape[0]:
                value = value[: output.shape[0]]
        self._write_result(output, value)
        return Done([output])

    alltoall_base = all_to_all_single

    def _record_uneven(self, input: torch.Tensor, m: int, splits: np.ndarray):
        """An uneven all_to_all_single recorded into the capture in progress (``uneven``'s
        doc): its description, which the ranks compare, names the chunk, not this rank's
        splits or rows."""
        n, spmd = self.size(), self.spmd
        dim = tuple(r - min(spmd.ranks) for r in spmd.ranks)
        fn = _recorded("all_to_all_uneven", n, tuple(input.shape), input.dtype,
                       self._mesh_devices, n=n, s_in=tuple(int(s) for s in splits[:n]),
                       s_out=tuple(int(s) for s in splits[n:]), m=m)
        described = f"all_to_all_uneven(m={m}) {input.dtype}{list(input.shape[1:])} on {dim}"
        return HOOKS.capture.record_spanning(spmd, described, fn, (tensors.read(input),))


def _on_device(group: list[torch.Tensor]) -> bool:
    return all(t.device.type == "tpu" for t in group)
