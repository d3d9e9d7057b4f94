"""vLLM serving on torchtpu's platform against vLLM's own CPU platform, interleaved in one driver.

A tiny Llama (``torchtpu.integrations.vllm.tiny``: 2 layers, width 128, head size 64, which
vLLM's CPU attention takes) is served by three ``vllm serve`` processes at once: vLLM's CPU
platform in its default mode (``cpu``: Inductor-compiled model, vLLM's default compilation
config), the CPU platform with ``--enforce-eager`` (``cpu-eager``: its C++ kernels op by op) and
torchtpu's platform (``tpu``: captured decode steps, ``torchtpu/integrations/vllm/graphs.py``);
``--tpu-eager`` adds torchtpu with ``--enforce-eager``. All servers are up for the whole run and
idle while another is measured, so a round of one platform and the next platform's round meet
the same machine: at each concurrency (1, 8, 32 streaming requests over plain HTTP) the driver
runs one warm-up round per server, then ``--rounds`` rounds of A, B, C, A, B, C, ... and reports
the mean per platform and the median over rounds of each round's torchtpu / CPU ratio. On a
shared machine only the ratios count (the absolute figures move with the load).

Each request is a prompt of ``--prompt`` random tokens (new every round, so the prefix cache
never hits) and ``--output`` greedy tokens (``ignore_eos``). Per round: output tokens/s over the
round's wall time, time to first token (TTFT) and inter-token latency (ITL, the mean gap between
a request's streamed tokens). Needs the vLLM venv
(``python -m torchtpu.integrations.vllm.install``).

    python bench/serving.py [--rounds 3] [--prompt 128] [--output 64] [--concurrency 1 8 32]
                            [--platforms cpu cpu-eager tpu] [--tpu-eager]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

from torchtpu.integrations.vllm import server
from torchtpu.integrations.vllm.tiny import save_tiny_model

CONCURRENCY = (1, 8, 32)
# name -> (vLLM platform, extra serve flags); the first CPU ones are the baselines
PLATFORMS = {
    "cpu": ("cpu", ()),
    "cpu-eager": ("cpu", ("--enforce-eager",)),
    "tpu": ("tpu", ()),
    "tpu-eager": ("tpu", ("--enforce-eager",)),
}
BASELINES = ("cpu", "cpu-eager")
METRICS = ("tok_s", "ttft", "itl")
# room for 32 requests of 128 + 64 tokens (1 KiB a token for this model) and more
KV_BYTES = 16 << 20


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


def run_round(url: str, model: str, concurrency: int, prompt: int, output: int,
              rng: random.Random) -> dict:
    """One round: ``concurrency`` requests sent at once; tokens/s, mean TTFT and ITL (s)."""
    prompts = [[rng.randrange(256) for _ in range(prompt)] for _ in range(concurrency)]
    start = time.perf_counter()
    with ThreadPoolExecutor(concurrency) as pool:
        done = list(pool.map(lambda p: _request(url, model, p, output), prompts))
    wall = time.perf_counter() - start
    return {"tok_s": sum(r["tokens"] for r in done) / wall,
            "ttft": statistics.mean(r["ttft"] for r in done),
            "itl": statistics.mean(r["itl"] for r in done)}


def interleave(urls: dict[str, str], model: str, concurrency: int, rounds: int, prompt: int,
               output: int, seed: int = 0) -> dict[str, list[dict]]:
    """Per platform, its measured rounds at this concurrency, run A, B, C, A, B, C, ...

    Every platform gets the same prompts in the same round (one generator per platform, same
    seed); a warm-up round each comes first (torchtpu compiles a new batch shape on first use).
    """
    rngs = {name: random.Random(seed) for name in urls}
    for name, url in urls.items():
        run_round(url, model, concurrency, prompt, output, rngs[name])
    results: dict[str, list[dict]] = {name: [] for name in urls}
    for _ in range(rounds):
        for name, url in urls.items():
            results[name].append(run_round(url, model, concurrency, prompt, output, rngs[name]))
    return results


def ratios(a: list[dict], b: list[dict]) -> dict[str, float]:
    """The median over rounds of each round's a / b, per metric."""
    return {k: statistics.median(x[k] / y[k] for x, y in zip(a, b)) for k in METRICS}


def _row(c: int, name: str, r: dict) -> str:
    return f"| {c} | {name} | {r['tok_s']:.1f} | {r['ttft'] * 1e3:.0f} | {r['itl'] * 1e3:.2f} |"


def _ratio_row(c: int, name: str, r: dict) -> str:
    return f"| {c} | {name} | {r['tok_s']:.2f}x | {r['ttft']:.2f}x | {r['itl']:.2f}x |"


def table(results: dict[int, dict[str, list[dict]]]) -> str:
    lines = ["| concurrency | platform | tokens/s | TTFT ms | ITL ms |", "|---|---|---|---|---|"]
    for c, per in results.items():
        for name, rounds in per.items():
            lines.append(_row(c, name, {k: statistics.mean(r[k] for r in rounds)
                                        for k in METRICS}))
        for tpu in (n for n in per if n.startswith("tpu")):
            for base in (n for n in BASELINES if n in per):
                lines.append(_ratio_row(c, f"{tpu} / {base}", ratios(per[tpu], per[base])))
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--output", type=int, default=64)
    parser.add_argument("--concurrency", type=int, nargs="+", default=list(CONCURRENCY))
    parser.add_argument("--platforms", nargs="+", default=["cpu", "cpu-eager", "tpu"],
                        choices=list(PLATFORMS))
    parser.add_argument("--tpu-eager", action="store_true",
                        help="also measure torchtpu with --enforce-eager")
    args = parser.parse_args()
    names = [*args.platforms, *(["tpu-eager"] if args.tpu_eager else [])]
    model = str(save_tiny_model(tempfile.mkdtemp(), "llama"))
    flags = (*server.SERVE_ARGS[:-1], str(KV_BYTES), "--max-num-seqs", str(max(args.concurrency)))
    print(f"/proc/loadavg {open('/proc/loadavg').read().strip()}; prompt {args.prompt}, "
          f"output {args.output}, {args.rounds} interleaved rounds after a warm-up", flush=True)
    start = time.perf_counter()
    with contextlib.ExitStack() as stack:
        urls = {}
        for name in names:  # one after the other: start-ups compete for the cores otherwise
            platform, extra = PLATFORMS[name]
            urls[name] = stack.enter_context(server.serve(model, platform,
                                                          args=(*flags, *extra)))
            print(f"{name} up after {time.perf_counter() - start:.0f} s", flush=True)
        results = {}
        for c in args.concurrency:
            results[c] = interleave(urls, model, c, args.rounds, args.prompt, args.output)
            print(table({c: results[c]}), flush=True)
    print("\n" + table(results))
    print(f"/proc/loadavg at the end {open('/proc/loadavg').read().strip()}; "
          f"{os.cpu_count()} cores")


if __name__ == "__main__":
    main()
