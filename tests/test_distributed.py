"""tpu_dist in real processes: collectives against values computed on CPU, DDP against
single-process full-batch training, a torchrun launch. Each test is one multi-process run sharing
a few shapes; ranks that disagree or die are ``test_distributed_errors.py``'s."""

import os
import time

import pytest
import torch
import torch.distributed as dist

from torchtpu.distributed.spawn import run


def _cpu(t):
    return t.detach().cpu()


def _collectives(rank, world):
    """Every collective once on tpu tensors; returns (name, got, expected) triples."""
    checks = []
    dev = torch.device("tpu")
    base = torch.arange(6, dtype=torch.float32).reshape(2, 3)
    mine = base + 10 * rank
    every = [base + 10 * r for r in range(world)]
    big = torch.linspace(0, 1, 4096) + rank  # above the inline size: the bulk path

    for op, reduce in [
        (dist.ReduceOp.SUM, lambda rows: rows.sum(0)),
        (dist.ReduceOp.AVG, lambda rows: rows.mean(0)),
        (dist.ReduceOp.MIN, lambda rows: rows.min(0).values),
        (dist.ReduceOp.MAX, lambda rows: rows.max(0).values),
        (dist.ReduceOp.PRODUCT, lambda rows: rows.prod(0)),
        (dist._make_nccl_premul_sum(0.5), lambda rows: rows.sum(0) * 0.5),
    ]:
        for shift, value in [(10, base), (1, torch.linspace(0, 1, 4096))]:  # inline and bulk
            x = (value + shift * rank).to(dev)
            dist.all_reduce(x, op=op)
            rows = torch.stack([value + shift * r for r in range(world)])
            checks.append((f"all_reduce {op} {tuple(value.shape)}", _cpu(x), reduce(rows)))
    # Bulk all_reduce writes the buffer in place: work dispatched before it still reads the old
    # value, and views (which do not own their storage) take the copying path.
    value = torch.linspace(0, 1, 4096) + rank
    x = value.to(dev)
    doubled = x * 2
    dist.all_reduce(x)
    whole = torch.stack([torch.linspace(0, 1, 4096) + r for r in range(world)]).sum(0)
    checks.append(("work before an in-place all_reduce", _cpu(doubled), value * 2))
    checks.append(("in-place all_reduce", _cpu(x), whole))
    x = value.to(dev)
    dist.all_reduce(x[1:])
    checks.append(("all_reduce of a view", _cpu(x), torch.cat([value[:1], whole[1:]])))
    bits = torch.tensor([1, 2, 4, 8], dtype=torch.int32) << rank
    for op, fn in [(dist.ReduceOp.BAND, torch.bitwise_and), (dist.ReduceOp.BOR, torch.bitwise_or),
                   (dist.ReduceOp.BXOR, torch.bitwise_xor)]:
        x = bits.to(dev)
        dist.all_reduce(x, op=op)
        expect = torch.tensor([1, 2, 4, 8], dtype=torch.int32)
        for r in range(1, world):
            expect = fn(expect, torch.tensor([1, 2, 4, 8], dtype=torch.int32) << r)
        checks.append((f"all_reduce {op}", _cpu(x), expect))

    work = dist.all_reduce(mine.to(dev), async_op=True)
    work.wait()
    checks.append(("async all_reduce", _cpu(work.get_future().wait()[0]), sum(every)))

    # A bulk async_op=True collective returns before its transfer ends (rank 1 joins late) and
    # runs on the group's communication thread; wait() blocks until the result is in place.
    late = (torch.linspace(0, 1, 4096) + rank).to(dev)
    if rank == 1:
        time.sleep(1.0)
    start = time.monotonic()
    work = dist.all_reduce(late, async_op=True)
    returned, pending = time.monotonic() - start, not work.is_completed()
    work.wait()
    checks.append(("async bulk all_reduce returns at once",
                   rank == 1 or (pending and returned < 0.5), True))
    checks.append(("async bulk all_reduce", _cpu(late), whole))
    # gloo reads a bulk input's device buffer in place, on the communication thread. Rank 0's
    # thread writes views of the inputs while the transfers wait for rank 1 (which starts once
    # told the writes are done): a view write would donate that buffer to be overwritten, but a
    # lent one is copied instead, so the transfers still read the values they were given.
    flight = [(torch.linspace(0, 1, 4096) + rank).to(dev) for _ in range(3)]
    store = dist.distributed_c10d._get_default_store()
    if rank != 0:
        store.wait(["views written"])
    works = [dist.all_reduce(x, async_op=True) for x in flight]
    if rank == 0:
        for x in flight:
            x[:2048].zero_()
        store.set("views written", "1")
    for work in works:
        work.wait()
    checks.append(("views written while all_reduce is in flight",
                   torch.stack([_cpu(x) for x in flight]), whole.expand(3, -1)))

    outs = [torch.empty(2, 3, device=dev) for _ in range(world)]
    dist.all_gather(outs, mine.to(dev))
    checks.append(("all_gather", torch.stack([_cpu(o) for o in outs]), torch.stack(every)))
    flat = torch.empty(world * 4096, device=dev)
    dist.all_gather_into_tensor(flat, big.to(dev))
    checks.append(("all_gather_into_tensor", _cpu(flat),
                   torch.cat([torch.linspace(0, 1, 4096) + r for r in range(world)])))

    chunks = torch.arange(world * 3, dtype=torch.float32) * (rank + 1)
    out = torch.empty(3, device=dev)
    dist.reduce_scatter_tensor(out, chunks.to(dev))
    total = sum(torch.arange(world * 3, dtype=torch.float32) * (r + 1) for r in range(world))
    checks.append(("reduce_scatter_tensor", _cpu(out), total[3 * rank: 3 * rank + 3]))
    out = torch.empty(3, device=dev)
    dist.reduce_scatter(out, [c.to(dev) for c in chunks.split(3)], op=dist.ReduceOp.MAX)
    checks.append(("reduce_scatter", _cpu(out),
                   (torch.arange(world * 3.0) * world)[3 * rank: 3 * rank + 3]))

    x = mine.to(dev)
    dist.broadcast(x, src=world - 1)
    checks.append(("broadcast", _cpu(x), every[-1]))
    objs = [{"rank": rank}, "x" * rank]
    dist.broadcast_object_list(objs, src=1)
    checks.append(("broadcast_object_list", objs, [{"rank": 1}, "x"]))

    send = torch.arange(world * 2, dtype=torch.float32) + 100 * rank
    recv = torch.empty(world * 2, device=dev)
    dist.all_to_all_single(recv, send.to(dev))
    checks.append(("all_to_all_single", _cpu(recv),
                   torch.cat([torch.arange(2.0 * rank, 2.0 * rank + 2) + 100 * r
                              for r in range(world)])))
    outs = [torch.empty(2, device=dev) for _ in range(world)]
    dist.all_to_all(outs, [c.to(dev) for c in send.split(2)])
    checks.append(("all_to_all", torch.cat([_cpu(o) for o in outs]), _cpu(recv)))

    gathered = [torch.empty(2, 3, device=dev) for _ in range(world)] if rank == 0 else None
    dist.gather(mine.to(dev), gathered, dst=0)
    if rank == 0:
        checks.append(("gather", torch.stack([_cpu(g) for g in gathered]), torch.stack(every)))
    out = torch.empty(2, 3, device=dev)
    dist.scatter(out, [e.to(dev) for e in every] if rank == 0 else None, src=0)
    checks.append(("scatter", _cpu(out), every[rank]))
    x = mine.to(dev)
    dist.reduce(x, dst=0)
    if rank == 0:
        checks.append(("reduce", _cpu(x), sum(every)))

    if rank == 0:
        dist.send(mine.to(dev), dst=1)
    elif rank == 1:
        got = torch.empty(2, 3, device=dev)
        dist.recv(got, src=0)
        checks.append(("send/recv", _cpu(got), every[0]))
    if rank == 0:  # recv from any source: dist.recv returns the sender
        got = torch.empty(2, 3, device=dev)
        checks.append(("recv from any source: sender", dist.recv(got), 1))
        checks.append(("recv from any source", _cpu(got), every[1]))
    elif rank == 1:
        dist.send(mine.to(dev), dst=0)
    # A ring exchange: every rank posts its send before its receive, so neither may block
    # before wait().
    ring = torch.empty(2, 3, device=dev)
    reqs = dist.batch_isend_irecv([dist.P2POp(dist.isend, mine.to(dev), (rank + 1) % world),
                                   dist.P2POp(dist.irecv, ring, (rank - 1) % world)])
    for req in reqs:
        req.wait()
    checks.append(("batch_isend_irecv ring", _cpu(ring), every[(rank - 1) % world]))
    # _coalescing_manager: captured all_reduces become one allreduce_coalesced; with a device,
    # the ops in between (here a bulk all_reduce and a broadcast) share one Work.
    a, b = mine.to(dev), (torch.linspace(0, 1, 4096) + rank).to(dev)
    with dist._coalescing_manager(async_ops=True) as cm:
        dist.all_reduce(a)
        dist.all_reduce(b)
    cm.wait()
    checks.append(("coalesced all_reduce", (_cpu(a), _cpu(b)), (sum(every), whole)))
    a, b = mine.to(dev), (torch.linspace(0, 1, 4096) + rank).to(dev)
    with dist._coalescing_manager(device=dev, async_ops=True) as cm:
        dist.all_reduce(b)
        dist.broadcast(a, src=1)
    cm.wait()
    checks.append(("coalescing with a device", (_cpu(a), _cpu(b)), (every[1], whole)))
    dist.barrier()

    import torch.distributed._functional_collectives as fc

    y = fc.all_reduce(mine.to(dev), "sum", dist.group.WORLD)
    checks.append(("functional all_reduce", _cpu(y), sum(every)))
    y = fc.all_gather_tensor(mine.to(dev), 0, dist.group.WORLD)
    checks.append(("functional all_gather_tensor", _cpu(y), torch.cat(every)))
    y = fc.reduce_scatter_tensor(chunks.to(dev), "sum", 0, dist.group.WORLD)
    checks.append(("functional reduce_scatter_tensor", _cpu(y), total[3 * rank: 3 * rank + 3]))
    y = torch.ops._c10d_functional.broadcast(mine.to(dev), 0, dist.group.WORLD.group_name)
    y = torch.ops._c10d_functional.wait_tensor(y)
    checks.append(("_c10d_functional.broadcast", _cpu(y), every[0]))

    sub = dist.new_group([0, 1])
    if rank in (0, 1):
        x = mine.to(dev)
        dist.all_reduce(x, group=sub)
        checks.append(("new_group all_reduce", _cpu(x), every[0] + every[1]))
    checks.append(("default backend", dist.get_default_backend_for_device("tpu"), "tpu_dist"))
    return [(name, got, expect) for name, got, expect in checks]


