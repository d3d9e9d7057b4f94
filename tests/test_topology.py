"""topology_aware_mesh: ranks laid out on the interconnect from each rank's device."""

import itertools
import random
import warnings

import numpy as np
import pytest
import torch
from runners import ALL

from torchtpu.distributed import topology
from torchtpu.distributed.topology import DeviceInfo, layout, topology_aware_mesh
from torchtpu.testing.threaded import run_threads


def _v4_chips(coords, slice_index=0, first_rank=0):
    return [DeviceInfo(first_rank + i, "tpu", "TPU v4", f"host{slice_index}", i, c, 0,
                       slice_index) for i, c in enumerate(coords)]


def _cpu_processes(n):
    return [DeviceInfo(r, "cpu", "cpu", "h", 0, pid=100 + r) for r in range(n)]


def test_tpu_layout_follows_chip_coordinates_not_rank_order():
    coords = list(itertools.product(range(2), range(2), range(2)))
    random.Random(0).shuffle(coords)  # ranks in no physical order
    mesh = layout(_v4_chips(coords), (2, 4))
    assert sorted(mesh.ravel().tolist()) == list(range(8))
    assert not np.array_equal(mesh, np.arange(8).reshape(2, 4))
    # Each row (the last, busiest axis) is one 2x2 face of the 2x2x2 torus.
    for row in mesh:
        planes = [{coords[r][axis] for r in row} for axis in range(3)]
        assert sorted(len(p) for p in planes) == [1, 2, 2]


def test_tpu_multi_slice_puts_each_slice_on_its_own_dcn_row():
    face = list(itertools.product(range(2), range(2), range(1)))
    devices = _v4_chips(face, slice_index=1) + _v4_chips(face, slice_index=0, first_rank=4)
    mesh = layout(devices, (1, 4), topology="multi_slice", dcn_mesh_shape=(2, 1))
    assert mesh.shape == (2, 4)
    assert sorted(mesh[0]) == [4, 5, 6, 7] and sorted(mesh[1]) == [0, 1, 2, 3]


def test_cpu_and_gpu_layout_is_rank_order():
    devices = _cpu_processes(4)
    np.testing.assert_array_equal(layout(devices, (2, 2)), [[0, 1], [2, 3]])
    gpus = [DeviceInfo(r, "gpu", "H200", "h", 3 - r) for r in range(4)]
    np.testing.assert_array_equal(layout(gpus, (4,)), [0, 1, 2, 3])
    multi = dict(topology="multi_slice")
    np.testing.assert_array_equal(layout(devices, (1, 2), dcn_mesh_shape=(2, 1), **multi),
                                  [[0, 1], [2, 3]])
    np.testing.assert_array_equal(layout(devices, (2, 1), dcn_mesh_shape=(1, 2), **multi),
                                  [[0, 2], [1, 3]])


def test_bad_layouts_raise():
    devices = _cpu_processes(4)
    with pytest.raises(ValueError, match="multi_slice' needs dcn_mesh_shape"):
        layout(devices, (2, 2), topology="multi_slice")
    with pytest.raises(ValueError, match="topology must be one of"):
        layout(devices, (2, 2), topology="torus")
    with pytest.raises(ValueError, match=r"mesh_shape \(2, 4\) holds 8 ranks but the process"):
        layout(devices, (2, 4))
    with pytest.raises(ValueError, match="as many axes"):
        layout(devices, (2, 2), topology="multi_slice", dcn_mesh_shape=(1,))
    with pytest.raises(ValueError, match="positive ints"):
        layout(devices, (2, 0))
    gpus = [DeviceInfo(r, "gpu", "H200", "h", r) for r in range(3)]
    with pytest.raises(ValueError, match="ranks 1 and 3 share one device"):
        layout([*gpus, DeviceInfo(3, "gpu", "H200", "h", 1)], (4,))


def test_needs_an_initialized_process_group_and_warns_experimental(monkeypatch):
    monkeypatch.setattr(topology, "_warned", [False])
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with pytest.raises(RuntimeError, match="needs torch.distributed initialized"):
            topology_aware_mesh((2,))
    assert any(str(w.message).startswith("torchtpu.experimental") for w in caught)


def _gathered(rank, world):
    try:
        meshes = (topology_aware_mesh((world,)),
                  topology_aware_mesh((1,), topology="multi_slice", dcn_mesh_shape=(world,)))
    except ValueError as e:
        return str(e)
    try:  # a mesh that is not the world: refused on every rank (issue 20's bad input)
        topology_aware_mesh((1, world + 1), topology="multi_slice", dcn_mesh_shape=(2, 1))
        return (*meshes, None)
    except ValueError as e:
        return (*meshes, str(e))


@pytest.mark.parametrize("run", ALL)
def test_ranks_gather_their_devices(run):
    for out in run(_gathered, 2):
        if run is run_threads:
            # Thread ranks all drive this process's one device, and the gathered descriptions
            # say so.
            assert "ranks 0 and 1 share one device" in out
        else:  # processes, one device each, on CPU: the trivial layout
            single, multi, refused = out
            assert single.dtype == torch.int64 and single.tolist() == [0, 1]
            assert multi.tolist() == [0, 1]  # shape mesh_shape * dcn_mesh_shape
            assert refused is not None and "torchtpu.argument: mesh_shape (1, 3) times " \
                "dcn_mesh_shape (2, 1) holds 6 ranks but the process group has 2" in refused
