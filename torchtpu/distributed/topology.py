"""Device meshes laid out on the interconnect: ``topology_aware_mesh``.

Each rank drives one device. The ranks all-gather a description of their device (platform,
kind, TPU chip coordinates and core, slice, host), and every rank then lays the same mesh out
with JAX's mesh builder (``jax.experimental.mesh_utils``), which knows the TPU tori: the last
mesh axis, meant for the most traffic, gets the best-connected chips, as in JAX. On CPU and GPU
there is no interconnect to follow and the layout is the trivial one: ranks in order, and for
``multi_slice`` each consecutive block of ``prod(mesh_shape)`` ranks is one slice.
"""

from __future__ import annotations

import dataclasses
import math
import os
import socket
from collections.abc import Sequence

import numpy as np
import torch
import torch.distributed as dist

from torchtpu import errors

_TOPOLOGIES = ("single_slice", "multi_slice")
_warned = [False]


@dataclasses.dataclass(frozen=True)
class DeviceInfo:
    """What the layout needs to know of one rank's device; it stands in for a JAX device in
    JAX's mesh builder, so its field names are JAX's (and it is no tuple, which NumPy would
    unpack)."""

    rank: int
    platform: str
    device_kind: str
    host: str
    local_id: int
    coords: tuple | None = None
    core_on_chip: int = 0
    slice_index: int = 0
    pid: int = 0

    @property
    def id(self) -> int:
        return self.rank

    @property
    def process_index(self) -> int:
        return self.rank  # one process per device

    def place(self) -> tuple:
        """Where the device is: two ranks at the same place share a device."""
        if self.platform == "tpu":
            return ("tpu", self.slice_index, self.coords, self.core_on_chip)
        if self.platform == "cpu":  # each process's XLA:CPU client is a device of its own
            return ("cpu", self.host, self.pid)
        return (self.platform, self.host, self.local_id)


def this_device(rank: int) -> DeviceInfo:
    """This process's device, described for the all-gather."""
    from torchtpu.runtime import platform

    d = platform.jax_device()
    coords = getattr(d, "coords", None)
    return DeviceInfo(
        rank=rank, platform=d.platform, device_kind=d.device_kind, host=socket.gethostname(),
        local_id=d.id, coords=tuple(coords) if coords is not None else None,
        core_on_chip=getattr(d, "core_on_chip", 0) or 0,
        slice_index=getattr(d, "slice_index", 0) or 0, pid=os.getpid(),
    )


def _shape(name: str, shape) -> tuple:
    if (not isinstance(shape, Sequence) or not shape
            or not all(isinstance(n, int) and not isinstance(n, bool) and n > 0 for n in shape)):
        raise ValueError(errors.message(
            "argument", f"{name} must be a non-empty sequence of positive ints, got {shape!r}"))
    return tuple(shape)


def layout(devices: Sequence[DeviceInfo], mesh_shape: Sequence[int], *,
           topology: str = "single_slice", dcn_mesh_shape: Sequence[int] | None = None,
           process_is_granule: bool = False, allow_split_physical_axes: bool = False,
           contiguous_submeshes: bool = False) -> np.ndarray:
    """The mesh of global ranks for the gathered devices (one per rank, in rank order)."""
    from jax.experimental import mesh_utils

    if topology not in _TOPOLOGIES:
        raise ValueError(errors.message(
            "argument", f"topology must be one of {', '.join(_TOPOLOGIES)}, got {topology!r}"))
    mesh_shape = _shape("mesh_shape", mesh_shape)
    world = len(devices)
    seen: dict = {}
    for d in devices:
        other = seen.setdefault(d.place(), d.rank)
        if other != d.rank:
            raise ValueError(errors.message(
                "device", f"ranks {other} and {d.rank} share one device ({d.platform} "
                f"{d.place()[1:]}); topology_aware_mesh needs one device per rank: give each "
                f"process its own device (torchrun's LOCAL_RANK or TORCHTPU_LOCAL_DEVICE)"))
    if topology == "multi_slice":
        if dcn_mesh_shape is None:
            raise ValueError(errors.message(
                "argument", "topology='multi_slice' needs dcn_mesh_shape, the mesh of slices "
                "(one entry per mesh_shape axis)"))
        dcn = _shape("dcn_mesh_shape", dcn_mesh_shape)
        if len(dcn) != len(mesh_shape):
            raise ValueError(errors.message(
                "argument", f"dcn_mesh_shape {dcn} and mesh_shape {mesh_shape} must have "
                f"as many axes"))
        total = math.prod(mesh_shape) * math.prod(dcn)
    else:
        dcn, total = None, math.prod(mesh_shape)
    if total != world:
        what = f"mesh_shape {mesh_shape}" + (f" times dcn_mesh_shape {dcn}" if dcn else "")
        raise ValueError(errors.message(
            "argument", f"{what} holds {total} ranks but the process group has {world}"))

    if devices[0].platform == "tpu":
        # JAX lists TPU devices in this order; its builder expects it.
        ordered = sorted(devices, key=lambda d: (d.slice_index, tuple(reversed(d.coords)),
                                                 d.core_on_chip))
    else:
        # No interconnect to follow: ranks in order, consecutive blocks as slices.
        per = math.prod(mesh_shape)
        ordered = [dataclasses.replace(d, platform="cpu", slice_index=d.rank // per)
                   for d in devices]
    if dcn is None:
        mesh = mesh_utils.create_device_mesh(
            mesh_shape, ordered, contiguous_submeshes=contiguous_submeshes,
            allow_split_physical_axes=allow_split_physical_axes)
    else:
        mesh = mesh_utils.create_hybrid_device_mesh(
            mesh_shape, dcn, ordered, process_is_granule=process_is_granule,
            allow_split_physical_axes=allow_split_physical_axes)
    return np.vectorize(lambda d: d.rank, otypes=[np.int64])(mesh)


def topology_aware_mesh(mesh_shape: Sequence[int], *, topology: str = "single_slice",
                        dcn_mesh_shape: Sequence[int] | None = None,
                        process_is_granule: bool = False, allow_split_physical_axes: bool = False,
                        contiguous_submeshes: bool = False) -> torch.Tensor:
    """An int64 tensor of global ranks, of shape ``mesh_shape`` (times ``dcn_mesh_shape`` for
    ``multi_slice``), for ``DeviceMesh("tpu", mesh=...)``: the ranks laid out on the physical
    interconnect, the last axis meant for the most traffic. Experimental (warns once)."""
    if not _warned[0]:
        _warned[0] = True
        errors.warn("experimental", "topology_aware_mesh is experimental; its layout may "
                    "change", stacklevel=2)
    if not dist.is_available() or not dist.is_initialized():
        raise RuntimeError(errors.message(
            "argument", "topology_aware_mesh needs torch.distributed initialized: call "
            "torch.distributed.init_process_group('tpu_dist') first"))
    devices: list = [None] * dist.get_world_size()
    dist.all_gather_object(devices, this_device(dist.get_rank()))
    ranks = layout(devices, mesh_shape, topology=topology, dcn_mesh_shape=dcn_mesh_shape,
                   process_is_granule=process_is_granule,
                   allow_split_physical_axes=allow_split_physical_axes,
                   contiguous_submeshes=contiguous_submeshes)
    return torch.from_numpy(ranks)
