"""tpu_dist on tpu tensors against torch's gloo on CPU tensors, side by side in one run.

Two processes on localhost. Each builds the default tpu_dist group and a gloo group over the
same ranks, then times all_reduce and all_gather (latency at 16 B; bandwidth at 1 MB and 64 MB:
median of ``--iters`` calls after warm-up, barrier before each) with tpu_dist on tpu tensors and
gloo on CPU tensors. Last, one DDP training step of a TinyGPT on tpu (its gradients in several
1 MB buckets, so their all-reduces can overlap the rest of backward): its time with DDP minus the
same step without DDP is the communication overhead.

    python bench/collectives.py [--iters 10] [--big-iters 3] [--ddp-only]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
import torch.distributed as dist

from torchtpu.testing.distributed import run

SIZES = (("16 B", 4), ("1 MB", 1 << 18), ("64 MB", 1 << 24))  # float32 elements


def _time(fn, iters: int, sync) -> float:
    fn()  # warm-up (compiles what it needs)
    sync()
    times = []
    for _ in range(iters):
        dist.barrier()
        t = time.perf_counter()
        fn()
        sync()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def _tpu_sync():
    torch.tpu.synchronize()


def _collectives(rank, world, iters, big_iters):
    gloo = dist.new_group(backend="gloo")
    rows = []
    for label, n in SIZES:
        k = big_iters if n >= 1 << 24 else iters
        for op in ("all_reduce", "all_gather"):
            results = {}
            for name, device, group in (("tpu_dist", "tpu", None), ("gloo", "cpu", gloo)):
                x = torch.ones(n, device=device)
                out = torch.empty(world * n, device=device)
                if op == "all_reduce":
                    def fn(x=x, group=group):
                        dist.all_reduce(x, group=group)
                else:
                    def fn(x=x, out=out, group=group):
                        dist.all_gather_into_tensor(out, x, group=group)
                results[name] = _time(fn, k, _tpu_sync if device == "tpu" else lambda: None)
            rows.append((op, label, results["tpu_dist"], results["gloo"]))
    return rows


def _ddp_overhead(rank, world, iters):
    from torch.nn.parallel import DistributedDataParallel as DDP

    from torchtpu.testing.models import TinyGPT

    torch.manual_seed(0)
    data = torch.randint(0, 65, (8, 33))
    x, y = data[:, :-1].to("tpu"), data[:, 1:].to("tpu")

    def timed(model):
        opt = torch.optim.SGD(model.parameters(), lr=0.1)

        def step():
            _, loss = model(x, y)
            opt.zero_grad()
            loss.backward()
            opt.step()
            loss.item()

        return _time(step, iters, _tpu_sync)

    def make():
        torch.manual_seed(1)
        return TinyGPT(vocab=65, block=32, n_layer=4, n_embd=128).to("tpu")

    plain = timed(make())
    model = DDP(make(), bucket_cap_mb=1)
    params = sum(p.numel() for p in model.parameters())
    return plain, timed(model), params


def _body(rank, world, iters, big_iters, ddp_only):
    rows = [] if ddp_only else _collectives(rank, world, iters, big_iters)
    return rows, _ddp_overhead(rank, world, iters)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--iters", type=int, default=10)
    p.add_argument("--big-iters", type=int, default=3)
    p.add_argument("--ddp-only", action="store_true", help="only the DDP step")
    a = p.parse_args()
    rows, (plain, ddp, params) = run(_body, 2, args=(a.iters, a.big_iters, a.ddp_only),
                                     timeout=1200, pg_timeout=300)[0]
    print("| op | size | tpu_dist (tpu) | gloo (CPU) | tpu_dist / gloo time | bandwidth ratio |")
    print("| --- | --- | --- | --- | --- | --- |")
    for op, label, ours, theirs in rows:
        print(f"| {op} | {label} | {ours * 1e3:.2f} ms | {theirs * 1e3:.2f} ms | "
              f"{ours / theirs:.2f}x | {theirs / ours:.2f}x |")
    print(f"\nDDP TinyGPT step (2 processes, {params} parameters, {params * 4 / 1e6:.2f} MB of "
          f"gradients): {ddp * 1e3:.1f} ms with DDP, {plain * 1e3:.1f} ms without; "
          f"communication overhead {(ddp - plain) * 1e3:.1f} ms")


if __name__ == "__main__":
    main()
