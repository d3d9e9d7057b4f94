"""A compiled graph that holds collectives, run as one SPMD program over its group's devices.

Each rank calls the graph with its own tensors. The program is a ``shard_map`` over the group's
1-D mesh (axis ``lowering.collectives.AXIS``): every array argument becomes the global array
whose shard on each device is that rank's value (no copy; a scalar travels as one element), the
graph runs per shard with the lowering table (the collectives become XLA collectives over the
axis), and each rank keeps its own shard of every result. Python numbers stay replicated
arguments: they are the graph's own constants, the same on every rank.

``Spmd`` comes from the layer that owns the groups (``torchtpu.distributed``): the mesh, and
``check``, which each rank calls with the program's collective signature before its first run,
so ranks whose programs hold different collectives raise instead of deadlocking.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torchtpu.lowering.collectives import AXIS

_KEEP = object()  # an argument passed as it is (a replicated Python number)


@dataclasses.dataclass(frozen=True)
class Spmd:
    """Where a graph's collectives run: the group's mesh and its first-run signature check."""

    mesh: Mesh
    check: Callable[[bytes], None]

    @property
    def size(self) -> int:
        return self.mesh.devices.size

    def _global(self, leaf):
        if not isinstance(leaf, (jax.Array, np.ndarray, np.generic)):
            return leaf  # a Python number: replicated
        if not isinstance(leaf, jax.Array):
            leaf = jax.device_put(np.asarray(leaf).reshape(np.shape(leaf) or (1,)),
                                  self._local_device())
        elif leaf.ndim == 0:
            leaf = leaf.reshape(1)
        block = tuple(leaf.shape)
        return jax.make_array_from_single_device_arrays(
            (self.size * block[0], *block[1:]), NamedSharding(self.mesh, P(AXIS)), [leaf])

    def _local_device(self):
        mine = [d for d in self.mesh.devices.flat if d.process_index == jax.process_index()]
        return mine[0]

    def to_global(self, args: tuple) -> tuple:
        """The program's arguments: each rank's arrays as global arrays over the mesh."""
        return jax.tree.map(self._global, args)

    def body(self, fn: Callable, args: tuple) -> tuple[Callable, list]:
        """fn (taking ``args``, this rank's arguments, returning a list of arrays) as one
        shard_map over the mesh; and the list that tracing fills with which outputs are
        scalars."""
        local = jax.tree.map(lambda a: tuple(np.shape(a)) if _is_array(a) else _KEEP, args)
        specs = jax.tree.map(lambda a: P(AXIS) if _is_array(a) else P(), args)
        scalars: list = []

        def per_shard(*shards):
            shards = jax.tree.map(lambda x, s: x if s is _KEEP else x.reshape(s), shards, local)
            outs = list(fn(*shards))
            # Results that are no values (a DTensor's DeviceMesh) pass around the program.
            scalars[:] = [_Passed(o) if not _is_value(o) else jax.numpy.ndim(o) == 0
                          for o in outs]
            values = [jax.numpy.asarray(o) for o in outs if _is_value(o)]
            return [v.reshape(1) if v.ndim == 0 else v for v in values]

        return jax.shard_map(per_shard, mesh=self.mesh, in_specs=specs, out_specs=P(AXIS),
                             check_vma=False), scalars

    @staticmethod
    def compile(lowered):
        """The lowered program compiled. The persistent cache never writes it (it spans several
        processes: ``compile_cache.spans_processes``); a compile option of its own (at its
        default value) also keeps it off keys that entries were written under before."""
        return lowered.compile(compiler_options={"xla_dump_hlo_as_text": False})

    @staticmethod
    def to_local(outs: list, scalars: list) -> list:
        """This rank's shard of each result, a scalar back to shape ()."""
        shards = iter(o.addressable_data(0) for o in outs)
        return [kind.value if isinstance(kind, _Passed) else
                next(shards).reshape(()) if kind else next(shards) for kind in scalars]


@dataclasses.dataclass(frozen=True)
class _Passed:
    value: object


def _is_value(o) -> bool:
    return isinstance(o, (jax.Array, np.ndarray, np.generic, int, float, bool, complex)) \
        or isinstance(o, jax.core.Tracer)


def _is_array(a) -> bool:
    return isinstance(a, (jax.Array, np.ndarray, np.generic))
