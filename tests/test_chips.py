"""One process per chip on multi-chip TPU hosts: the libtpu variables each process receives.

No TPU host is here, so hosts are described with ``TORCHTPU_TPU_HOST_CHIPS`` (the box of chips
the PCI scan would give) and the processes compute on XLA:CPU. Checked: the variables of every
process of v5e-4 (2x2), v5e-8 and v6e-8 (2x4) hosts, one and two of them, and of a 256-chip v5e
slice (against values worked out by hand from PyTorch/XLA's and JAX's launchers, see
``runtime/chips.py``); a process started under torchrun's environment gets them at ``import
torch``; four processes playing two hosts of two chips get theirs at ``init_process_group``
(host addresses through the store, as under Ray Train) and still all-reduce; a host whose chips
do not divide by its processes is refused at the first device use and at the group's creation.
"""

import datetime
import json
import os
import subprocess
import sys

import pytest
import torch

from torchtpu.distributed.spawn import free_port, run
from torchtpu.runtime import chips

HOSTS = {"v5e-4": (2, 2, 1), "v5e-8": (2, 4, 1), "v6e-8": (2, 4, 1)}


def _slice(box, hosts):
    """Every process's variables on a slice of ``hosts`` hosts of ``box`` chips, one per chip."""
    per_host = box[0] * box[1] * box[2]
    bounds = chips.host_bounds(hosts, box)
    addresses = [f"10.0.0.{h}" for h in range(hosts)] if hosts > 1 else ["localhost"]
    return [chips.variables(r, per_host, box, h, bounds, addresses)
            for h in range(hosts) for r in range(per_host)]


