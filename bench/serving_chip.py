"""vLLM-TorchTPU serving on a real TPU chip, beside a plain JAX decode loop of the same model.

Run on the lent v5e after ``bench/tpu_vllm.sh unpack`` (torch, vLLM and their dependencies in
/tmp/site; see that script). Parts, each in a process of its own (one process at a time holds
the chip), results as JSON under ``--out`` (default ``$OUT``):

- ``make``: model directories from configs (``serving_jax.CONFIGS``: Qwen2.5-0.5B's and
  Llama-3.2-1B's shapes), random bfloat16 weights written with ``save_pretrained``, a word-level
  tokenizer covering the vocabulary; no hub, no weights carried. On the CPU.
- ``hf``: Hugging Face's greedy tokens for a short prompt set (float32 on the CPU).
- ``jax``: ``serving_jax.py``'s prefill + decode loop on the chip, same weights: decode tokens/s
  and each step beside the HBM roofline (needs neither torch nor vLLM: ``--jax-only``).
- ``vllm``: ``LLM(model=dir)`` as a user types it (engine in this process:
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``), its greedy tokens against ``hf``'s, then each load
  (``--shapes`` x ``--concurrency``: all requests submitted at once) driven through
  ``llm.llm_engine``: output tokens/s, TTFT, ITL, the decode steps' median time beside their
  roofline (weights + the KV the step's requests attend, / 819 GB/s), and the XLA compiles during
  each measured round (a warm-up round of the same load runs first). With ``--paged both`` the
  vLLM part runs twice, with the ragged paged-attention kernel and with the gathered context.

    python bench/serving_chip.py [--parts make hf jax vllm] [--models qwen2-0.5b]
        [--shapes 512x128 1800x128] [--concurrency 1 8 64 256] [--paged both|on|off] [--out DIR]
    python bench/serving_chip.py --jax-only [--models ...] [--concurrency ...]   # no torch

This module imports neither torch nor vLLM at its top: ``--jax-only`` runs where only JAX is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving_jax  # noqa: E402  (bench/ is no package)

PARTS = ("make", "hf", "jax", "vllm")
PROMPTS = [[11, 42, 7, 99, 3], [5] * 12, list(range(100, 124)), [256, 17, 323, 4, 88, 9, 61]]
HF_NEW_TOKENS = 16
# the output head's scale in the random models: near-uniform logits would make greedy picks
# hang on rounding, so token equality would test the rounding, not the serving
LOGIT_SCALE = 16.0
LAYER_SCALE = 8.0


def parse_shape(text: str) -> tuple[int, int]:
    prompt, output = text.lower().split("x")
    return int(prompt), int(output)


# ---- make: model directories (torch + transformers, on the CPU) ----

def _tokenizer(vocab_size: int):
    """A word-level tokenizer whose every id decodes ("t123"), so any generated id detokenizes."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {f"t{i}": i for i in range(vocab_size - 2)}
    vocab |= {"<unk>": vocab_size - 2, "</s>": vocab_size - 1}
    raw = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>", eos_token="</s>")


