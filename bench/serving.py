"""vLLM serving on torchtpu's platform against vLLM's own CPU platform, same model, same run.

A tiny Llama (``torchtpu.integrations.vllm.tiny``: 2 layers, width 128, head size 64, which
vLLM's CPU attention takes) is served by ``vllm serve`` twice, one platform after the other, and
each gets the same request mix: prompts of 128 random tokens, 64 greedy output tokens
(``ignore_eos``), 1 and 8 concurrent streaming requests over plain HTTP. Every prompt is new, so
the prefix cache never hits. A warm-up round per concurrency comes first (torchtpu compiles each
new batch shape on first use; vLLM's CPU kernels need none), then ``--rounds`` measured rounds.

torchtpu serves with its captured steps (each padded step shape's forward one program,
``torchtpu/integrations/vllm/graphs.py``); vLLM's CPU platform runs ``--enforce-eager`` (its C++
kernels op by op, no Inductor compile) unless ``--cpu-compiled``. ``--tpu-eager`` adds a third
server, torchtpu with ``--enforce-eager``, for the account of where the time goes.

Reported per platform and concurrency: output tokens/s over the round's wall time, time to first
token (TTFT) and inter-token latency (ITL, the mean gap between a request's streamed tokens),
then torchtpu / CPU ratios. Needs the vLLM venv (``python -m torchtpu.integrations.vllm.install``).

    python bench/serving.py [--rounds 2] [--prompt 128] [--output 64] [--cpu-compiled]
                            [--tpu-eager]
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from torchtpu.integrations.vllm import server
from torchtpu.integrations.vllm.tiny import save_tiny_model

CONCURRENCY = (1, 8)


def _request(url: str, model: str, prompt: list[int], output: int) -> dict:
    body = {"model": model, "prompt": prompt, "max_tokens": output, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    start = time.perf_counter()
    arrivals = []
    for at, event in server.stream(url + "/v1/completions", body):
        arrivals += [at] * len(event["choices"][0].get("token_ids") or [])
    if len(arrivals) != output:
        raise RuntimeError(f"torchtpu.tool: asked for {output} tokens, got {len(arrivals)}")
    gaps = [b - a for a, b in zip(arrivals, arrivals[1:])]
    return {"ttft": arrivals[0] - start, "itl": statistics.mean(gaps) if gaps else 0.0,
            "tokens": len(arrivals)}


def _round(url: str, model: str, concurrency: int, args, rng: random.Random) -> dict:
    prompts = [[rng.randrange(256) for _ in range(args.prompt)] for _ in range(concurrency)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda p: _request(url, model, p, args.output), prompts))
    wall = time.perf_counter() - start
    return {"tok_s": sum(r["tokens"] for r in done) / wall,
            "ttft": statistics.mean(r["ttft"] for r in done),
            "itl": statistics.mean(r["itl"] for r in done)}


def measure(platform: str, model: str, args, eager: bool = False) -> dict[int, dict]:
    rng = random.Random(0)
    results = {}
    serve_args = (*server.SERVE_ARGS, "--enforce-eager") if eager else server.SERVE_ARGS
    with server.serve(model, platform, args=serve_args) as url:
        for concurrency in CONCURRENCY:
            _round(url, model, concurrency, args, rng)  # warm-up: compiles on tpu
            rounds = [_round(url, model, concurrency, args, rng) for _ in range(args.rounds)]
            results[concurrency] = {k: statistics.mean(r[k] for r in rounds) for k in rounds[0]}
            print(f"{platform}{' eager' if eager else ''} c={concurrency}: "
                  f"{results[concurrency]}", flush=True)
    return results


def _rows(name: str, r: dict, c: int) -> str:
    return (f"| {c} | {name} | {r['tok_s']:.1f} | {r['ttft'] * 1e3:.0f} | "
            f"{r['itl'] * 1e3:.1f} |")


def _ratio(name: str, a: dict, b: dict, c: int) -> str:
    return (f"| {c} | {name} | {a['tok_s'] / b['tok_s']:.2f}x | {a['ttft'] / b['ttft']:.2f}x | "
            f"{a['itl'] / b['itl']:.2f}x |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--cpu-compiled", action="store_true",
                        help="vLLM's CPU platform in its default compiled mode, not eager")
    parser.add_argument("--tpu-eager", action="store_true",
                        help="also measure torchtpu with --enforce-eager")
    args = parser.parse_args()
    model = str(save_tiny_model(tempfile.mkdtemp(), "llama"))
    print(f"load average {os.getloadavg()[0]:.1f}; prompt {args.prompt}, output {args.output}, "
          f"{args.rounds} rounds after a warm-up", flush=True)
    cpu = measure("cpu", model, args, eager=not args.cpu_compiled)
    tpu = measure("tpu", model, args)
    tpu_eager = measure("tpu", model, args, eager=True) if args.tpu_eager else None
    cpu_name = "vLLM CPU" + ("" if args.cpu_compiled else " (eager)")
    print("\n| concurrency | platform | tokens/s | TTFT ms | ITL ms |\n|---|---|---|---|---|")
    for c in CONCURRENCY:
        print(_rows(cpu_name, cpu[c], c))
        print(_rows("torchtpu (captured steps)", tpu[c], c))
        if tpu_eager:
            print(_rows("torchtpu (--enforce-eager)", tpu_eager[c], c))
        print(_ratio("torchtpu / CPU", tpu[c], cpu[c], c))
    print(f"load average at the end {os.getloadavg()[0]:.1f}")


if __name__ == "__main__":
    main()
