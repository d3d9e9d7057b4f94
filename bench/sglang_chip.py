"""SGLang-TorchTPU's offline engine on device "tpu": greedy tokens against Hugging Face's and
output tokens/s at a few concurrencies. Written for the lent v5e (after ``bench/tpu_machine.sh
unpack`` and ``bench/tpu_sglang.sh unpack``), and run the same way on XLA:CPU.

Steps, the first two each in a process of their own on the CPU (the engine's scheduler process
must be the only one holding the chip):

- ``make``: the model directory from ``serving_jax.CONFIGS[--model]`` with random bfloat16
  weights and a word-level tokenizer (``serving_chip.make_model``; no hub), unless it exists.
- ``hf``: Hugging Face's greedy tokens for ``serving_chip.PROMPTS`` (float32, CPU) and their
  top-1 over top-2 logit margins.
- the engine: ``sglang.Engine(model_path=dir, device="tpu")`` as a user types it, its greedy
  tokens for the same prompts (compared exactly and up to HF's first near-tie, as
  ``serving_chip.compare``), then per ``--concurrency`` C a warm-up round and a timed round of
  C requests of ``--prompt`` random tokens each, ``--output`` tokens out (ignore_eos): output
  tokens/s = C x output / the round's wall seconds.

    python bench/sglang_chip.py [--model tiny|qwen2-0.5b] [--dtype bfloat16] [--prompt 128]
        [--output 64] [--concurrency 1 8] [--max-total-tokens 8192] [--out DIR]

Prints one ``SGLANG_CHIP {json}`` line and writes ``sglang_chip.json`` to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving_chip  # noqa: E402  (bench/ is no package)


def _cpu_step(step: str, args) -> dict:
    """``make`` or ``hf`` in a child process on the CPU: nothing of it may take the chip."""
    path = Path(args.out) / f"{step}.json"
    env = dict(os.environ, TORCHTPU_PLATFORM="cpu", JAX_PLATFORMS="cpu")
    subprocess.run([sys.executable, os.path.abspath(__file__), "--step", step, "--json",
                    str(path), *_flags(args)], env=env, check=True, timeout=args.timeout)
    return json.loads(path.read_text())


def _flags(args) -> list[str]:
    return ["--model", args.model, "--models-dir", args.models_dir, "--out", args.out]


def _step(args) -> None:
    model_dir = Path(args.models_dir) / args.model
    if args.step == "make":
        start = time.perf_counter()
        if not (model_dir / "config.json").exists():
            serving_chip.make_model(args.model, model_dir)
        out = {"dir": str(model_dir), "seconds": round(time.perf_counter() - start, 2)}
    else:
        greedy, margins = serving_chip.hf_greedy(model_dir)
        out = {args.model: greedy, serving_chip.MARGINS: {args.model: margins}}
    Path(args.json).write_text(json.dumps(out))


def _round(engine, prompts: list[list[int]], output: int) -> tuple[float, list[list[int]]]:
    params = {"temperature": 0, "max_new_tokens": output, "ignore_eos": True}
    start = time.perf_counter()
    outs = engine.generate(input_ids=prompts, sampling_params=params)
    return time.perf_counter() - start, [o["output_ids"] for o in outs]


def run_engine(args, model_dir: str) -> dict:
    import sglang

    start = time.perf_counter()
    # nccl_port given: SGLang would bind a TCP socket to pick one, which the chip's host refuses;
    # on tpu the scheduler's rendezvous is a file and binds none (platform.solo_groups)
    engine = sglang.Engine(model_path=model_dir, device="tpu", dtype=args.dtype, random_seed=0,
                           max_total_tokens=args.max_total_tokens, nccl_port=29999,
                           log_level="warning")
    out: dict = {"startup_s": round(time.perf_counter() - start, 2), "loads": {}}
    try:
        seconds, greedy = _round(engine, serving_chip.PROMPTS, serving_chip.HF_NEW_TOKENS)
        out |= {"greedy": greedy, "greedy_s": round(seconds, 2)}
        vocab = json.loads((Path(model_dir) / "config.json").read_text())["vocab_size"]
        rng = random.Random(0)
        batch = lambda c: [[rng.randrange(vocab - 2) for _ in range(args.prompt)]  # noqa: E731
                           for _ in range(c)]
        for c in args.concurrency:
            warm_s, _ = _round(engine, batch(c), args.output)  # compiles this load's shapes
            seconds, outs = _round(engine, batch(c), args.output)
            tokens = sum(map(len, outs))
            out["loads"][str(c)] = {"output_tokens": tokens, "seconds": round(seconds, 3),
                                    "warmup_s": round(warm_s, 2),
                                    "output_tokens_per_s": round(tokens / seconds, 2)}
            print(f"sglang_chip: {c} requests: {tokens / seconds:.2f} output tokens/s",
                  flush=True)
    finally:
        engine.shutdown()
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="tiny", choices=sorted(serving_chip.serving_jax.CONFIGS))
    ap.add_argument("--models-dir", default="/tmp/serving_models")
    ap.add_argument("--dtype", default="bfloat16")
    ap.add_argument("--prompt", type=int, default=128, help="tokens per timed request")
    ap.add_argument("--output", type=int, default=64, help="tokens out per timed request")
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--max-total-tokens", type=int, default=8192, help="the KV pool's tokens")
    ap.add_argument("--timeout", type=float, default=1200, help="seconds per CPU step")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/sglang_chip"))
    ap.add_argument("--step", choices=("make", "hf"), help=argparse.SUPPRESS)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.step:
        _step(args)
        return {}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    result: dict = {"model": args.model, "dtype": args.dtype, "prompt": args.prompt,
                    "output": args.output}
    result["make"] = _cpu_step("make", args)
    hf = _cpu_step("hf", args)
    result["sglang"] = run_engine(args, result["make"]["dir"])
    result["tokens"] = serving_chip.compare(hf, {args.model: result["sglang"]})[args.model]
    Path(args.out, "sglang_chip.json").write_text(json.dumps(result, indent=1))
    print("SGLANG_CHIP " + json.dumps({k: v for k, v in result.items() if k != "make"}),
          flush=True)
    return result


if __name__ == "__main__":
    main()
