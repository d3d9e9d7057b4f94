"""``torch_xla.distributed.spmd`` (``xs``): ``Mesh``, ``mark_sharding`` and their DTensor meaning.

PyTorch/XLA's SPMD has one process drive every device and lets the compiler split each annotated
tensor. torchtpu runs one process per device, so the mapping is:
- ``xs.Mesh(device_ids, mesh_shape, axis_names)`` is validated as PyTorch/XLA does, and
  ``mesh.device_mesh()`` is the ``torch.distributed`` ``DeviceMesh`` over those ranks (device id
  = rank); ``xs.placements(mesh, partition_spec)`` the DTensor placements of a partition spec, so
  ``distribute_tensor(t, mesh.device_mesh(), xs.placements(mesh, spec))`` is the sharded tensor.
- ``mark_sharding(t, mesh, spec)`` checks the spec against the tensor and the mesh and records it
  (``wrap_if_sharded`` / ``XLAShardedTensor.sharding_spec`` read it back). On a mesh of one device
  (one process, the common FSDPv2 start) that is the whole meaning: the tensor is its only
  shard. On a mesh over several processes every process keeps the whole tensor and computes
  the same program (correct results, no memory saved; a one-time warning says so): scripts that
  load the same global batch in each process train as under SPMD. Real sharding is DTensor's
  (above) or FSDP2's ``fully_shard``.
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Sequence

import numpy as np
import torch

from torchtpu import errors
from torchtpu.integrations.torch_xla import _missing, runtime

_global_mesh: list = [None]
_warned: list = []


class Mesh:
    """A logical mesh of device ids (ranks) with named axes."""

    def __init__(self, device_ids, mesh_shape: Sequence[int],
                 axis_names: Sequence[str] | None = None) -> None:
        ids = np.asarray(device_ids).reshape(-1)
        shape = tuple(int(n) for n in mesh_shape)
        if math.prod(shape) != ids.size:
            raise ValueError(f"torchtpu.argument: xs.Mesh: {ids.size} device ids do not fill "
                             f"mesh_shape {shape}")
        if sorted(ids.tolist()) != list(range(ids.size)):
            raise ValueError(f"torchtpu.argument: xs.Mesh: device ids {ids.tolist()} must be "
                             f"0..{ids.size - 1}, each once")
        if axis_names is not None and len(axis_names) != len(shape):
            raise ValueError(f"torchtpu.argument: xs.Mesh: {len(axis_names)} axis names for "
                             f"{len(shape)} mesh dimensions")
        devices = runtime.global_runtime_device_count()
        if ids.size != devices:
            raise ValueError(f"torchtpu.argument: xs.Mesh over {ids.size} devices, but the job "
                             f"has {devices} (one per process: xr.global_runtime_device_count())")
        self.device_ids, self.mesh_shape = ids, shape
        self.axis_names = tuple(axis_names) if axis_names is not None else None
        self._device_mesh = None

    def size(self) -> int:
        return int(self.device_ids.size)

    def shape(self) -> OrderedDict:
        names = self.axis_names or tuple(range(len(self.mesh_shape)))
        return OrderedDict(zip(names, self.mesh_shape))

    def get_logical_mesh(self) -> np.ndarray:
        return self.device_ids.reshape(self.mesh_shape)

    def get_axis_name_idx(self, name) -> int | None:
        if self.axis_names is None or name not in self.axis_names:
            return None
        return self.axis_names.index(name)

    def axis(self, name) -> int:
        """The mesh dimension a spec entry names (an axis name or an index)."""
        if isinstance(name, int) and 0 <= name < len(self.mesh_shape):
            return name
        index = self.get_axis_name_idx(name)
        if index is None:
            raise ValueError(f"torchtpu.argument: mesh axis {name!r} is not one of "
                             f"{self.axis_names or tuple(range(len(self.mesh_shape)))}")
        return index

    def device_mesh(self):
        """This mesh as a ``torch.distributed`` ``DeviceMesh`` on "tpu" (device id = rank)."""
        if self._device_mesh is None:
            from torch.distributed.device_mesh import DeviceMesh

            self._device_mesh = DeviceMesh("tpu", torch.as_tensor(self.get_logical_mesh()),
                                           mesh_dim_names=self.axis_names)
        return self._device_mesh

    def __repr__(self) -> str:
        return f"Mesh(shape={dict(self.shape())})"


def _axes(entry) -> tuple:
    if entry is None:
        return ()
    return tuple(entry) if isinstance(entry, (tuple, list)) else (entry,)


def _check(t: torch.Tensor, mesh: Mesh, spec: Sequence) -> tuple:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"torchtpu.argument: expected an xs.Mesh, got {type(mesh).__name__}")
    spec = tuple(spec)
    if len(spec) != t.dim():
        raise ValueError(f"torchtpu.argument: partition spec {spec} has {len(spec)} entries for "
                         f"a tensor of {t.dim()} dimensions {tuple(t.shape)}")
    used: list[int] = []
    for dim, entry in enumerate(spec):
        ways = 1
        for name in _axes(entry):
            axis = mesh.axis(name)
            if axis in used:
                raise ValueError(f"torchtpu.argument: mesh axis {name!r} shards two "
                                 f"dimensions in {spec}")
            used.append(axis)
            ways *= mesh.mesh_shape[axis]
        if t.shape[dim] % ways:
            raise ValueError(f"torchtpu.argument: dimension {dim} of size {t.shape[dim]} does "
                             f"not split into {ways} shards (spec {spec}, mesh {mesh})")
    return spec


def placements(mesh: Mesh, partition_spec: Sequence) -> list:
    """DTensor placements (one per mesh dimension) of a PyTorch/XLA partition spec."""
    from torch.distributed.tensor import Replicate, Shard

    out = [Replicate()] * len(mesh.mesh_shape)
    for dim, entry in enumerate(partition_spec):
        for name in _axes(entry):
            out[mesh.axis(name)] = Shard(dim)
    return out


def _spec_text(mesh: Mesh, spec: tuple) -> str:
    """PyTorch/XLA's sharding text: ``{replicated}`` or ``{devices=[...]ids}``."""
    tiles = [math.prod(mesh.mesh_shape[mesh.axis(n)] for n in _axes(e)) for e in spec]
    if all(n == 1 for n in tiles):
        return "{replicated}"
    ids = ",".join(str(i) for i in mesh.device_ids.tolist())
    return f"{{devices=[{','.join(map(str, tiles))}]{ids}}}"