def make_model(name: str, path: Path, seed: int = 0) -> Path:
    """``serving_jax.CONFIGS[name]`` with random bfloat16 weights, saved with save_pretrained."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(serving_jax.CONFIGS[name])
    config = AutoConfig.for_model(spec.pop("model_type"), **spec, dtype="bfloat16",
                                  eos_token_id=spec["vocab_size"] - 1)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.bfloat16)
    with torch.no_grad():
        model.model.norm.weight.mul_(LOGIT_SCALE)
        # at HF's init (std 0.02) the layers' outputs are small beside the embedding, and a tied
        # head then echoes the last token: larger outputs make every layer count
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.mul_(LAYER_SCALE)
            layer.mlp.down_proj.weight.mul_(LAYER_SCALE)
    model.save_pretrained(path)
    _tokenizer(spec["vocab_size"]).save_pretrained(path)
    return path


def part_make(args) -> dict:
    out = {}
    for name in args.models:
        start = time.perf_counter()
        path = make_model(name, Path(args.models_dir) / name)
        out[name] = {"dir": str(path), "seconds": time.perf_counter() - start,
                     "weight_bytes": serving_jax.weight_bytes(serving_jax.CONFIGS[name])}
    return out


# ---- hf: the reference tokens ----

def hf_greedy(model_dir: str | Path, prompts=PROMPTS, new_tokens: int = HF_NEW_TOKENS
              ) -> list[list[int]]:
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # plain argmax to the end, as vLLM's ignore_eos (min_new_tokens would mask EOS instead)
    model.generation_config.eos_token_id = None
    outs = []
    with torch.no_grad():
        for p in prompts:
            ids = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0)
            outs.append(ids[0, len(p):].tolist())
    return outs


def part_hf(args) -> dict:
    return {name: hf_greedy(Path(args.models_dir) / name) for name in args.models}


# ---- jax: the anchor ----

def part_jax(args) -> dict:
    import jax

    out = {"device": jax.devices()[0].device_kind}
    for name in args.models:
        model_dir = Path(args.models_dir) / name
        if (model_dir / "config.json").exists():
            c, p = serving_jax.load(model_dir)
        else:  # --jax-only without a made model: random weights of the config
            c, p = serving_jax.CONFIGS[name], serving_jax.init(serving_jax.CONFIGS[name])
        runs = []
        for prompt, output in map(parse_shape, args.shapes):
            for batch in args.concurrency:
                need = serving_jax.weight_bytes(c) + batch * (prompt + output) \
                    * serving_jax.kv_bytes_per_token(c)
                if need > args.hbm_bytes:
                    runs.append({"batch": batch, "prompt": prompt, "output": output,
                                 "skipped": f"static cache + weights {need / 2**30:.1f} GiB > "
                                            f"{args.hbm_bytes / 2**30:.1f} GiB"})
                    continue
                try:
                    runs.append(serving_jax.bench(c, p, batch, prompt, output))
                except Exception as e:  # one failing size (memory) does not stop the rest
                    runs.append({"batch": batch, "prompt": prompt, "output": output,
                                 "error": f"{type(e).__name__}: {str(e)[:500]}"})
                print(json.dumps(runs[-1]), flush=True)
                out[name] = {"weight_bytes": serving_jax.weight_bytes(c), "runs": runs}
                _save(args, out)
        tokens = None
        if os.environ.get("SERVING_JAX_TOKENS", "1") == "1":
            tokens = [serving_jax.generate(c, p, _pad(prompt), HF_NEW_TOKENS)["tokens"][0]
                      .tolist() for prompt in PROMPTS]
        out[name] = {"weight_bytes": serving_jax.weight_bytes(c), "runs": runs,
                     "greedy": tokens}
        del p
    return out


def _pad(prompt: list[int]):
    import numpy as np

    return np.asarray([prompt], np.int32)


# ---- vllm ----

def drive(llm, prompts: list[list[int]], output: int) -> dict:
    """Submit every prompt at once and step the engine to the end; per-request token arrival
    times and per-step times."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    params = SamplingParams(max_tokens=output, min_tokens=output, temperature=0.0,
                            ignore_eos=True, detokenize=False)
    start = time.perf_counter()
    for i, p in enumerate(prompts):
        engine.add_request(f"r{i}", TokensPrompt(prompt_token_ids=p), params)
    counts = dict.fromkeys(range(len(prompts)), 0)
    arrivals: dict[int, list[float]] = {i: [] for i in counts}
    steps = []
    while engine.has_unfinished_requests():
        all_started = all(counts.values())
        context = sum(len(prompts[i]) + n for i, n in counts.items() if n < output)
        active = sum(1 for n in counts.values() if n < output)
        s0 = time.perf_counter()
        outs = engine.step()
        now = time.perf_counter()
        for o in outs:
            i = int(o.request_id.removeprefix("r").split("-")[0])
            n = len(o.outputs[0].token_ids)
            arrivals[i] += [now] * (n - counts[i])
            counts[i] = n
        steps.append({"s": now - s0, "decode": all_started, "active": active,
                      "context": context})
    end = time.perf_counter()
    tokens = sum(counts.values())
    ttft = [a[0] - start for a in arrivals.values() if a]
    itl = [(a[-1] - a[0]) / (len(a) - 1) for a in arrivals.values() if len(a) > 1]
    return {"wall_s": end - start, "output_tokens": tokens, "output_tok_s": tokens / (end - start),
            "ttft_mean_s": statistics.mean(ttft), "ttft_p50_s": statistics.median(ttft),
            "itl_mean_s": statistics.mean(itl), "steps": steps}


