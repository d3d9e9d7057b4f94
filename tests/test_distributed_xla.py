"""tpu_dist's two transports side by side: XLA collective programs and the host (gloo) path.

One 2-process run starts JAX's multi-process runtime (TORCHTPU_DIST_TRANSPORT=xla on XLA:CPU)
and runs every case on the default group (XLA) and on a second group forced to the host
transport, against values computed on CPU; then a DDP step on each, mismatched collectives and a
rank that hangs. The start-up-order rules (a tpu tensor made before init_process_group) are
checked in this process, where JAX's backend has started and its multi-process runtime has not.
"""

import collections
import datetime

import pytest
import torch
import torch.distributed as dist

from torchtpu import settings
from torchtpu.distributed.spawn import run
from torchtpu.testing.distributed import outwait_timeout


def _cases(rank, world, group):
    """Every XLA-served collective once on group; {name: (got, expected)}."""
    dev = torch.device("tpu")
    out = {}
    base = torch.arange(6.0).reshape(2, 3) - 2
    rows = torch.stack([base + 3 * r for r in range(world)])
    for name, op, fold in [
        ("sum", dist.ReduceOp.SUM, rows.sum(0)), ("avg", dist.ReduceOp.AVG, rows.mean(0)),
        ("min", dist.ReduceOp.MIN, rows.min(0).values),
        ("max", dist.ReduceOp.MAX, rows.max(0).values),
        ("product", dist.ReduceOp.PRODUCT, rows.prod(0)),
        ("premul_sum", dist._make_nccl_premul_sum(0.5), rows.sum(0) * 0.5),
    ]:
        x = (base + 3 * rank).to(dev)
        dist.all_reduce(x, op=op, group=group)
        out[f"all_reduce {name}"] = (x.cpu(), fold)
    bits = torch.tensor([1, 2, 4, 8], dtype=torch.int32) << rank
    every = [torch.tensor([1, 2, 4, 8], dtype=torch.int32) << r for r in range(world)]
    for name, op, fn in [("band", dist.ReduceOp.BAND, torch.bitwise_and),
                         ("bor", dist.ReduceOp.BOR, torch.bitwise_or),
                         ("bxor", dist.ReduceOp.BXOR, torch.bitwise_xor)]:
        x = bits.to(dev)
        dist.all_reduce(x, op=op, group=group)
        expect = every[0]
        for e in every[1:]:
            expect = fn(expect, e)
        out[f"all_reduce {name}"] = (x.cpu(), expect)
    x = torch.tensor(1.5 + rank).to(dev)  # a scalar
    dist.all_reduce(x, group=group)
    out["all_reduce scalar"] = (x.cpu(), torch.tensor(sum(1.5 + r for r in range(world))))
    value = torch.arange(6.0).reshape(2, 3) + rank
    x = value.to(dev)
    dist.all_reduce(x[1], group=group)  # a view: the rest of its storage keeps its values
    out["all_reduce of a view"] = (x.cpu(), torch.stack(
        [value[0], sum(torch.arange(3.0, 6.0) + r for r in range(world))]))
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        y = (torch.arange(3.0, device=dev) + rank).sin()  # pending when the collective reads it
        dist.all_reduce(y, group=group)
        out["all_reduce of a pending value"] = (
            y.cpu(), sum((torch.arange(3.0) + r).sin() for r in range(world)))

    x = (torch.arange(3.0) + 10 * rank).to(dev)
    gathered = torch.stack([torch.arange(3.0) + 10 * r for r in range(world)])
    flat = torch.empty(world, 3, device=dev)  # 2-D output of a 1-D input
    dist.all_gather_into_tensor(flat, x, group=group)
    out["all_gather_into_tensor"] = (flat.cpu(), gathered)
    outs = [torch.empty(3, device=dev) for _ in range(world)]
    dist.all_gather(outs, x, group=group)
    out["all_gather"] = (torch.stack([o.cpu() for o in outs]), gathered)

    chunks = (torch.arange(world * 3.0) - 2) * (rank + 1)
    every = torch.stack([(torch.arange(world * 3.0) - 2) * (r + 1) for r in range(world)])
    mine = slice(3 * rank, 3 * rank + 3)
    for name, op, fold in [("sum", dist.ReduceOp.SUM, every.sum(0)),
                           ("max", dist.ReduceOp.MAX, every.max(0).values)]:
        o = torch.empty(3, device=dev)
        dist.reduce_scatter_tensor(o, chunks.to(dev), op=op, group=group)
        out[f"reduce_scatter_tensor {name}"] = (o.cpu(), fold[mine])
    o = torch.empty(3, device=dev)
    dist.reduce_scatter(o, [c.to(dev) for c in chunks.split(3)], op=dist.ReduceOp.AVG,
                        group=group)
    out["reduce_scatter avg"] = (o.cpu(), every.mean(0)[mine])

    special = torch.tensor([-0.0, float("nan"), float("inf"), 1e-40]) * (rank + 1)
    x = special.to(dev)
    dist.broadcast(x, src=1, group=group)
    out["broadcast (-0.0, nan, inf, subnormal)"] = (
        x.cpu(), torch.tensor([-0.0, float("nan"), float("inf"), 1e-40]) * 2)
    x = (torch.arange(4) + 2**40 * rank).to(dev)
    dist.broadcast(x, src=0, group=group)
    out["broadcast int64"] = (x.cpu(), torch.arange(4))

    send = torch.arange(world * 2.0) + 100 * rank
    recv = torch.empty(world * 2, device=dev)
    dist.all_to_all_single(recv, send.to(dev), group=group)
    out["all_to_all_single"] = (recv.cpu(), torch.cat(
        [torch.arange(2.0 * rank, 2.0 * rank + 2) + 100 * r for r in range(world)]))
    # Uneven splits (rank r sends r + 1 elements to each rank): one padded XLA program.
    send = torch.full((world * (rank + 1),), float(rank))
    recv = torch.empty(sum(r + 1 for r in range(world)), device=dev)
    dist.all_to_all_single(recv, send.to(dev), [r + 1 for r in range(world)],
                           [rank + 1] * world, group=group)
    out["all_to_all_single uneven"] = (recv.cpu(), torch.cat(
        [torch.full((r + 1,), float(r)) for r in range(world)]))
    # MoE dispatch's shape: rows of 3 values, a zero split, other input and output rows on
    # each rank (2 ranks: rank 0 sends [0, 2] rows, rank 1 [3, 0]).

    def split(r):
        return [(3 * r + 2 * j) % 5 for j in range(world)]

    def chunk(src, dst):
        v = 100 * src + 10 * dst + torch.arange(float(split(src)[dst]))
        return torch.stack([v, v + 0.5, -v], 1)

    expect = torch.cat([chunk(j, rank) for j in range(world)])
    recv = torch.empty(expect.shape, device=dev)
    dist.all_to_all_single(recv, torch.cat([chunk(rank, j) for j in range(world)]).to(dev),
                           [split(j)[rank] for j in range(world)], split(rank), group=group)
    out["all_to_all_single uneven rows"] = (recv.cpu(), expect)
    x = (base + 3 * rank).to(dev)
    dist.reduce(x, dst=0, group=group)
    out["reduce"] = (x.cpu(), rows.sum(0) if rank == 0 else base + 3 * rank)
    return out


