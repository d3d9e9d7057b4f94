"""A program that holds collectives, run as one SPMD program over its group's devices.

Each rank calls the program with its own tensors. The program is a ``shard_map`` over the
group's 1-D mesh (axis ``lowering.collectives.AXIS``; a capture spanning two groups: their 2-D
mesh, each group's collectives along its axis, ``axis_of``): every array argument becomes the
global array whose shard on each device is that rank's value (no copy; a scalar travels as one
element), the program runs per shard (the collectives become XLA collectives over the axis), and
each rank keeps its own shard of every result. Python numbers stay replicated arguments: they
are the program's own constants, the same on every rank.

``Spmd`` comes from the layer that owns the groups (``torchtpu.distributed``): the mesh, and
``check``, which each rank calls with the program's collective signature before its first run,
so ranks whose programs hold different collectives raise instead of deadlocking. A compiled
program is called through ``Spmd.runner``: this process's arrays straight to JAX's executable
where it allows, so no global array is built at each call (see ``_Runner``). Both a compiled
graph (``compile/spmd.py``) and a capture spanning groups (``eager/spanning.py``) run this way,
so it lives below both.
"""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable

import jax
import numpy as np
from jax._src import core
from jax._src.array import ArrayImpl
from jax.sharding import Mesh, NamedSharding
from jax.sharding import PartitionSpec as P

from torchtpu.lowering.collectives import AXIS

_KEEP = object()  # an argument passed as it is (a replicated Python number)

# The most bytes one combined collective moves (a compiled graph's, ``compile/spmd.combine``,
# and a capture's, ``eager/spanning.py``): big enough that a model's parameters take a few
# buckets, small enough that XLA can still overlap one bucket's transfer with another's compute.
BUCKET_BYTES = 64 << 20



# While a program is traced: each group's key -> the mesh axis its collectives run along.
_AXES: dict = {}


def standins() -> bool:
    """Whether the program being traced runs local stand-ins for its collectives (a
    ``Spmd(local=True)``: what ``bench/sharded.py`` measures a sharded step against)."""
    return _AXES.get("local", False)


def axis_of(key: tuple) -> str:
    """The mesh axis a group's collectives run along in the program being traced (its key:
    its devices in group-rank order); ``AXIS`` in a 1-D program and outside any."""
    return _AXES.get(key, AXIS)


