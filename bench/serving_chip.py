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
  ``VLLM_ENABLE_V1_MULTIPROCESSING=0``, unless set to 1: then in its own process as ``vllm
  serve`` runs it, its output processing beside the steps, and no phases, diagnoses or compile
  counts), its greedy tokens against ``hf``'s, then each load
  (``--shapes`` x ``--concurrency``: all requests submitted at once) driven through
  ``llm.llm_engine``: output tokens/s, TTFT, ITL, the decode steps' median time beside their
  roofline (weights + the KV the step's requests attend, / 819 GB/s), each decode step's
  split into the model runner's phases (``serving_diag.Phases``), and the XLA compiles during
  each measured round (a warm-up round of the same lengths runs first and compiles the step
  shapes the round meets: ``timed_load``). With ``--paged both`` the vLLM part
  runs twice, with the ragged paged-attention kernel and with the gathered context;
  ``--diagnose [C ...]`` adds, after the load of each concurrency C (none given: the first
  load), where a decode step of its requests goes (``serving_diag.py``: phases, host profile,
  device trace, the step program replayed alone): ``diagnoses[C]``.

What comes back (``--out``): ``serving_chip.json`` (every part's results, rewritten after each
part) and ``serving_chip_logs.tar.gz`` (each part's own JSON and log, written to ``--work``).
``--jax-seconds`` of the budget are kept for the jax part while it is still to run.

Token checks (``serving_chip.json``): each part's greedy tokens against HF's (float32, CPU),
exactly and up to HF's first near-tie (top-1 over top-2 logit margin below ``MARGIN_TOL``),
which a bf16 chip may resolve the other way. ``hf`` runs on the CPU beside the chip parts;
``--budget`` caps the whole call (a part gets at most what is left of it).

    python bench/serving_chip.py [--parts make hf jax vllm] [--models qwen2-0.5b]
        [--shapes 512x128 1800x128] [--concurrency 1 8 64 256] [--jax-concurrency 64]
        [--paged both|on|off] [--diagnose [C ...]] [--budget S] [--out DIR]
    python bench/serving_chip.py --jax-only [--models ...] [--concurrency ...]   # no torch

This module imports neither torch nor vLLM at its top: ``--jax-only`` runs where only JAX is.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving_diag  # noqa: E402  (bench/ is no package)
import serving_jax  # noqa: E402
from chip_parts import publish, run_part  # noqa: E402

PARTS = ("make", "hf", "jax", "vllm")
PROMPTS = [[11, 42, 7, 99, 3], [5] * 12, list(range(100, 124)), [256, 17, 323, 4, 88, 9, 61]]
HF_NEW_TOKENS = 16
# the output head's scale in the random models: near-uniform logits would make greedy picks
# hang on rounding, so token equality would test the rounding, not the serving
LOGIT_SCALE = 16.0
LAYER_SCALE = 8.0
# hf.json's key for HF's top-1/top-2 logit margins, by model
MARGINS = "margins"
# Below this margin (logits) HF's pick is a near-tie that bf16 on a chip may resolve the other
# way; a prompt's tokens are compared up to its first near-tie (after it both continuations are
# right, and every later token follows from the one picked)
MARGIN_TOL = 1.0


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


def make_model(name: str, path: Path, seed: int = 0, layers: int | None = None) -> Path:
    """``serving_jax.CONFIGS[name]`` (with ``layers`` decoder layers where given) with random
    bfloat16 weights, saved with save_pretrained."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM

    spec = dict(serving_jax.CONFIGS[name]) | ({"num_hidden_layers": layers} if layers else {})
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
              ) -> tuple[list[list[int]], list[list[float]]]:
    """Hugging Face's greedy tokens per prompt, and at each the logit margin of the top token
    over the second (float32, CPU)."""
    import torch
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    # plain argmax to the end, as vLLM's ignore_eos (min_new_tokens would mask EOS instead)
    model.generation_config.eos_token_id = None
    outs, margins = [], []
    with torch.no_grad():
        for p in prompts:
            gen = model.generate(torch.tensor([p]), max_new_tokens=new_tokens, do_sample=False,
                                 pad_token_id=0, output_logits=True,
                                 return_dict_in_generate=True)
            outs.append(gen.sequences[0, len(p):].tolist())
            top2 = [step[0].float().topk(2).values for step in gen.logits]
            margins.append([round(float(t[0] - t[1]), 4) for t in top2])
    return outs, margins


def part_hf(args) -> dict:
    out: dict = {MARGINS: {}}
    for name in args.models:
        out[name], out[MARGINS][name] = hf_greedy(Path(args.models_dir) / name)
    return out


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

def _submit(llm, prompts: list[list[int]], output: int, prefix: str = "r",
            min_tokens: bool = False) -> list[str]:
    """Greedy requests of ``output`` tokens each (``ignore_eos``, as vLLM's own benchmarks:
    no logits processor runs); ``min_tokens`` adds vLLM's min-tokens processor, which masks EOS
    in the step's logits (eager ops after the step's program, as the first chip run had)."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    params = SamplingParams(max_tokens=output, min_tokens=output if min_tokens else 0,
                            temperature=0.0, ignore_eos=True, detokenize=False)
    ids = [f"{prefix}{i}" for i in range(len(prompts))]
    for rid, p in zip(ids, prompts):
        llm.llm_engine.add_request(rid, TokensPrompt(prompt_token_ids=p), params)
    return ids