def _captured_uneven(rank, world):
    """An uneven all_to_all_single inside torch.tpu.graph (MoE dispatch's shape: rows of 3
    values, a zero split, other input and output rows on each rank), between device ops;
    replayed on new input values: each replay's output and its counts (deltas around it)."""
    from torchtpu import metrics

    splits = [[0, 2], [3, 0]]  # splits[src][dst]: rows rank src sends rank dst
    rows_in, rows_out = sum(splits[rank]), sum(s[rank] for s in splits)
    static_in = torch.zeros(rows_in, 3, device="tpu")
    recv = torch.empty(rows_out, 3, device="tpu")
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        dist.all_to_all_single(recv, static_in * 2, [s[rank] for s in splits], splits[rank])
        static_out = recv.sin() + 1
    got = []
    for step in range(3):
        value = torch.arange(rows_in * 3.0).reshape(rows_in, 3) + 100 * rank + 10 * step
        static_in.copy_(value.to("tpu"))
        seq, before = dist.group.WORLD._seq, metrics.snapshot()
        g.replay()
        after = metrics.snapshot()
        counts = {k: after.get(k, 0) - before.get(k, 0)
                  for k in ("executions", "collective_programs", "captures")}
        counts["eager_collectives"] = dist.group.WORLD._seq - seq
        got.append((static_out.cpu(), counts))
    return got