@dataclasses.dataclass(frozen=True)
class Spmd:
    """Where a graph's collectives run: the mesh and the first-run signature check; ``axes``
    pairs each group's key with its mesh axis. A group's own Spmd also carries its global
    ``ranks`` and ``gather`` (each rank's int64 row, by group rank), from which
    ``eager/spanning.py`` builds the 2-D mesh of a capture spanning two groups."""

    mesh: Mesh
    check: Callable[[bytes], None]
    axes: tuple = ()
    ranks: tuple = ()
    gather: Callable | None = dataclasses.field(default=None, compare=False)
    local: bool = False

    @property
    def size(self) -> int:
        return self.mesh.devices.size

    @property
    def _spec(self) -> P:
        """Dim 0 split over every mesh axis: device mesh[i, j] holds block i * cols + j."""
        return P(tuple(self.mesh.axis_names))

    @functools.cached_property
    def _sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self._spec)

    @functools.cached_property
    def _local_device(self):
        return next(d for d in self.mesh.devices.flat if d.process_index == jax.process_index())

    @functools.cached_property
    def _avals(self) -> dict:
        return {}  # (block shape, dtype) -> the global array's aval

    def _global(self, leaf: jax.Array) -> jax.Array:
        """The global array whose shard on this rank's device is leaf (on that device).
        Built directly: ``jax.make_array_from_single_device_arrays`` checks and rearranges
        the shards on every call, ~40 us an argument in a 2-process program, where a captured
        sharded step passes ~120 arguments at every replay."""
        key = (leaf.shape, leaf.dtype)
        aval = self._avals.get(key)
        if aval is None:
            shape = (self.size * leaf.shape[0], *leaf.shape[1:])
            aval = self._avals[key] = core.update_aval_with_sharding(
                core.ShapedArray(shape, leaf.dtype, weak_type=False), self._sharding)
            # The first array of each signature goes through JAX's checks (its device).
            return jax.make_array_from_single_device_arrays(shape, self._sharding, [leaf])
        return ArrayImpl(aval, self._sharding, [leaf], committed=True, _skip_checks=True)

    def to_global(self, args: tuple) -> tuple:
        """The program's arguments: each rank's arrays as global arrays over the mesh (a 0-d
        one as one element); Python numbers as they are (replicated)."""
        leaves, tree = jax.tree.flatten(args)
        at = [i for i, x in enumerate(leaves) if isinstance(x, (jax.Array, np.ndarray, np.generic))]
        for i, x in zip(at, self._locals_in([leaves[i] for i in at]), strict=True):
            leaves[i] = self._global(x)
        return jax.tree.unflatten(tree, leaves)

    def body(self, fn: Callable, args: tuple) -> tuple[Callable, list]:
        """fn (taking ``args``, this rank's arguments, returning a list of arrays) as one
        shard_map over the mesh; and the list that tracing fills with which outputs are
        scalars."""
        local = jax.tree.map(lambda a: tuple(np.shape(a)) if _is_array(a) else _KEEP, args)
        specs = jax.tree.map(lambda a: self._spec if _is_array(a) else P(), args)
        scalars: list = []

        def per_shard(*shards):
            shards = jax.tree.map(lambda x, s: x if s is _KEEP else x.reshape(s), shards, local)
            _AXES.update(self.axes, local=self.local)
            try:
                outs = list(fn(*shards))
            finally:
                _AXES.clear()
            # Results that are no values (a DTensor's DeviceMesh) pass around the program.
            scalars[:] = [_Passed(o) if not _is_value(o) else jax.numpy.ndim(o) == 0
                          for o in outs]
            values = [jax.numpy.asarray(o) for o in outs if _is_value(o)]
            return [v.reshape(1) if v.ndim == 0 else v for v in values]

        return jax.shard_map(per_shard, mesh=self.mesh, in_specs=specs, out_specs=self._spec,
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
        return _locals([o.addressable_data(0) for o in outs], scalars)

    def runner(self, compiled) -> _Runner:
        """compiled (a program of this mesh) as a call on this rank's arguments giving this
        rank's results (see ``_Runner``)."""
        return _Runner(self, compiled)

    def _locals_in(self, leaves: list) -> list:
        """Each argument as this device's array of its shard's shape (a 0-d one as one
        element, all of those in one dispatch)."""
        scalars = []
        for i, leaf in enumerate(leaves):
            if not isinstance(leaf, jax.Array):
                leaf = leaves[i] = jax.device_put(np.asarray(leaf), self._local_device)
            if leaf.ndim == 0:
                scalars.append(i)
        if scalars:
            for i, one in zip(scalars, _lift(*(leaves[i] for i in scalars)), strict=True):
                leaves[i] = one
        return leaves


class _Runner:
    """A compiled SPMD program called with this rank's arguments, ``runner(args, scalars)``,
    giving this rank's results.

    Where JAX's executable allows (no effects, no host callbacks, every argument an array),
    this process's arrays go straight to the executable and its results come back as this
    device's arrays: no global array is built (JAX checks each one it builds, ~40 us an
    argument in a 2-process program, and a captured sharded step passes ~120 at every
    replay). Otherwise through global arrays (``Spmd.to_global`` / ``to_local``). No
    ``__name__``: a profiler names the launch by its label."""

    def __init__(self, spmd: Spmd, compiled) -> None:
        self._spmd, self._compiled = spmd, compiled
        call = getattr(getattr(compiled, "_executable", None), "unsafe_call", None)
        direct = all(hasattr(call, a) for a in ("xla_executable", "kept_var_idx", "mut")) \
            and not (call.ordered_effects or call.has_unordered_effects
                     or call.has_host_callbacks or call.mut)
        self._call = call if direct else None

    def memory_analysis(self):
        """XLA's analysis of one device's memory for the program (the memory limit's)."""
        return self._compiled.memory_analysis()

    def __call__(self, args: tuple, scalars: list) -> list:
        leaves = jax.tree.leaves(args)
        call = self._call
        if call is None or not all(isinstance(x, (jax.Array, np.ndarray, np.generic))
                                   for x in leaves):
            spmd = self._spmd
            return spmd.to_local(list(self._compiled(*spmd.to_global(args))), scalars)
        leaves = self._spmd._locals_in(leaves)
        results = call.xla_executable.execute_sharded(
            [x for i, x in enumerate(leaves) if i in call.kept_var_idx])
        return _locals([o[0] for o in results.disassemble_into_single_device_arrays()],
                       scalars)


def _locals(shards: list, scalars: list) -> list:
    """The program's results from this device's shards: a scalar back to shape () (all of
    them in one dispatch), a passed-around value as it was."""
    kinds = [k for k in scalars if not isinstance(k, _Passed)]  # one per shard
    ones = [s for s, k in zip(shards, kinds, strict=True) if k]
    lowered = iter(_lower(*ones) if ones else ())
    shards_ = iter(shards)
    out = []
    for kind in scalars:
        if isinstance(kind, _Passed):
            out.append(kind.value)
        else:
            shard = next(shards_)
            out.append(next(lowered) if kind else shard)
    return out


@jax.jit
def _lift(*xs):
    """0-d arrays as one-element ones: a global array's shard has at least one dim."""
    return [x.reshape(1) for x in xs]


@jax.jit
def _lower(*xs):
    return [x.reshape(()) for x in xs]


@dataclasses.dataclass(frozen=True)
class _Passed:
    value: object


def _is_value(o) -> bool:
    return isinstance(o, (jax.Array, np.ndarray, np.generic, int, float, bool, complex)) \
        or isinstance(o, jax.core.Tracer)


def _is_array(a) -> bool:
    return isinstance(a, (jax.Array, np.ndarray, np.generic))