class XLAShardedTensor:
    """What ``mark_sharding`` returns: ``global_tensor`` and its ``sharding_spec`` text."""

    def __init__(self, tensor: torch.Tensor, mesh: Mesh, partition_spec: tuple) -> None:
        self.global_tensor, self.mesh, self.partition_spec = tensor, mesh, partition_spec

    @property
    def sharding_spec(self) -> str:
        return _spec_text(self.mesh, self.partition_spec)

    @property
    def shape(self) -> torch.Size:
        return self.global_tensor.shape

    def to_dtensor(self):
        """The DTensor this annotation means (needs the process group of the mesh's ranks)."""
        from torch.distributed.tensor import distribute_tensor

        return distribute_tensor(self.global_tensor.detach(), self.mesh.device_mesh(),
                                 placements(self.mesh, self.partition_spec))


def _where(t: torch.Tensor) -> tuple:
    return t.storage_offset(), tuple(t.shape), tuple(t.stride())


def _records(t: torch.Tensor) -> dict:
    """The specs recorded for t's data: kept on its storage (one Python object per storage on
    torchtpu), so an ``nn.Parameter`` made from a marked tensor is marked too, as the data is in
    PyTorch/XLA."""
    storage = t.untyped_storage()
    if not hasattr(storage, "_torchtpu_shardings"):
        storage._torchtpu_shardings = {}
    return storage._torchtpu_shardings


def _record(t: torch.Tensor, mesh: Mesh | None, partition_spec: Sequence | None) -> tuple:
    mesh = mesh if mesh is not None else get_global_mesh()
    if mesh is None:
        raise ValueError("torchtpu.argument: no mesh given and no global mesh set "
                         "(xs.set_global_mesh)")
    spec = _check(t, mesh, partition_spec)
    if mesh.size() > 1 and not _warned:
        _warned.append(True)
        errors.warn("unsupported", f"xs.mark_sharding over {mesh.size()} processes: each "
                    "process keeps the whole tensor and computes the same program (correct, "
                    "no memory saved); shard for real with DTensor (xs.Mesh.device_mesh(), "
                    "xs.placements) or fully_shard", stacklevel=3)
    _records(t)[_where(t)] = (mesh, spec)
    return mesh, spec


def mark_sharding(t: torch.Tensor, mesh: Mesh, partition_spec: Sequence) -> XLAShardedTensor:
    """Annotate t with partition_spec over mesh (see the module for what it means here)."""
    mesh, spec = _record(t, mesh, partition_spec)
    return XLAShardedTensor(t, mesh, spec)


def mark_sharding_with_gradients(t: torch.Tensor, mesh: Mesh,
                                 partition_spec: Sequence) -> torch.Tensor:
    """``mark_sharding`` that returns the tensor itself (gradients flow through it)."""
    _record(t, mesh, partition_spec)
    return t


def clear_sharding(t: torch.Tensor) -> torch.Tensor:
    _records(t).pop(_where(t), None)
    return t


def wrap_if_sharded(t):
    if not isinstance(t, torch.Tensor):
        return t
    found = _records(t).get(_where(t))
    return XLAShardedTensor(t, *found) if found is not None else t


def set_global_mesh(mesh: Mesh) -> None:
    if not isinstance(mesh, Mesh):
        raise TypeError(f"torchtpu.argument: expected an xs.Mesh, got {type(mesh).__name__}")
    _global_mesh[0] = mesh


def get_global_mesh() -> Mesh | None:
    return _global_mesh[0]


def get_1d_mesh(axis_name: str | None = None) -> Mesh:
    n = runtime.global_runtime_device_count()
    return Mesh(np.arange(n), (n,), (axis_name,) if axis_name else None)


def apply_backward_optimization_barrier(module: torch.nn.Module) -> None:
    """PyTorch/XLA puts an optimization barrier around the module's backward so XLA does not
    fuse its recomputation into the rest of the graph: a scheduling hint for its one whole-graph
    program, which changes no value; torchtpu's backward runs as PyTorch's autograd orders it,
    so there is nothing to do."""
    if not isinstance(module, torch.nn.Module):
        raise TypeError(f"torchtpu.argument: expected an nn.Module, got {type(module).__name__}")


class ShardingSpec:
    """``xs.ShardingSpec(mesh, partition_spec)``: a spec to apply to tensors later."""

    def __init__(self, mesh: Mesh, partition_spec: Sequence, minibatch: bool = False) -> None:
        self.mesh, self.partition_spec, self.minibatch = mesh, tuple(partition_spec), minibatch

    def can_apply(self, t: torch.Tensor) -> bool:
        return t.dim() == len(self.partition_spec)

    def apply(self, t: torch.Tensor) -> XLAShardedTensor:
        return mark_sharding(t, self.mesh, self.partition_spec)


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