def _captured_uneven_expected(rank, world, step):
    """The CPU values _captured_uneven's replay gives on rank, at step."""
    splits = [[0, 2], [3, 0]]
    parts = []
    for src in range(world):
        sent = (torch.arange(sum(splits[src]) * 3.0).reshape(-1, 3) + 100 * src + 10 * step) * 2
        start = sum(splits[src][:rank])
        parts.append(sent[start : start + splits[src][rank]])
    return torch.cat(parts).sin() + 1


def _ddp_step(rank, world, group):
    """One DDP step of a small MLP on group; its parameters afterwards."""
    from torch.nn.parallel import DistributedDataParallel as DDP

    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 2))
    data = torch.randn(world, 3, 4)
    ddp = DDP(model.to("tpu"), process_group=group)
    opt = torch.optim.SGD(ddp.parameters(), lr=0.5)
    ddp(data[rank].to("tpu")).square().mean().backward()
    opt.step()
    return [p.detach().cpu() for p in ddp.module.parameters()]


def _count_xla_launches() -> list:
    """The XLA collective programs this process launches from now on, by body name."""
    from torchtpu.distributed import uneven, xla

    launched, program, padded = [], xla._program, uneven._program

    def counted(op, *args, **kwargs):
        launched.append(op)
        return program(op, *args, **kwargs)

    def counted_uneven(*args):
        launched.append("all_to_all_uneven")
        return padded(*args)

    xla._program, uneven._program = counted, counted_uneven
    return launched


def _both(rank, world):
    from torchtpu.distributed import CollectiveMismatchError, Transport
    from torchtpu.distributed.xla import XlaProcessGroup

    default = dist.distributed_c10d._get_default_group()
    host = dist.new_group(pg_options=Transport("host"))
    # The default group's timeout leaves room for compiles on a loaded machine; this one's is
    # short for the hang below.
    quick = dist.new_group(timeout=datetime.timedelta(seconds=2))
    # Sub-groups get a mesh of their ranks' devices: rank r's own one-device group.
    subs = [dist.new_group([r]) for r in range(world)]
    mine = subs[rank]
    result = {"kinds": (type(default) is XlaProcessGroup, type(host) is XlaProcessGroup,
                        type(mine) is XlaProcessGroup)}
    launched = _count_xla_launches()
    result["xla"] = _cases(rank, world, None)
    result["xla launches"] = collections.Counter(launched)
    launched.clear()
    result["host"] = _cases(rank, world, host)
    result["host launches"] = list(launched)
    late = torch.full((3,), float(rank), device="tpu")
    work = dist.all_reduce(late, async_op=True)
    work.wait()
    result["async"] = late.cpu()
    x = torch.full((3,), float(rank), device="tpu")
    dist.all_reduce(x, group=mine)
    result["one-rank sub-group"] = x.cpu()
    result["ddp"] = (_ddp_step(rank, world, None), _ddp_step(rank, world, host))
    result["captured uneven"] = _captured_uneven(rank, world)

    errors = []
    for case in ("shape", "op"):
        try:
            if case == "shape":
                dist.all_reduce(torch.ones(4 + rank, device="tpu"))
            elif rank == 0:
                dist.all_reduce(torch.ones(4, device="tpu"))
            else:
                dist.broadcast(torch.ones(4, device="tpu"), 0)
            errors.append(None)
        except CollectiveMismatchError as e:
            errors.append(str(e))
    result["errors"] = errors
    try:  # splits that do not pair up: rank 0 sends [2, 0] rows, rank 1 expects 1 from it
        dist.all_to_all_single(torch.empty(2, device="tpu"), torch.ones(2, device="tpu"),
                               [1, 1], [2, 0] if rank == 0 else [1, 1])
        result["split error"] = None
    except CollectiveMismatchError as e:
        result["split error"] = str(e)
    x = torch.ones(3, device="tpu")
    dist.all_reduce(x)  # the group still works after mismatches
    result["after"] = x.cpu()
    # Past quick's timeout: rank 0's header exchange raises before any XLA program starts.
    result["hang"] = outwait_timeout(
        rank, 3, lambda: dist.all_reduce(torch.ones(4, device="tpu"), group=quick))
    return result