def _assert_checks(results):
    for rank, checks in enumerate(results):
        for name, got, expect in checks:
            if isinstance(expect, (torch.Tensor, tuple)):
                torch.testing.assert_close(got, expect, msg=lambda m, n=name, r=rank:
                                           f"rank {r}: {n}: {m}")
            else:
                assert got == expect, f"rank {rank}: {name}: {got!r} != {expect!r}"


def test_collectives_match_cpu():
    _assert_checks(run(_collectives, 2))


def test_host_buffers_lent_to_arrays_are_reused_once_free():
    """A bulk result's host buffer becomes its device array without a copy (XLA:CPU), and is
    written again only once that array is gone."""
    import jax
    import numpy as np

    from torchtpu.distributed import host
    from torchtpu.runtime import platform

    pool = host._HostBuffers()
    first = pool.take(4096)
    array = jax.device_put(first.view(np.float32), platform.local_device())
    lent = first.ctypes.data
    assert array.unsafe_buffer_pointer() == lent
    del first
    assert pool.take(4096).ctypes.data != lent  # still the array's
    del array
    assert pool.take(4096).ctypes.data == lent


def _ddp(rank, world):
    """DDP with the CUDA idioms (tpu:LOCAL_RANK, set_device_index, device_ids) on TinyGPT."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchtpu.demo.gpt import TinyGPT

    local = int(os.environ["LOCAL_RANK"])
    assert torch.accelerator.device_count() >= world
    torch.accelerator.set_device_index(local)
    device = torch.device(f"{torch.accelerator.current_accelerator()}:{local}")
    torch.manual_seed(0)
    data = torch.randint(0, 17, (3, 16, 9))  # 3 steps of 16 sequences; every call sees 4
    micro = 4  # one shape for every forward: programs compile once

    def make():
        torch.manual_seed(1)
        return TinyGPT(vocab=17, block=8).to(device)

    def accumulate(model, rows, parts):
        for part in rows.split(micro):
            _, loss = model(part[:, :-1].to(device), part[:, 1:].to(device))
            (loss / parts).backward()

    ref = make()  # single process: the mean gradient of all 16 sequences of a step
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    for batch in data:
        ref_opt.zero_grad()
        accumulate(ref, batch, 4)
        ref_opt.step()

    # Small buckets: several bulk all-reduces in flight on the communication thread while
    # backward goes on (gloo writing device buffers in place there crashed this).
    model = DDP(make(), device_ids=[local], gradient_as_bucket_view=True, bucket_cap_mb=0.02)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    share = 16 // world
    for i, batch in enumerate(data):
        mine = batch[rank * share:(rank + 1) * share]
        opt.zero_grad()
        if i == 2:
            # no_sync: the first micro-batches accumulate locally; the last one synchronizes.
            with model.no_sync():
                accumulate(model, mine[:-micro], share // micro)
            accumulate(model, mine[-micro:], share // micro)
        else:  # every backward averages across ranks (accumulating into the bucket views)
            accumulate(model, mine, share // micro)
        opt.step()
    # With gradient_as_bucket_view the gradients are views into a few shared bucket storages.
    grads = [p.grad for p in model.parameters()]
    bucket_views = len({g.untyped_storage().data_ptr() for g in grads}) < len(grads)
    logged = model._get_ddp_logging_data()
    return {
        "devices": {str(p.device) for p in model.parameters()},
        "bucket_views": bucket_views,
        "buckets": len(logged.get("rebuilt_bucket_sizes", logged["bucket_sizes"]).split(",")),
        "diff": max((a - b).abs().max().item()
                    for a, b in zip(model.module.parameters(), ref.parameters())),
        "unused": _ddp_unused(rank, world, device),
    }


class _Branchy(torch.nn.Module):
    """A branch only some ranks' steps take, and a layer no rank ever uses."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(2)
        self.a, self.b, self.never = (torch.nn.Linear(4, 4) for _ in range(3))

    def forward(self, x, branch):
        h = self.a(x).tanh()
        return (h + self.b(h)) if branch else h


