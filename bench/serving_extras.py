"""vLLM-TorchTPU's serving features on a chip, one figure each (issue 38 item 4).

``serving_chip.py``'s sibling: the same models (``serving_chip.make_model``, made here if the
directory is missing), the same engine in this process, each part an engine in a process of its
own within ``--budget`` (``chip_parts.run_part``), results in ``--out`` as
``serving_extras.json`` and ``serving_extras_logs.tar.gz`` (``chip_parts.publish``):

- ``cache``: prefix caching and structured output, one engine. Prefix caching: a request of
  ``--prefix-tokens`` shared tokens + ``--suffix-tokens`` of its own, cold, then another with
  the same prefix and a suffix of its own: its TTFT over the cold one's (``ttft_ratio``) and the
  tokens it read from the cache; a round of other prompts first compiles both step shapes.
  Structured output: one request under a JSON schema (xgrammar, no free whitespace), its text
  parsed and checked against the schema (``valid``). The model directory's tokenizer is
  replaced by a byte-level one (``torchtpu.integrations.vllm.tiny``) in a sibling directory
  sharing the weights: JSON has to be spelled in tokens.
- ``ngram``: n-gram speculative decoding (``--spec-tokens`` drafts a step): prompts that repeat
  a phrase, the acceptance rate (vLLM's spec_decode counters over the timed round) and output
  tokens/s at each ``--concurrency``; greedy tokens of ``serving_chip.PROMPTS`` for the token
  check against ``hf.json``.
- ``fp8``: the FP8 KV cache (``kv_cache_dtype="fp8"``): the cache's dtype, bytes a token beside
  the model dtype's, blocks, whether the paged kernel serves it (``paged_kernel``: where its
  float8 pages tile, Llama-3.2-1B; Qwen2.5-0.5B's take the gathered path), and output tokens/s
  and decode step at each load of ``--shapes`` x ``--concurrency``; greedy tokens as
  ``ngram``'s.

    python bench/serving_extras.py [--parts cache ngram fp8] [--models qwen2-0.5b]
        [--shapes 512x128] [--concurrency 8 64] [--budget S] [--out DIR]

Llama-3.2-1B's shapes and the 1800/128 load are ``serving_chip.py``'s own ``--models llama-1b``
and ``--shapes 1800x128``.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import time
import traceback
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving_chip  # noqa: E402  (bench/ is no package)
import serving_diag  # noqa: E402
import serving_jax  # noqa: E402
from chip_parts import publish, run_part  # noqa: E402

PARTS = ("cache", "ngram", "fp8")
# what save_pretrained writes of a tokenizer (the twin directory has its own)
TOKENIZER_FILES = ("tokenizer", "special_tokens_map", "vocab", "merges", "chat_template")
# the schema of the structured-output request: bounded values, so that even random weights end
# it within its tokens
SCHEMA = {"type": "object",
          "properties": {"ok": {"type": "boolean"},
                         "color": {"enum": ["red", "green", "blue"]},
                         "size": {"enum": ["small", "large"]}},
          "required": ["ok", "color", "size"], "additionalProperties": False}


def _model(args, name: str) -> Path:
    path = Path(args.models_dir) / name
    if not (path / "config.json").exists():
        serving_chip.make_model(name, path)
    return path


def _byte_tokenizer_twin(path: Path) -> Path:
    """A directory with ``path``'s config and weights (links) and a byte-level tokenizer."""
    from torchtpu.integrations.vllm.tiny import byte_tokenizer

    twin = path.with_name(path.name + "-bytes")
    twin.mkdir(exist_ok=True)
    for f in path.iterdir():
        if not f.name.startswith(TOKENIZER_FILES) and not (twin / f.name).exists():
            (twin / f.name).symlink_to(f.resolve())
    byte_tokenizer().save_pretrained(twin)
    return twin


def _engine(model: Path, args, **options):
    from vllm import LLM

    max_len = max([p + o for p, o in map(serving_chip.parse_shape, args.shapes)]
                  + [args.prefix_tokens + args.suffix_tokens + 8,
                     max(map(len, serving_chip.PROMPTS)) + serving_chip.HF_NEW_TOKENS])
    kv = {} if args.kv_bytes is None else {"kv_cache_memory_bytes": int(args.kv_bytes)}
    start = time.perf_counter()
    llm = LLM(model=str(model), max_model_len=max_len, max_num_seqs=max(args.concurrency),
              seed=0, disable_log_stats=False, **kv, **options)
    return llm, time.perf_counter() - start


def _counters(llm) -> dict:
    return {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}


def _first_token(llm, prompt: list[int], rid: str) -> dict:
    """One request alone, stepped to its first token: TTFT and the tokens read from the cache."""
    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    engine = llm.llm_engine
    start = time.perf_counter()
    engine.add_request(rid, TokensPrompt(prompt_token_ids=prompt),
                       SamplingParams(max_tokens=2, temperature=0.0, ignore_eos=True))
    out = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.outputs[0].token_ids and "ttft_s" not in out:
                out = {"ttft_s": time.perf_counter() - start,
                       "cached_tokens": o.num_cached_tokens}
    return out


