"""One process per chip on a multi-chip TPU host: the variables libtpu reads to give each process
its own chips and to join them into one slice.

A TPU host has 4 or 8 chips (v5e-4: 2x2; v5e-8 and v6e-8: 2x4), and libtpu by default gives all
of them to the first process that opens it. torchtpu runs one process per device (torchrun
``--nproc_per_node=K``, Ray Train's workers), so before JAX starts its TPU client every process
must tell libtpu which chips are its own and where the other processes of the slice listen:

- ``TPU_VISIBLE_CHIPS``: this process's chips on the host (``LOCAL_RANK`` with one chip each);
- ``TPU_CHIPS_PER_PROCESS_BOUNDS``: the box of chips one process holds (``1,1,1``);
- ``TPU_PROCESS_BOUNDS``: the box of processes of the whole slice (hosts' box times the box of
  processes on one host);
- ``TPU_PROCESS_ADDRESSES``: every process's ``host:port``, host by host, and
  ``TPU_PROCESS_PORT``: this process's port (a base port plus ``LOCAL_RANK``);
- ``CLOUD_TPU_TASK_ID``: this process's index in the slice (host index times K plus
  ``LOCAL_RANK``).

These are the variables, and the values, PyTorch/XLA's launcher sets for its processes
(github.com/pytorch/xla, ``torch_xla/_internal/tpu.py``, ``configure_topology``: one chip per
process, process bounds = the host bounds times the chips-per-host bounds, ports from 8476, task id
= worker id x local world size + local rank) and JAX's multi-process test launcher sets for chip
groups (github.com/jax-ml/jax, ``jax/_src/test_multiprocess.py``: ``TPU_VISIBLE_CHIPS`` a
contiguous range, 2 chips per process as ``1,2,1`` and 4 as ``2,2,1``, and
``ALLOW_MULTIPLE_LIBTPU_LOAD`` so that libtpu's lock file lets several processes of a host in).
Ray's own per-worker setting (github.com/ray-project/ray,
``python/ray/_private/accelerators/tpu.py``) gives a worker ``TPU_VISIBLE_CHIPS`` and makes it a
slice of its own (``TPU_HOST_BOUNDS=1,1,1``): collectives across workers would then leave the ICI,
so here the chip Ray chose is kept and the slice-wide bounds replace its single-chip ones.

Where the numbers come from: the host's chips from the PCI scan JAX uses
(``hardware_utils.num_available_tpu_chips_and_device_id``), laid out as the Cloud TPU host types
are (1: 1x1, 4: 2x2, 8: 2x4), or ``TORCHTPU_TPU_HOST_CHIPS`` (``"2,4,1"``; how the tests describe
a host on a machine without one). The hosts' box: ``TPU_HOST_BOUNDS`` (GKE sets it), else
``TPU_TOPOLOGY`` (``"16x16"``) divided by the host's box, else 1x1 for one host and 1x2 for two
(the 2x4 slices of two 4-chip hosts); more hosts need one of the two. The host's index in the
slice: ``TPU_WORKER_ID`` (GKE, the host's place in the physical slice), else the launcher's.
Processes per host and the host's index come from torchrun's ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``/
``GROUP_RANK`` at import (one host), else from the process group's rendezvous
(``distributed/launch.py``, which also exchanges the hosts' addresses for several hosts).

Nothing is set when the host has no TPU chips, when one process holds the host, when
``TORCHTPU_CHIP_BINDING=0``, or when ``TPU_PROCESS_BOUNDS`` is already set (a launcher that did
it itself). Derived from the sources above and checked as variables (``tests/test_chips.py``);
not yet run on a multi-chip TPU host.
"""

from __future__ import annotations

import math
import os

from torchtpu import errors, settings