@pytest.mark.parametrize("host", sorted(HOSTS))
@pytest.mark.parametrize("hosts", [1, 2])
def test_every_process_gets_its_own_chip(host, hosts, monkeypatch):
    monkeypatch.delenv("TPU_HOST_BOUNDS", raising=False)
    monkeypatch.delenv("TPU_TOPOLOGY", raising=False)
    box = HOSTS[host]
    per_host = box[0] * box[1]
    procs = _slice(box, hosts)
    assert len(procs) == per_host * hosts
    for h in range(hosts):
        mine = procs[h * per_host:(h + 1) * per_host]
        assert [p["TPU_VISIBLE_CHIPS"] for p in mine] == [str(c) for c in range(per_host)]
        assert [p["TPU_PROCESS_PORT"] for p in mine] == [str(8476 + c) for c in range(per_host)]
    assert [p["CLOUD_TPU_TASK_ID"] for p in procs] == [str(i) for i in range(len(procs))]
    for p in procs:
        assert p["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,1,1"
        assert p["ALLOW_MULTIPLE_LIBTPU_LOAD"] == "1"
        # The slice's processes: the hosts stacked along y (two 2x2 hosts make the 2x4 slice).
        assert p["TPU_PROCESS_BOUNDS"] == f"{box[0]},{box[1] * hosts},1"
        addresses = p["TPU_PROCESS_ADDRESSES"].split(",")
        assert len(addresses) == len(procs) == len(set(addresses))
    # Worked out by hand: the last process of the last host.
    last = procs[-1]
    host_name = "localhost" if hosts == 1 else f"10.0.0.{hosts - 1}"
    assert last["TPU_PROCESS_ADDRESSES"].split(",")[-1] == f"{host_name}:{8476 + per_host - 1}"


def test_a_256_chip_v5e_slice_from_its_topology(monkeypatch):
    monkeypatch.setenv("TPU_TOPOLOGY", "16x16")
    monkeypatch.delenv("TPU_HOST_BOUNDS", raising=False)
    assert chips.host_bounds(64, (2, 2, 1)) == (8, 8, 1)
    procs = _slice((2, 2, 1), 64)
    assert {p["TPU_PROCESS_BOUNDS"] for p in procs} == {"16,16,1"}
    assert procs[-1]["CLOUD_TPU_TASK_ID"] == "255" and procs[-1]["TPU_VISIBLE_CHIPS"] == "3"
    monkeypatch.setenv("TPU_HOST_BOUNDS", "8,8,1")  # GKE's own; wins over the topology
    monkeypatch.setenv("TPU_TOPOLOGY", "nonsense")
    assert chips.host_bounds(64, (2, 2, 1)) == (8, 8, 1)


def test_chip_groups_tile_the_host():
    two = chips.variables(1, 2, (2, 2, 1), 0, (1, 1, 1), ["localhost"])
    assert two["TPU_VISIBLE_CHIPS"] == "2,3" and two["TPU_CHIPS_PER_PROCESS_BOUNDS"] == "1,2,1"
    assert two["TPU_PROCESS_BOUNDS"] == "2,1,1"  # JAX's launcher's layout for 2 chips each
    # A chip Ray already chose for the process is kept.
    ray = chips.variables(0, 4, (2, 2, 1), 0, (1, 1, 1), ["localhost"], visible="3")
    assert ray["TPU_VISIBLE_CHIPS"] == "3"


@pytest.mark.parametrize("processes,box", [(3, (2, 2, 1)), (6, (2, 4, 1)), (16, (2, 4, 1))])
def test_chips_that_do_not_divide_by_the_processes_are_refused(processes, box):
    count = box[0] * box[1]
    with pytest.raises(chips.ChipBindingError) as e:
        chips.variables(0, processes, box, 0, (1, 1, 1), ["localhost"])
    text = str(e.value)
    assert text.startswith(f"torchtpu.device: {processes} processes were started on a TPU "
                           f"host with {count} chips"), text
    assert f"--nproc-per-node {count}" in text


def test_several_hosts_need_their_layout(monkeypatch):
    monkeypatch.delenv("TPU_HOST_BOUNDS", raising=False)
    monkeypatch.delenv("TPU_TOPOLOGY", raising=False)
    with pytest.raises(chips.ChipBindingError, match="4 TPU hosts: set TPU_TOPOLOGY"):
        chips.host_bounds(4, (2, 2, 1))
    monkeypatch.setenv("TPU_TOPOLOGY", "4x4")
    with pytest.raises(chips.ChipBindingError, match="does not hold 2 host"):
        chips.host_bounds(2, (2, 2, 1))
    monkeypatch.setenv("TPU_TOPOLOGY", "4x")
    with pytest.raises(ValueError, match="torchtpu.config: TPU_TOPOLOGY='4x'"):
        chips.host_bounds(2, (2, 2, 1))


_IMPORT = r"""
import json, os, torch
from torchtpu.runtime import chips
seen = {k: os.environ.get(k) for k in chips.SET}
try:
    seen["sum"] = torch.ones(3, device="tpu").sum().item()
except RuntimeError as e:
    seen["error"] = str(e)
print("RESULT", json.dumps(seen))
"""


def _at_import(local_rank: int, local_size: int) -> dict:
    env = dict(os.environ, TORCHTPU_PLATFORM="cpu", TORCHTPU_TPU_HOST_CHIPS="2,2,1",
               LOCAL_RANK=str(local_rank), LOCAL_WORLD_SIZE=str(local_size),
               WORLD_SIZE=str(local_size), PYTHONPATH=os.pathsep.join(sys.path))
    for name in chips.SET:
        env.pop(name, None)
    proc = subprocess.run([sys.executable, "-c", _IMPORT], env=env, capture_output=True,
                          text=True, timeout=180)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def test_a_torchrun_process_is_bound_at_import():
    """Process 3 of 4 on a v5e-4 host, as torchrun starts it."""
    seen = _at_import(3, 4)
    assert seen["TPU_VISIBLE_CHIPS"] == "3" and seen["TPU_PROCESS_PORT"] == "8479"
    assert seen["TPU_PROCESS_BOUNDS"] == "2,2,1" and seen["CLOUD_TPU_TASK_ID"] == "3"
    assert seen["TPU_PROCESS_ADDRESSES"] == ",".join(f"localhost:{8476 + i}" for i in range(4))
    assert seen["sum"] == 3.0


def test_a_bad_binding_fails_at_the_first_device_use():
    seen = _at_import(0, 3)  # 3 processes on a 4-chip host: import works, the device refuses
    assert seen["TPU_VISIBLE_CHIPS"] is None
    assert seen["error"].startswith("torchtpu.device: 3 processes were started on a TPU host "
                                    "with 4 chips"), seen


def _two_hosts(rank: int, world: int, port: int, per_host: int, host_chips: str):
    """One process of two hosts, slotted as torchrun's environment says, bound at the group's
    creation; its variables and an all-reduce's result."""
    import torch.distributed as dist

    os.environ.update(TORCHTPU_TPU_HOST_CHIPS=host_chips, LOCAL_RANK=str(rank % per_host),
                      LOCAL_WORLD_SIZE=str(per_host), GROUP_RANK=str(rank // per_host))
    for name in chips.SET:
        os.environ.pop(name, None)
    try:
        dist.init_process_group("tpu_dist", init_method=f"tcp://127.0.0.1:{port}", rank=rank,
                                world_size=world, timeout=datetime.timedelta(seconds=60))
    except RuntimeError as e:
        return {"error": str(e)}
    x = torch.full((2,), float(rank + 1), device="tpu")
    dist.all_reduce(x)
    seen = {k: os.environ.get(k) for k in chips.SET}
    seen["sum"] = x.sum().item()
    dist.destroy_process_group()
    return seen


def test_two_hosts_are_bound_at_init_process_group():
    """Four processes playing two hosts of two chips (1x2 each: a 2x2 slice of 2 hosts)."""
    out = run(_two_hosts, 4, args=(free_port(), 2, "1,2,1"), init=False, timeout=240,
              env={"TORCHTPU_PLATFORM": "cpu"})
    address = out[0]["TPU_PROCESS_ADDRESSES"].split(",")
    assert len(address) == 4 and [a.split(":")[1] for a in address] == ["8476", "8477"] * 2
    for rank, seen in enumerate(out):
        assert seen["sum"] == 20.0  # (1 + 2 + 3 + 4) on both elements
        assert seen["TPU_VISIBLE_CHIPS"] == str(rank % 2)
        assert seen["CLOUD_TPU_TASK_ID"] == str(rank)
        assert seen["TPU_PROCESS_BOUNDS"] == "1,4,1"
        assert seen["TPU_PROCESS_ADDRESSES"] == out[0]["TPU_PROCESS_ADDRESSES"]


def test_a_host_that_does_not_divide_is_refused_at_init_process_group():
    out = run(_two_hosts, 2, args=(free_port(), 2, "1,3,1"), init=False, timeout=240,
              env={"TORCHTPU_PLATFORM": "cpu"})
    for seen in out:
        assert seen["error"].startswith("torchtpu.device: 2 processes were started on a TPU "
                                        "host with 3 chips"), seen