def _ddp_unused(rank, world, device):
    """DDP(find_unused_parameters=True) against single-process training of the same steps: in
    step i only rank i % world takes the branch, so the branch's gradient averages with zeros."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(3)
    data = torch.randn(2, world, 2, 4)
    ref = _Branchy().to(device)
    ref_opt = torch.optim.SGD(ref.parameters(), lr=0.5)
    model = DDP(_Branchy().to(device), device_ids=[rank], find_unused_parameters=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.5)
    for i, step in enumerate(data):
        ref_opt.zero_grad()
        for r in range(world):
            (ref(step[r].to(device), r == i % world).square().mean() / world).backward()
        ref_opt.step()
        opt.zero_grad()
        model(step[rank].to(device), rank == i % world).square().mean().backward()
        opt.step()
    return {
        "diff": max((a - b).abs().max().item()
                    for a, b in zip(model.module.parameters(), ref.parameters())),
        "never has no grad": model.module.never.weight.grad is None,
        "b moved": (model.module.b.weight - _Branchy().b.weight.to(device)).abs().max().item(),
    }


@pytest.mark.full  # ~35 s on CI's box; DDP's training runs in main in test_compiled_ddp
def test_ddp_gpt_equals_full_batch():
    for out in run(_ddp, 2, timeout=300):
        assert out["devices"] == {"tpu:0"}
        assert out["bucket_views"] and out["buckets"] >= 3, out
        assert out["diff"] < 2e-5, out
        unused = out["unused"]
        assert unused["diff"] < 1e-6 and unused["never has no grad"], unused
        assert unused["b moved"] > 1e-3, unused


def test_every_collective_is_the_groups_own():
    # A collective the group does not define falls to c10d's C++ default, which may still give
    # the right numbers through the gloo backend without libtpu and fails with it ("No backend
    # type associated with device type tpu"): a renamed method shows only there.
    from torchtpu.distributed.group import TpuProcessGroup

    base = dist.ProcessGroup
    names = ("allreduce", "allreduce_coalesced", "reduce", "reduce_scatter",
             "reduce_scatter_tensor_coalesced", "allgather", "allgather_coalesced",
             "allgather_into_tensor_coalesced", "gather", "broadcast", "scatter", "alltoall",
             "alltoall_base", "barrier", "send", "recv", "recv_anysource")
    assert [n for n in names if getattr(TpuProcessGroup, n) is getattr(base, n)] == []


def test_backend_default_without_process_group():
    assert dist.get_default_backend_for_device("tpu") == "tpu_dist"
    assert "tpu_dist" in dist.Backend.backend_list and "tpu" in dist.Backend.backend_list


def test_index_of_another_process_raises():
    with pytest.raises(RuntimeError, match="invalid tpu device index 1"):
        torch.ones(2, device="tpu:1")


_TORCHRUN_SCRIPT = """
import os, torch, torch.distributed as dist
dist.init_process_group("cpu:gloo,tpu:tpu_dist")
local = int(os.environ["LOCAL_RANK"])
x = torch.full((4,), float(dist.get_rank() + 1), device=f"tpu:{local}")
dist.all_reduce(x)
c = torch.ones(2)
dist.all_reduce(c)  # a CPU tensor: gloo
print("RESULT", dist.get_rank(), x.sum().item(), c.sum().item(), torch.tpu.device_count())
dist.destroy_process_group()
"""


@pytest.mark.full  # a real torchrun launch (~30 s)
def test_torchrun_launch(tmp_path):
    import signal
    import subprocess
    import sys

    from torchtpu.distributed.spawn import free_port

    script = tmp_path / "job.py"
    script.write_text(_TORCHRUN_SCRIPT)
    proc = subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2",
         "--master-port", str(free_port()), str(script)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=180)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out
    lines = sorted(line.split()[1:] for line in out.splitlines() if line.startswith("RESULT"))
    assert lines == [["0", "12.0", "4.0", "2"], ["1", "12.0", "4.0", "2"]], out