BASE_PORT = settings.TPU_PROCESS_PORT.default  # PyTorch/XLA's default first port
SET = ("TPU_VISIBLE_CHIPS", "TPU_CHIPS_PER_PROCESS_BOUNDS", "TPU_PROCESS_BOUNDS",
       "TPU_PROCESS_ADDRESSES", "TPU_PROCESS_PORT", "CLOUD_TPU_TASK_ID",
       "ALLOW_MULTIPLE_LIBTPU_LOAD")
# The Cloud TPU hosts' chip boxes by chip count (v5e/v6e: 4-chip hosts 2x2, 8-chip hosts 2x4).
_HOST_BOXES = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
# The box of one process's chips by their count, as JAX's launcher lays them out.
_PROCESS_BOXES = {1: (1, 1, 1), 2: (1, 2, 1), 4: (2, 2, 1), 8: (2, 4, 1)}
Box = tuple[int, int, int]

# Set once this process's variables are set (by ``bind``), so the group's creation does not
# bind again; a refusal found at import is kept for the first device use to raise.
_bound: list[dict[str, str] | None] = [None]
deferred: list[Exception | None] = [None]


class ChipBindingError(RuntimeError):
    """The processes cannot be given chips of their own on this host."""


def _fail(text: str) -> ChipBindingError:
    return ChipBindingError(errors.message("device", text))


def _box(text: str, name: str) -> Box:
    parts = text.replace("x", ",").split(",")
    try:
        dims = [int(p) for p in parts]
    except ValueError:
        dims = []
    if not 1 <= len(dims) <= 3 or min(dims) < 1:
        raise ValueError(errors.message(
            "config", f"{name}={text!r} is not a box of chips like 2,4,1 or 2x4"))
    return (*dims, *([1] * (3 - len(dims))))


def host_chips() -> Box | None:
    """This host's chips as a box (x, y, z), or None where it has none."""
    override = settings.TPU_HOST_CHIPS.get()
    if override:
        return _box(override, settings.TPU_HOST_CHIPS.name)
    from jax._src import hardware_utils  # (JAX: this module loads at import torch, without it)

    count = hardware_utils.num_available_tpu_chips_and_device_id()[0]
    if not count:
        return None
    if count not in _HOST_BOXES:
        raise _fail(f"this host has {count} TPU chips, not a host type torchtpu knows the layout "
                    "of (1, 4 or 8 chips): set TORCHTPU_TPU_HOST_CHIPS to its box, like 2,4,1")
    return _HOST_BOXES[count]