def prefix_caching(llm, args, counter) -> dict:
    rng = random.Random(0)
    vocab = llm.llm_engine.model_config.get_vocab_size() - 2

    def tokens(n):
        return [rng.randrange(vocab) for _ in range(n)]

    warm = tokens(args.prefix_tokens)  # both step shapes compiled here, not in the timed pair
    _first_token(llm, warm + tokens(args.suffix_tokens), "warm-cold")
    _first_token(llm, warm + tokens(args.suffix_tokens), "warm-hit")
    prefix, before = tokens(args.prefix_tokens), counter.count
    cold = _first_token(llm, prefix + tokens(args.suffix_tokens), "cold")
    hit = _first_token(llm, prefix + tokens(args.suffix_tokens), "hit")
    return {"prefix_tokens": args.prefix_tokens, "suffix_tokens": args.suffix_tokens,
            "cold": cold, "hit": hit, "ttft_ratio": hit["ttft_s"] / cold["ttft_s"],
            "compiles": counter.count - before}


def structured_output(llm, args, counter) -> dict:
    from vllm import SamplingParams
    from vllm.sampling_params import StructuredOutputsParams

    start = time.perf_counter()
    (out,) = llm.generate(["answer in json: "], SamplingParams(
        max_tokens=64, temperature=0.0,
        structured_outputs=StructuredOutputsParams(json=SCHEMA)), use_tqdm=False)
    text = out.outputs[0].text
    result = {"text": text, "tokens": len(out.outputs[0].token_ids),
              "seconds": time.perf_counter() - start}
    try:
        value = json.loads(text)
        result["valid"] = (isinstance(value, dict) and set(value) == set(SCHEMA["required"])
                           and isinstance(value["ok"], bool)
                           and value["color"] in SCHEMA["properties"]["color"]["enum"]
                           and value["size"] in SCHEMA["properties"]["size"]["enum"])
    except ValueError as e:
        result["valid"], result["error"] = False, str(e)
    return result


def part_cache(args) -> dict:
    counter = serving_diag.CompileCounter()
    out = {}
    for name in args.models:
        llm, startup = _engine(
            _byte_tokenizer_twin(_model(args, name)), args,
            structured_outputs_config={"backend": "xgrammar", "disable_any_whitespace": True})
        out[name] = result = {"startup_s": startup}
        _save(args, out)
        for key, run in (("prefix_caching", prefix_caching),
                         ("structured_output", structured_output)):
            try:
                result[key] = run(llm, args, counter)
            except Exception as e:  # the other feature's figure still comes back
                result[key] = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            print(key, json.dumps(result[key]), flush=True)
            _save(args, out)
        del llm
    return out


def _greedy(llm) -> list[list[int]]:
    from vllm import SamplingParams

    outs = llm.generate([{"prompt_token_ids": p} for p in serving_chip.PROMPTS],
                        SamplingParams(max_tokens=serving_chip.HF_NEW_TOKENS, temperature=0.0,
                                       ignore_eos=True), use_tqdm=False)
    return [list(o.outputs[0].token_ids) for o in outs]


def _loads(llm, args, name: str, result: dict, prompts_of) -> None:
    """Each load of ``--shapes`` x ``--concurrency``: a warm-up round of the timed round's
    lengths (its step shapes: ``serving_chip.timed_load``), then a timed round of new prompts
    (``serving_chip.drive``), with the spec-decode counters' deltas."""
    counter = serving_diag.CompileCounter()
    config = serving_jax.CONFIGS[name]
    vocab = config["vocab_size"] - 2
    rng = random.Random(0)
    for prompt, output in map(serving_chip.parse_shape, args.shapes):
        for c in args.concurrency:
            try:
                serving_chip.drive(llm, prompts_of(rng, prompt, c, vocab), output)
                before, compiled = _counters(llm), counter.count
                run = serving_chip.drive(llm, prompts_of(rng, prompt, c, vocab), output)
                after = _counters(llm)
                run["compiles"] = counter.count - compiled
                run |= serving_chip._decode_figures(run.pop("steps"), config)
                drafted = after.get("vllm:spec_decode_num_draft_tokens", 0) \
                    - before.get("vllm:spec_decode_num_draft_tokens", 0)
                if drafted:
                    accepted = after["vllm:spec_decode_num_accepted_tokens"] \
                        - before["vllm:spec_decode_num_accepted_tokens"]
                    run |= {"drafted": drafted, "accepted": accepted,
                            "acceptance_rate": accepted / drafted}
            except Exception as e:
                run = {"error": f"{type(e).__name__}: {str(e)[:500]}"}
            run |= {"prompt": prompt, "output": output, "concurrency": c}
            print(json.dumps(run), flush=True)
            result["loads"].append(run)
            _save(args, {name: result})


