"""tpu_dist on tpu tensors against torch's gloo on CPU tensors, side by side in one run.

Two processes on localhost. Each builds the default tpu_dist group and a gloo group over the
same ranks, then times all_reduce and all_gather (latency at 16 B; bandwidth at 1 MB and 64 MB:
median of ``--iters`` calls after warm-up, barrier before each) with tpu_dist on tpu tensors and
gloo on CPU tensors, their calls interleaved so that load from other processes falls on both.
Last, one DDP training step of a TinyGPT on tpu (its gradients in several 1 MB buckets, so their
all-reduces can overlap the rest of backward): its time with DDP minus the same step without DDP
is the communication overhead, set against the time of the same bucket all-reduces alone (what
overlapping them with backward hides). ``--ops all_to_all_uneven`` times ``all_to_all_single``
with uneven splits instead (rank 0 sends 1/4 of its rows to itself, rank 1 1/3; the XLA
transport's padded program against the host path and gloo); ``--no-ddp`` skips the DDP step.

``--transport`` picks tpu_dist's transport: ``host`` (gloo over host memory, XLA:CPU's default),
``xla`` (XLA collective programs; JAX's multi-process runtime starts at init_process_group), or
``both``: the default group uses XLA and a second group the host transport, timed side by side
in the same processes (the DDP row then runs once per transport too).

    python bench/collectives.py [--iters 10] [--big-iters 3] [--ddp-only] [--transport both]
                                [--ops all_reduce,all_gather,all_to_all_uneven] [--no-ddp]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from torchtpu.distributed.spawn import run

SIZES = (("16 B", 4), ("1 MB", 1 << 18), ("64 MB", 1 << 24))  # float32 elements


def _once(fn, sync) -> float:
    dist.barrier()
    t = time.perf_counter()
    fn()
    sync()
    return time.perf_counter() - t


def _tpu_sync():
    torch.tpu.synchronize()


def _no_sync():
    pass


def _side_by_side(fns: list, iters: int) -> list[float]:
    """The median time of each (fn, sync), their calls interleaved (in turn first), so that
    load from other processes falls on all of them alike."""
    for fn, sync in fns:
        fn()  # warm-up (compiles what it needs)
        sync()
    times = [[] for _ in fns]
    for i in range(iters):
        order = list(range(len(fns)))
        order = order[i % len(order):] + order[:i % len(order)]
        for j in order:
            times[j].append(_once(*fns[j]))
    return [statistics.median(ts) for ts in times]


def _groups(transport: str) -> dict:
    """{label: tpu_dist group} for the transports to time (None: the default group)."""
    if transport != "both":
        return {f"tpu_dist {transport}": None}
    from torchtpu.distributed import Transport

    return {"tpu_dist xla": None, "tpu_dist host": dist.new_group(pg_options=Transport("host"))}


def _uneven(rank: int, n: int) -> tuple[list, list]:
    """(input splits, output splits) of 2 ranks' n rows each, rank r keeping 1/(4 + r)."""
    keep = [n // 4, n // 5]
    ins = [[keep[0], n - keep[0]], [n - keep[1], keep[1]]]
    return ins[rank], [ins[0][rank], ins[1][rank]]


def _collectives(rank, world, iters, big_iters, groups, ops):
    gloo = dist.new_group(backend="gloo")
    rows = []
    for label, n in SIZES:
        k = big_iters if n >= 1 << 24 else iters
        for op in ops:
            names, fns = [], []
            timed = [(name, "tpu", group) for name, group in groups.items()]
            for name, device, group in (*timed, ("gloo", "cpu", gloo)):
                x = torch.ones(n, device=device)
                out = torch.empty(world * n, device=device)
                if op == "all_reduce":
                    def fn(x=x, group=group):
                        dist.all_reduce(x, group=group)
                elif op == "all_to_all_uneven":
                    ins, outs = _uneven(rank, n)
                    out = torch.empty(sum(outs), device=device)

                    def fn(x=x, out=out, group=group, ins=ins, outs=outs):
                        dist.all_to_all_single(out, x, outs, ins, group=group)
                else:
                    def fn(x=x, out=out, group=group):
                        dist.all_gather_into_tensor(out, x, group=group)
                names.append(name)
                fns.append((fn, _tpu_sync if device == "tpu" else _no_sync))
            rows.append((op, label, dict(zip(names, _side_by_side(fns, k)))))
            del fns, x, out  # 64 MB of each: let go before the next size
    return rows


def _ddp_overhead(rank, world, iters, group):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchtpu.demo.gpt import TinyGPT

    torch.manual_seed(0)
    data = torch.randint(0, 65, (8, 33))
    x, y = data[:, :-1].to("tpu"), data[:, 1:].to("tpu")

    def stepper(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()

        return step

    def make():
        torch.manual_seed(1)
        return TinyGPT(vocab=65, block=32, n_layer=4, n_embd=128).to("tpu")

    plain, model = stepper(make()), DDP(make(), bucket_cap_mb=1, process_group=group)
    ddp = stepper(model)
    for _ in range(3):  # DDP rebuilds its buckets after the first step, and logs them later
        ddp()
    logged = model._get_ddp_logging_data()
    sizes = logged.get("rebuilt_bucket_sizes", logged["bucket_sizes"])
    buckets = [torch.ones(int(b) // 4, device="tpu") for b in sizes.split(",")]

    def communication():  # DDP's bucket all-reduces alone: launched in turn, then waited for
        for w in [dist.all_reduce(b, group=group, async_op=True) for b in buckets]:
            w.wait()

    with_ddp, without, alone = _side_by_side(
        [(ddp, _tpu_sync), (plain, _tpu_sync), (communication, _tpu_sync)], iters)
    params = sum(p.numel() for p in model.parameters())
    return with_ddp, without, alone, params, len(buckets)


def _body(rank, world, iters, big_iters, ddp_only, transport, ops, ddp):
    groups = _groups(transport)
    rows = [] if ddp_only else _collectives(rank, world, iters, big_iters, groups, ops)
    return rows, {name: _ddp_overhead(rank, world, iters, group)
                  for name, group in groups.items()} if ddp else {}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--big-iters", type=int, default=3)
    p.add_argument("--ddp-only", action="store_true", help="only the DDP step")
    p.add_argument("--no-ddp", action="store_true", help="no DDP step")
    p.add_argument("--ops", default="all_reduce,all_gather",
                   help="comma-separated: all_reduce, all_gather, all_to_all_uneven")
    p.add_argument("--transport", choices=("host", "xla", "both"), default="host",
                   help="tpu_dist's transport(s) to time (default: host, XLA:CPU's default)")
    a = p.parse_args()
    env = {"TORCHTPU_DIST_TRANSPORT": "host" if a.transport == "host" else "xla"}
    ops = [o.strip() for o in a.ops.split(",")]
    rows, ddps = run(_body, 2, args=(a.iters, a.big_iters, a.ddp_only, a.transport, ops,
                                     not a.no_ddp),
                     timeout=1200, pg_timeout=300, env=env)[0]
    names = [name for name in (rows[0][2] if rows else {}) if name != "gloo"]
    print("| op | size | " + " | ".join(f"{n} (tpu)" for n in names) + " | gloo (CPU) | "
          + " | ".join(f"{n} / gloo time" for n in names) + " |")
    print("| --- | --- |" + " --- |" * (2 * len(names) + 1))
    for op, label, times in rows:
        theirs = times["gloo"]
        print(f"| {op} | {label} | " + " | ".join(f"{times[n] * 1e3:.2f} ms" for n in names)
              + f" | {theirs * 1e3:.2f} ms | "
              + " | ".join(f"{times[n] / theirs:.2f}x" for n in names) + " |")
    for name, (ddp, plain, alone, params, buckets) in ddps.items():
        overhead = ddp - plain
        print(f"\nDDP TinyGPT step over {name} (2 processes, {params} parameters, "
              f"{params * 4 / 1e6:.2f} MB of gradients in {buckets} buckets): {ddp * 1e3:.1f} ms "
              f"with DDP, {plain * 1e3:.1f} ms without; communication overhead "
              f"{overhead * 1e3:.1f} ms. The buckets' all-reduces alone take {alone * 1e3:.1f} "
              f"ms: {(alone - overhead) * 1e3:.1f} ms of them ({(alone - overhead) / alone:.0%}) "
              "hidden behind backward")


if __name__ == "__main__":
    main()