def host_bounds(hosts: int, chips: Box) -> Box:
    """The box of the slice's hosts (see the module doc)."""
    given = os.environ.get("TPU_HOST_BOUNDS", "").strip()
    if given and math.prod(_box(given, "TPU_HOST_BOUNDS")) == hosts:
        return _box(given, "TPU_HOST_BOUNDS")
    topology = os.environ.get("TPU_TOPOLOGY", "").strip()
    if topology:
        whole = _box(topology, "TPU_TOPOLOGY")
        box = tuple(w // c for w, c in zip(whole, chips))
        if any(w % c for w, c in zip(whole, chips)) or math.prod(box) != hosts:
            raise _fail(f"TPU_TOPOLOGY={topology} does not hold {hosts} host(s) of "
                        f"{'x'.join(map(str, chips))} chips")
        return box
    if hosts in (1, 2):
        return (1, hosts, 1)
    raise _fail(f"{hosts} TPU hosts: set TPU_TOPOLOGY (the slice's chips, like 16x16) or "
                "TPU_HOST_BOUNDS (its hosts, like 8,8,1) so that each process's place in the "
                "slice is known (GKE sets both)")


def variables(local_rank: int, local_size: int, chips: Box, host_index: int, hosts: Box,
              addresses: list[str], base_port: int = BASE_PORT,
              visible: str | None = None) -> dict[str, str]:
    """libtpu's variables for process ``local_rank`` of the ``local_size`` on host ``host_index``
    of a slice of ``hosts`` hosts of ``chips`` chips each; ``addresses`` lists the hosts in slice
    order; ``visible`` keeps the chips a scheduler (Ray) already chose for this process."""
    count = math.prod(chips)
    if local_size < 1 or count % local_size:
        raise _fail(f"{local_size} processes were started on a TPU host with {count} chips "
                    f"({'x'.join(map(str, chips))}): each process needs its own chips, so the "
                    f"chips must divide evenly: start {count} per host (torchrun "
                    f"--nproc-per-node {count}, Ray Train: {count} workers per node), or a "
                    "divisor of it")
    each = count // local_size
    box = _PROCESS_BOXES.get(each)
    if box is None or any(c % b for c, b in zip(chips, box)):
        raise _fail(f"{local_size} processes of {each} chips each do not tile this host's "
                    f"{'x'.join(map(str, chips))} chips: start {count} processes per host")
    if len(addresses) != math.prod(hosts):
        raise _fail(f"{len(addresses)} host address(es) for a slice of {math.prod(hosts)} hosts")
    per_host = tuple(c // b for c, b in zip(chips, box))
    ports = [base_port + i for i in range(local_size)]
    chosen = visible if visible and len(visible.split(",")) == each else ",".join(
        str(c) for c in range(local_rank * each, (local_rank + 1) * each))
    return {
        "TPU_VISIBLE_CHIPS": chosen,
        "TPU_CHIPS_PER_PROCESS_BOUNDS": ",".join(map(str, box)),
        "TPU_PROCESS_BOUNDS": ",".join(str(h * p) for h, p in zip(hosts, per_host)),
        "TPU_PROCESS_ADDRESSES": ",".join(f"{a}:{p}" for a in addresses for p in ports),
        "TPU_PROCESS_PORT": str(ports[local_rank]),
        "CLOUD_TPU_TASK_ID": str(host_index * local_size + local_rank),
        "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
    }


def wanted(local_size: int) -> Box | None:
    """This host's chips when its processes need binding (see the module doc), else None."""
    if not settings.CHIP_BINDING.get() or _bound[0] is not None:
        return None
    if "TPU_PROCESS_BOUNDS" in os.environ or local_size < 2:
        return None
    return host_chips()


def bind(local_rank: int, local_size: int, host_index: int, addresses: list[str],
         chips: Box) -> dict[str, str]:
    """Set this process's variables (before JAX starts its TPU client); return them."""
    from jax._src import xla_bridge  # (JAX: this module loads at import torch, without it)

    if xla_bridge.backends_are_initialized():
        raise _fail("JAX's TPU client started before this process was given its chips (a tpu "
                    "tensor was made, or JAX used, before init_process_group): call "
                    "init_process_group first")
    hosts = host_bounds(len(addresses), chips)
    values = variables(local_rank, local_size, chips, host_index, hosts, addresses,
                       settings.TPU_PROCESS_PORT.get(),
                       os.environ.get("TPU_VISIBLE_CHIPS"))
    os.environ.update(values)
    _bound[0] = values
    return values


def bind_from_environment() -> None:
    """At import, under torchrun on one host: bind from ``LOCAL_RANK``/``LOCAL_WORLD_SIZE``. A
    refusal is kept in ``deferred`` for the first device use (``import torch`` must not fail)."""
    try:
        local = os.environ.get("LOCAL_RANK"), os.environ.get("LOCAL_WORLD_SIZE")
        world = os.environ.get("WORLD_SIZE")
        if None in local or world != local[1]:
            return  # not torchrun, or several hosts: the group's creation binds
        local_rank, local_size = int(local[0]), int(local[1])
        chips = wanted(local_size)
        if chips is not None:
            bind(local_rank, local_size, 0, ["localhost"], chips)
    except (ChipBindingError, ValueError) as e:
        deferred[0] = e


def check() -> None:
    """Raise a refusal found at import (called before the first device use)."""
    if deferred[0] is not None:
        raise deferred[0]