def _decode_figures(steps: list[dict], config: dict) -> dict:
    decode = [s for s in steps if s["decode"] and s["active"]]
    if not decode:
        return {}
    times = sorted(s["s"] for s in decode)
    roof = [(serving_jax.weight_bytes(config) + s["context"]
             * serving_jax.kv_bytes_per_token(config)) / serving_jax.V5E_HBM_BYTES_S
            for s in decode]
    active = statistics.median(s["active"] for s in decode)
    median = times[len(times) // 2]
    return {"decode_steps": len(decode), "decode_step_median_s": median,
            "decode_tok_s": active / median, "roofline_step_median_s": statistics.median(roof),
            "step_over_roofline": median / statistics.median(roof)}


class CompileCounter:
    """XLA compiles in this process, from JAX's monitoring events."""

    def __init__(self) -> None:
        import jax

        self.count = 0

        def listen(event: str, duration: float, **kwargs) -> None:
            if event == "/jax/core/compile/backend_compile_duration":
                self.count += 1

        jax.monitoring.register_event_duration_secs_listener(listen)


def _save(args, result: dict) -> None:
    """The part's results so far, so that a part stopped by its time limit leaves them."""
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def part_vllm(args) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import random

    from vllm import LLM, SamplingParams

    counter = CompileCounter()
    out = {"paged": os.environ.get("TORCHTPU_VLLM_PAGED", "auto"),
           "capture": os.environ.get("TORCHTPU_VLLM_CAPTURE", "startup")}
    shapes = [parse_shape(s) for s in args.shapes]
    for name in args.models:
        model_dir = Path(args.models_dir) / name
        config = serving_jax.CONFIGS[name]
        max_len = max([p + o for p, o in shapes] + [len(p) + HF_NEW_TOKENS for p in PROMPTS])
        start = time.perf_counter()
        before = counter.count
        kv = {} if args.kv_bytes is None else {"kv_cache_memory_bytes": int(args.kv_bytes)}
        llm = LLM(model=str(model_dir), max_model_len=max_len,
                  max_num_seqs=max(args.concurrency), seed=0, **kv)
        result = {"startup_s": time.perf_counter() - start,
                  "startup_compiles": counter.count - before}
        greedy = llm.generate([{"prompt_token_ids": p} for p in PROMPTS],
                              SamplingParams(max_tokens=HF_NEW_TOKENS, temperature=0.0,
                                             ignore_eos=True), use_tqdm=False)
        result["greedy"] = [list(g.outputs[0].token_ids) for g in greedy]
        loads = result["loads"] = []
        out[name] = result
        _save(args, out)
        rng = random.Random(0)
        for prompt, output in shapes:
            for c in args.concurrency:
                prompts = [[rng.randrange(config["vocab_size"] - 2) for _ in range(prompt)]
                           for _ in range(c)]
                try:
                    drive(llm, prompts, output)  # warm-up: compiles what this load meets
                    # new prompts: the prefix cache must not serve the timed round
                    prompts = [[rng.randrange(config["vocab_size"] - 2) for _ in range(prompt)]
                               for _ in range(c)]
                    before = counter.count
                    run = drive(llm, prompts, output)
                    run["compiles"] = counter.count - before
                    run |= _decode_figures(run.pop("steps"), config)
                except Exception as e:
                    run = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                run |= {"prompt": prompt, "output": output, "concurrency": c}
                print(json.dumps(run), flush=True)
                loads.append(run)
                _save(args, out)
        out[name] = result
        del llm
    return out


# ---- the driver ----

def _run_part(part: str, args, env: dict) -> dict:
    """One part in a process of its own; its JSON."""
    path = Path(args.out) / f"{part}{args.tag}.json"
    cmd = [sys.executable, os.path.abspath(__file__), "--part", part, "--json", str(path),
           "--models", *args.models, "--models-dir", args.models_dir,
           "--shapes", *args.shapes, "--concurrency", *map(str, args.concurrency),
           *(["--kv-bytes", str(args.kv_bytes)] if args.kv_bytes else [])]
    start = time.perf_counter()
    log = Path(args.out) / f"{part}{args.tag}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=args.part_timeout).returncode
        except subprocess.TimeoutExpired:  # its results so far are in its JSON
            rc = "timeout"
    seconds = time.perf_counter() - start
    result = json.loads(path.read_text()) if path.exists() else {}
    print(f"{part}{args.tag}: rc {rc}, {seconds:.0f} s", flush=True)
    return {"rc": rc, "seconds": seconds, "result": result}


def compare(hf: dict, other: dict, key: str = "greedy") -> dict:
    """Per model: how many prompts' greedy tokens equal Hugging Face's, first differences."""
    out = {}
    for name, want in hf.items():
        got = (other.get(name) or {}).get(key)
        if got is None:
            continue
        equal = [g == w for g, w in zip(got, want)]
        out[name] = {"equal": sum(equal), "of": len(want),
                     "first_mismatch": next(({"prompt": i, "got": g, "want": w}
                                             for i, (g, w) in enumerate(zip(got, want))
                                             if g != w), None)}
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--jax-only", action="store_true", help="the JAX anchor alone (no torch)")
    ap.add_argument("--models", nargs="+", default=["qwen2-0.5b"],
                    choices=sorted(serving_jax.CONFIGS))
    ap.add_argument("--shapes", nargs="+", default=["512x128"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--paged", choices=("both", "on", "off", "auto"), default="auto")
    ap.add_argument("--capture", choices=("lazy", "startup"), default="lazy",
                    help="TORCHTPU_VLLM_CAPTURE: lazy compiles only the step shapes the loads "
                         "meet (in their warm-up rounds); startup compiles every bucket first")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/serving_out"))
    ap.add_argument("--models-dir", default="/tmp/serving_models")
    ap.add_argument("--hbm-bytes", type=float, default=15.7 * 2**30)
    ap.add_argument("--kv-bytes", type=float, help="vLLM's kv_cache_memory_bytes (default: "
                    "its gpu_memory_utilization share; CPU smoke runs: a few MiB)")
    ap.add_argument("--part-timeout", type=float, default=540)
    ap.add_argument("--json", help=argparse.SUPPRESS)
    ap.add_argument("--tag", default="", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part:  # inside a part's own process
        try:
            result = globals()[f"part_{args.part}"](args)
        except Exception:  # what it saved before, and why it stopped
            saved = Path(args.json)
            result = json.loads(saved.read_text()) if saved.exists() else {}
            result["error"] = traceback.format_exc()[-3000:]
        Path(args.json).write_text(json.dumps(result, indent=1))
        print(json.dumps(result)[:3000])
        return result
    Path(args.out).mkdir(parents=True, exist_ok=True)
    parts = ["jax"] if args.jax_only else args.parts
    env = {**os.environ, "TORCHTPU_VLLM_CAPTURE": args.capture}
    summary = {"argv": sys.argv[1:], "parts": {}}
    for part in parts:
        if part in ("make", "hf"):  # on the CPU: keep off the chip
            run = _run_part(part, args, {**env, "JAX_PLATFORMS": "cpu",
                                         "TORCHTPU_PLATFORM": "cpu"})
            summary["parts"][part] = run
        elif part == "vllm" and args.paged in ("both", "on", "off"):
            modes = ("on", "off") if args.paged == "both" else (args.paged,)
            for mode in modes:
                args.tag = f"-paged-{mode}"
                summary["parts"][f"vllm-paged-{mode}"] = _run_part(
                    part, args, {**env, "TORCHTPU_VLLM_PAGED": mode})
            args.tag = ""
        else:
            summary["parts"][part] = _run_part(part, args, env)
    hf = summary["parts"].get("hf", {}).get("result")
    if hf is None and Path(args.out, "hf.json").exists():  # from an earlier call
        hf = json.loads(Path(args.out, "hf.json").read_text())
    summary["tokens_equal_hf"] = {name: compare(hf or {}, run.get("result", {}))
                                  for name, run in summary["parts"].items()
                                  if name.startswith(("jax", "vllm"))}
    Path(args.out, "serving_chip.json").write_text(json.dumps(summary, indent=1))
    print(json.dumps(summary["tokens_equal_hf"], indent=1))
    return summary


if __name__ == "__main__":
    main()