def drive(llm, prompts: list[list[int]], output: int,
          phases: serving_diag.Phases | None = None) -> dict:
    """Submit every prompt at once and step the engine to the end; per-request token arrival
    times and per-step times (with ``phases``, each step's split into the runner's phases)."""
    engine = llm.llm_engine
    start = time.perf_counter()
    _submit(llm, prompts, output)
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
                      "context": context, "phases": phases and phases.take(now - s0)})
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
            "step_over_roofline": median / statistics.median(roof),
            "decode_phases_median_s": serving_diag.phase_medians(decode)}


def diagnose(llm, phases: serving_diag.Phases | None, prompts: list[list[int]],
             min_tokens: bool = False) -> dict:
    """Where a decode step's time goes (``serving_diag``): requests of ``prompts`` with the
    loads' sampling (``min_tokens``: with vLLM's min-tokens processor, the first chip run's
    eager ops after the step's program) past their prefills, then the phases of 8 decode steps,
    a host profile of 3, a device trace of 3 (the device's time a step at this many requests:
    against the load's step, whether the step is host- or device-bound), the captured step
    replayed alone and the floors; the requests are dropped after."""
    engine = llm.llm_engine
    ids = _submit(llm, prompts, 64, prefix="diag", min_tokens=min_tokens)
    runner = serving_diag.runner_of(llm)
    tokens = sum(map(len, prompts))
    for _ in range(-(-tokens // runner.max_num_tokens) + 2):  # the prefills, and a decode
        engine.step()
    out = {"requests": len(prompts)}
    if phases is not None:
        phases.take(0.0)
        rows = []
        for _ in range(8):
            s0 = time.perf_counter()
            engine.step()
            rows.append({"phases": phases.take(time.perf_counter() - s0),
                         "s": time.perf_counter() - s0})
        out["step_median_s"] = statistics.median(r["s"] for r in rows)
        out["phases_median_s"] = serving_diag.phase_medians(rows)
    out["host_profile"] = serving_diag.host_profile(engine.step)
    out["device_programs"] = serving_diag.device_programs(engine.step)
    out["replay_alone"] = serving_diag.replay_time(runner)
    out["floors"] = serving_diag.floors()
    engine.abort_request(ids)
    while engine.has_unfinished_requests():
        engine.step()
    return out


def _save(args, result: dict) -> None:
    """The part's results so far, so that a part stopped by its time limit leaves them."""
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def timed_load(llm, config: dict, warm: list[list[int]], timed: list[list[int]], output: int,
               counter: serving_diag.CompileCounter,
               phases: serving_diag.Phases | None = None) -> dict:
    """One load: the ``warm`` prompts (``output`` tokens each, all submitted at once) as a
    warm-up round, then the ``timed`` ones (new prompts of the same lengths: the prefix cache
    must not serve them), the timed round's figures and the XLA compiles inside it.

    The warm-up runs the round's whole length: its schedule (chunked prefills mixed with the
    decodes of the requests already running, then every request's decodes, then the tail as
    they finish) is the round's, so it meets every step shape the round meets. A 4-token
    warm-up (until session 24) ended each request after 3 decodes, so its steps held the
    requests of a few prefill chunks at most: at 256 requests the round met the step shapes of
    128 and 256 requests first and compiled 6 programs inside it (TTFT 6.1 s, 78 s of wall)."""
    drive(llm, warm, output)
    before = counter.count
    run = drive(llm, timed, output, phases)
    run["compiles"] = counter.count - before
    return run | _decode_figures(run.pop("steps"), config)


def part_vllm(args) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    import random

    from vllm import LLM, SamplingParams

    counter = serving_diag.CompileCounter()
    out = {"paged": os.environ.get("TORCHTPU_VLLM_PAGED", "auto"),
           "capture": os.environ.get("TORCHTPU_VLLM_CAPTURE", "startup"),
           # "own process" (VLLM_ENABLE_V1_MULTIPROCESSING=1, as `vllm serve` runs it): the
           # output processing runs beside the engine's steps, not between them; the phases,
           # the diagnoses and the compile counts (this process's) are then not measured
           "engine": ("in this process" if os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
                      else "own process")}
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
                  "startup_compiles": counter.count - before,
                  # the KV page size (the paged kernel's: vllm/paged.page_size)
                  "block_size": llm.llm_engine.vllm_config.cache_config.block_size}
        try:
            phases = serving_diag.Phases(serving_diag.runner_of(llm))
        except Exception as e:  # an engine in another process: no phases
            phases, result["phases"] = None, f"unavailable: {type(e).__name__}: {e}"
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
                warm, timed = ([[rng.randrange(config["vocab_size"] - 2) for _ in range(prompt)]
                                for _ in range(c)] for _ in range(2))
                try:
                    run = timed_load(llm, config, warm, timed, output, counter, phases)
                except Exception as e:
                    run = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
                run |= {"prompt": prompt, "output": output, "concurrency": c}
                print(json.dumps(run), flush=True)
                loads.append(run)
                _save(args, out)
                if phases is not None and _diagnosed_after(args, c, result):
                    done = result.setdefault("diagnoses", {})
                    done[str(c)] = diagnose(llm, phases, timed)
                    print(json.dumps(done[str(c)])[:4000], flush=True)
                    _save(args, out)
        out[name] = result
        del llm
    return out


def _diagnosed_after(args, concurrency: int, result: dict) -> bool:
    """Whether ``--diagnose`` asks for a diagnosis after this load: the concurrencies it names,
    else the first load only."""
    if args.diagnose is None:
        return False
    if args.diagnose:
        return concurrency in args.diagnose and str(concurrency) not in result.get(
            "diagnoses", {})
    return "diagnoses" not in result


# ---- the driver ----

def compare(hf: dict, other: dict, key: str = "greedy", tol: float = MARGIN_TOL) -> dict:
    """Per model: how many prompts' greedy tokens equal Hugging Face's, the first differences,
    and (where HF's margins are known) how many equal it up to HF's first near-tie (top-1 over
    top-2 logit margin below ``tol``): the check a bf16 chip can be held to."""
    out = {}
    margins = hf.get(MARGINS, {})
    for name, want in hf.items():
        got = (other.get(name) or {}).get(key)
        if name == MARGINS or got is None:
            continue
        equal = [g == w for g, w in zip(got, want)]
        out[name] = {"equal": sum(equal), "of": len(want),
                     "first_mismatch": next(({"prompt": i, "got": g, "want": w}
                                             for i, (g, w) in enumerate(zip(got, want))
                                             if g != w), None)}
        if name in margins:
            clear = [next((j for j, m in enumerate(ms) if m < tol), len(ms))
                     for ms in margins[name]]
            out[name] |= {"margin_tol": tol, "clear_tokens": clear,
                          "equal_until_near_tie": sum(g[:n] == w[:n] for g, w, n
                                                      in zip(got, want, clear))}
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
    ap.add_argument("--jax-concurrency", type=int, nargs="+",
                    help="the JAX anchor's batches (default: --concurrency)")
    ap.add_argument("--diagnose", type=int, nargs="*", metavar="C",
                    help="after the vLLM load of each concurrency C (none: the first load): "
                         "where a decode step's time goes (phases, host profile, device trace, "
                         "the step program alone)")
    ap.add_argument("--paged", choices=("both", "on", "off", "auto"), default="auto")
    ap.add_argument("--capture", choices=("lazy", "startup"), default="lazy",
                    help="TORCHTPU_VLLM_CAPTURE: lazy compiles only the step shapes the loads "
                         "meet (in their warm-up rounds); startup compiles every bucket first")
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/serving_out"),
                    help="two files: serving_chip.json and serving_chip_logs.tar.gz")
    ap.add_argument("--work", default="/tmp/serving_parts",
                    help="each part's JSON and log (hf.json kept for later calls)")
    ap.add_argument("--jax-seconds", type=float, default=120,
                    help="seconds of --budget kept for the jax part while it is still to run")
    ap.add_argument("--models-dir", default="/tmp/serving_models")
    ap.add_argument("--hbm-bytes", type=float, default=15.7 * 2**30)
    ap.add_argument("--kv-bytes", type=float, help="vLLM's kv_cache_memory_bytes (default: "
                    "its gpu_memory_utilization share; CPU smoke runs: a few MiB)")
    ap.add_argument("--part-timeout", type=float, default=540)
    ap.add_argument("--budget", type=float, default=float("inf"),
                    help="seconds for the whole call: a part gets at most what is left")
    ap.add_argument("--json", help=argparse.SUPPRESS)
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
    Path(args.work).mkdir(parents=True, exist_ok=True)
    parts = ["jax"] if args.jax_only else args.parts
    args.deadline = time.perf_counter() + args.budget
    env = {**os.environ, "TORCHTPU_VLLM_CAPTURE": args.capture}
    cpu = {**env, "JAX_PLATFORMS": "cpu", "TORCHTPU_PLATFORM": "cpu"}  # keep off the chip
    summary = {"argv": sys.argv[1:], "parts": {}}
    beside = None  # hf, on the CPU while the chip parts run
    for i, part in enumerate(parts):
        # the jax part's seconds are kept while it is still to run (a vLLM part with
        # --diagnose took the whole budget of session 24's first call, leaving jax 26 s)
        reserve = args.jax_seconds if "jax" in parts[i + 1:] else 0.0
        if part == "hf" and any(p in parts for p in ("jax", "vllm")):
            beside = threading.Thread(target=lambda: summary["parts"].__setitem__(
                "hf", run_part("hf", args, cpu, script=__file__)))
            beside.start()
        elif part in ("make", "hf"):
            summary["parts"][part] = run_part(part, args, cpu, script=__file__,
                                              reserve=reserve)
        elif part == "vllm" and args.paged in ("both", "on", "off"):
            modes = ("on", "off") if args.paged == "both" else (args.paged,)
            for mode in modes:
                summary["parts"][f"vllm-paged-{mode}"] = run_part(
                    part, args, {**env, "TORCHTPU_VLLM_PAGED": mode}, f"-paged-{mode}",
                    script=__file__, reserve=reserve)
                publish(args, "serving_chip", summary)
        else:
            summary["parts"][part] = run_part(part, args, env, script=__file__, reserve=reserve)
        publish(args, "serving_chip", summary)
    if beside is not None:
        beside.join()
    hf = summary["parts"].get("hf", {}).get("result")
    if hf is None and Path(args.work, "hf.json").exists():  # from an earlier call
        hf = json.loads(Path(args.work, "hf.json").read_text())
    summary["tokens_equal_hf"] = {name: compare(hf or {}, run.get("result", {}))
                                  for name, run in summary["parts"].items()
                                  if name.startswith(("jax", "vllm"))}
    publish(args, "serving_chip", summary)
    print(json.dumps(summary["tokens_equal_hf"], indent=1))
    return summary

if __name__ == "__main__":
    main()