def _random_prompts(rng: random.Random, length: int, count: int, vocab: int) -> list:
    return [[rng.randrange(vocab) for _ in range(length)] for _ in range(count)]


def _repeating_prompts(rng: random.Random, length: int, count: int, vocab: int) -> list:
    """Prompts repeating a 16-token phrase: what the n-gram proposer drafts from."""
    phrases = _random_prompts(rng, 16, count, vocab)
    return [(p * -(-length // 16))[:length] for p in phrases]


def _feature_part(args, options: dict, prompts) -> dict:
    out = {}
    for name in args.models:
        llm, startup = _engine(_model(args, name), args, **options)
        result = out[name] = {"startup_s": startup, "options": options, "loads": []}
        result["greedy"] = _greedy(llm)
        caches, paged = llm.collective_rpc(lambda worker: (
            [(str(t.dtype), t.numel() * t.element_size())
             for t in worker.model_runner.kv_caches],
            worker.model_runner.attn_groups[0][0].get_metadata_builder().paged))[0]
        cache = llm.llm_engine.vllm_config.cache_config
        total = sum(b for _, b in caches)
        result["kv_cache"] = {"dtype": caches[0][0], "bytes": total, "paged_kernel": paged,
                              "block_size": cache.block_size,
                              "blocks": cache.num_gpu_blocks,
                              "bytes_per_token": total / (cache.num_gpu_blocks
                                                          * cache.block_size),
                              "model_dtype_bytes_per_token":
                                  serving_jax.kv_bytes_per_token(serving_jax.CONFIGS[name])}
        _save(args, out)
        _loads(llm, args, name, result, prompts)
        del llm
    return out


def part_ngram(args) -> dict:
    return _feature_part(args, {"speculative_config": {
        "method": "ngram", "num_speculative_tokens": args.spec_tokens,
        "prompt_lookup_max": 4, "prompt_lookup_min": 2}}, _repeating_prompts)


def part_fp8(args) -> dict:
    return _feature_part(args, {"kv_cache_dtype": "fp8"}, _random_prompts)


def _save(args, result: dict) -> None:
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--parts", nargs="+", default=list(PARTS), choices=PARTS)
    ap.add_argument("--part", choices=PARTS, help=argparse.SUPPRESS)
    ap.add_argument("--models", nargs="+", default=["qwen2-0.5b"],
                    choices=sorted(serving_jax.CONFIGS))
    ap.add_argument("--shapes", nargs="+", default=["512x128"])
    ap.add_argument("--concurrency", type=int, nargs="+", default=[8, 64])
    ap.add_argument("--prefix-tokens", type=int, default=1024)
    ap.add_argument("--suffix-tokens", type=int, default=64)
    ap.add_argument("--spec-tokens", type=int, default=4)
    ap.add_argument("--out", default=os.environ.get("OUT", "/tmp/serving_out"))
    ap.add_argument("--work", default="/tmp/serving_parts",
                    help="each part's JSON and log (serving_chip.py's hf.json read there)")
    ap.add_argument("--models-dir", default="/tmp/serving_models")
    ap.add_argument("--kv-bytes", type=float, help="vLLM's kv_cache_memory_bytes (CPU smoke)")
    ap.add_argument("--part-timeout", type=float, default=300)
    ap.add_argument("--budget", type=float, default=float("inf"))
    ap.add_argument("--json", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.part:
        os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        try:
            result = globals()[f"part_{args.part}"](args)
        except Exception:
            saved = Path(args.json)
            result = json.loads(saved.read_text()) if saved.exists() else {}
            result["error"] = traceback.format_exc()[-3000:]
        _save(args, result)
        return result
    Path(args.out).mkdir(parents=True, exist_ok=True)
    Path(args.work).mkdir(parents=True, exist_ok=True)
    args.deadline = time.perf_counter() + args.budget
    env = {**os.environ, "TORCHTPU_VLLM_CAPTURE": os.environ.get("TORCHTPU_VLLM_CAPTURE",
                                                                 "lazy")}
    extra = ["--prefix-tokens", str(args.prefix_tokens), "--suffix-tokens",
             str(args.suffix_tokens), "--spec-tokens", str(args.spec_tokens)]
    summary: dict = {"argv": sys.argv[1:], "parts": {}}
    for part in args.parts:
        summary["parts"][part] = run_part(part, args, env, script=__file__, extra=extra)
        publish(args, "serving_extras", summary)
    hf = Path(args.work, "hf.json")
    if hf.exists():  # serving_chip's hf part, same models and prompts
        summary["tokens_equal_hf"] = {
            part: serving_chip.compare(json.loads(hf.read_text()), run.get("result", {}))
            for part, run in summary["parts"].items() if part != "cache"}
        publish(args, "serving_extras", summary)
    print(json.dumps({p: r["rc"] for p, r in summary["parts"].items()}))
    return summary


if __name__ == "__main__":
    main()