def test_xla_and_host_transports_match_cpu_and_each_other():
    results = run(_both, 2, pg_timeout=60, env={"TORCHTPU_DIST_TRANSPORT": "xla"}, timeout=300)
    for rank, out in enumerate(results):
        assert out["kinds"] == (True, False, True), out["kinds"]
        # The cases ran as XLA collective programs (reduce as an all_reduce; the uneven
        # all_to_all_singles as the padded program), the host group's as none.
        assert out["xla launches"] == {"all_reduce": 13, "all_gather": 2, "reduce_scatter": 3,
                                       "broadcast": 2, "all_to_all": 1,
                                       "all_to_all_uneven": 2}, out["xla launches"]
        assert out["host launches"] == [], out["host launches"]
        assert out["xla"].keys() == out["host"].keys()
        for name, (got, expect) in out["xla"].items():
            torch.testing.assert_close(got, expect, equal_nan=True,
                                       msg=lambda m, n=name, r=rank: f"rank {r}: xla {n}: {m}")
            torch.testing.assert_close(
                got, out["host"][name][0], equal_nan=True,
                msg=lambda m, n=name, r=rank: f"rank {r}: xla vs host {n}: {m}")
        sign = out["xla"]["broadcast (-0.0, nan, inf, subnormal)"][0][0]
        assert torch.signbit(sign), "broadcast lost the sign of -0.0"
        torch.testing.assert_close(out["async"], torch.full((3,), 1.0))
        torch.testing.assert_close(out["one-rank sub-group"], torch.full((3,), float(rank)))
        for a, b in zip(*out["ddp"], strict=True):
            torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
        for text in out["errors"]:
            assert text is not None
            assert f"this rank (rank {rank})" in text and f"rank {1 - rank} called" in text
        assert "float32[4]" in out["errors"][0] and "float32[5]" in out["errors"][0]
        assert "broadcast(src/dst 0)" in out["errors"][1]
        torch.testing.assert_close(out["after"], torch.full((3,), 2.0))
        # The uneven all_to_all_single captured: each replay is the one SPMD program with
        # the exchange inside, on the new input values; after the first (which compares the
        # program's collectives with the other rank's) no eager collective.
        for step, (got, counts) in enumerate(out["captured uneven"]):
            torch.testing.assert_close(got, _captured_uneven_expected(rank, 2, step))
            assert counts == {"executions": 1, "collective_programs": 1, "captures": 0,
                              "eager_collectives": int(step == 0)}, (rank, step, counts)
        assert "the split sizes do not pair up" in out["split error"], out["split error"]
        assert f"this is rank {rank}" in out["split error"]
    text, waited = results[0]["hang"]
    assert "timeout (2 s)" in text and waited < 2 + 3, (text, waited)
    for a, b in zip(results[0]["ddp"][0], results[1]["ddp"][0], strict=True):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_backend_started_first_falls_back_on_cpu_and_raises_on_tpu(monkeypatch):
    """A tpu tensor exists (JAX's backend started): the XLA transport cannot start."""
    from torchtpu.distributed import jax_runtime
    from torchtpu.runtime import platform

    torch.ones(1, device="tpu")
    monkeypatch.setenv(settings.DIST_TRANSPORT.name, "xla")
    monkeypatch.setattr(jax_runtime, "_unavailable", [None])
    monkeypatch.setattr(jax_runtime, "_warned", [False])
    # It records why, and starts nothing.
    jax_runtime.start(dist.HashStore(), 0, 2, datetime.timedelta(seconds=5), 0)
    assert "JAX's backend started before init_process_group" in jax_runtime._unavailable[0]
    with pytest.warns(UserWarning, match="host transport .* JAX's backend started before"):
        assert jax_runtime.choose(2) == "host"
    assert jax_runtime.choose(2) == "host"  # warned once
    assert jax_runtime.choose(1) == "xla"  # one process needs no multi-process runtime
    monkeypatch.setattr(platform, "platform", lambda: "tpu")
    with pytest.raises(RuntimeError, match="Call dist.init_process_group before creating any tpu"):
        jax_runtime.choose(2)
    monkeypatch.setenv(settings.DIST_TRANSPORT.name, "host")
    assert jax_runtime.choose(2) == "host"
    monkeypatch.delenv(settings.DIST_TRANSPORT.name)
    with pytest.raises(RuntimeError, match="cannot use XLA collectives on tpu"):
        jax_runtime.choose(2)  # TPU: XLA by default
    monkeypatch.setenv(settings.DIST_TRANSPORT.name, "nccl")
    with pytest.raises(ValueError, match="TORCHTPU_DIST_TRANSPORT='nccl' is not one of"):
        jax_runtime.choose(2)
    with pytest.raises(ValueError, match="Transport='gloo'"):
        jax_runtime.Transport("gloo")
