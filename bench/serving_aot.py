"""vLLM-TorchTPU's decode step programs and the JAX anchor's, compiled for v5e without a chip.

The TPU compiler's own analysis (``torchtpu.targets.tpu_target``: libtpu compile-only, a
deterministic verdict) of the programs a decode step runs, beside the HBM roofline a decode step
must pay (weights + the KV its requests attend, at 819 GB/s):

- ``vllm``: ``LLM(model=dir)`` (engine in this process, bfloat16, the config's shapes; weights
  ``load_format="dummy"``, or with ``--weights real`` a checkpoint written by ``serving_chip``'s
  ``make_model`` and read by vLLM's own loader, as a served model's are) on XLA:CPU; the model
  runner's host-fed decode step of R requests at context C (``_dummy_step``, exactly the
  captured program a served decode step of that bucket replays) is captured, not run on the
  CPU, and its program is traced again for a v5e (the ragged paged-attention kernel then lowers
  through Mosaic, as on the chip) and compiled.
  ``TORCHTPU_VLLM_PAGED`` picks the path: ``on`` (the kernel) or ``off`` (the gathered context).
  The cache holds as many blocks as R requests of C tokens need (a chip's would be larger: a
  program whose bytes grow with the cache shows that in ``cache_bytes`` beside them).
- ``anchor``: ``serving_jax.py``'s decode step (static cache of C positions a row, donated).

With ``--weights real`` each row also says how the weights are stored (``odd_storages``: the
parameters whose device array is not of their dtype and shape, e.g. bytes a merged weight's
parts were copied into: the chip's 265 ms step) and, with ``TORCHTPU_TPU_DUMP`` set, lists the
optimized HLO's weight-sized converts, bitcasts, copies and transposes (``big_ops``: what a
step would pay again each run). ``--layers N`` compiles an N-layer model of the config's widths.

With ``TORCHTPU_TPU_DUMP`` set each row also holds ``step_breakdown``'s figures of the optimized
program (its time by kind of op; ``hbm_bytes``: what it moves to and from HBM, each array once,
the paged kernel's KV blocks added), the bytes to hold against the roofline.

Per program: bytes accessed and flops (the cost model's), its seconds, HBM arguments /
temporaries / aliased (the KV cache updated in place when aliased covers it), the roofline bytes
and their seconds at 819 GB/s. Each (model, path) runs in a process of its own. libtpu's cost
model gives the paged kernel (a Mosaic custom call without a cost estimate) no bytes: ``--table``
adds the KV blocks it copies (:func:`kernel_kv_bytes`). Its "bytes accessed" sums every op's
operands, VMEM-resident ones and prefetch copies too: no HBM traffic, but the same count for the
anchor's program and torchtpu's.

    PYTHONPATH=$PWD:/work/venvs/libtpu-only /work/venvs/vllm/bin/python bench/serving_aot.py \
        --models qwen2-0.5b llama-1b --batch 1 8 64 256 --context 576 --out /tmp/aot
    python bench/serving_aot.py --table /tmp/aot/serving_aot.json     # the Markdown table
"""

from __future__ import annotations

import argparse
import json
import math
import os
import re
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import serving_chip  # noqa: E402
import serving_jax  # noqa: E402  (bench/ is no package)
import step_breakdown  # noqa: E402

TARGET = "v5e:1x1"
# HLO ops that move or re-type a whole array (a plain bitcast, a memory-space or shape change
# in place, moves nothing): one of a weight's size in a decode step is the weight read again in
# another form at every step
_MOVES = ("convert", "bitcast-convert", "copy", "transpose", "reshape")
_HLO_LINE = re.compile(r"^\s*(?:ROOT )?(\S+) = (\w+)\[([\d,]*)\]\S* (\S+)\(")
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}


def big_ops(hlo: str, min_bytes: int) -> list[dict]:
    """The optimized HLO's ops in ``_MOVES`` whose result is at least ``min_bytes``, with the
    computation holding them."""
    out, where = [], ""
    for line in hlo.splitlines():
        if line and not line.startswith(" ") and "{" in line:
            where = line.split("(")[0].split()[-1]
        m = _HLO_LINE.match(line)
        if not m or m.group(4) not in _MOVES or m.group(2) not in _BYTES:
            continue
        dims = [int(d) for d in m.group(3).split(",") if d]
        size = _BYTES[m.group(2)] * math.prod(dims)
        if size >= min_bytes:
            out.append({"op": m.group(4), "shape": f"{m.group(2)}{dims}", "bytes": size,
                        "in": where})
    return out


def _layers(name: str, layers: int | None) -> dict:
    """The config, with ``layers`` decoder layers where given."""
    c = serving_jax.CONFIGS[name]
    return c if not layers else c | {"num_hidden_layers": layers}


def roofline(c: dict, batch: int, context: int) -> dict:
    need = serving_jax.weight_bytes(c) + batch * context * serving_jax.kv_bytes_per_token(c)
    return {"roofline_bytes": need, "roofline_s": need / serving_jax.V5E_HBM_BYTES_S}


def _figures(report, c: dict, batch: int, context: int, cache_bytes: int) -> dict:
    out = {"compiles": report.compiles, "error": report.error, "flops": report.flops,
           "bytes_accessed": report.bytes_accessed, "cost_model_s": report.seconds,
           "hbm": report.hbm, "cache_bytes": cache_bytes,
           "cache_in_place": report.hbm.get("aliased", 0) >= cache_bytes}
    out |= roofline(c, batch, context)
    out["bytes_over_roofline"] = report.bytes_accessed / out["roofline_bytes"]
    out["bytes_s"] = report.bytes_accessed / serving_jax.V5E_HBM_BYTES_S
    return out


def _breakdown(hlo: str, c: dict, batch: int, context: int, paged: bool,
               max_model_len: int) -> dict:
    """The optimized step's time by kind (``step_breakdown``) and the HBM bytes it moves, the
    paged kernel's KV blocks added (the HLO cannot show what a Mosaic call copies)."""
    found = step_breakdown.breakdown(hlo, c["vocab_size"])
    kernel = kernel_kv_bytes(c, batch, context, max_model_len) if paged else 0
    return {"breakdown": {k: found[k] for k in ("kinds", "total")},
            "hbm_bytes": found["total"]["hbm_bytes"] + kernel, "kernel_kv_bytes": kernel}


def part_anchor(args) -> dict:
    import jax
    import jax.numpy as jnp

    from torchtpu import settings
    from torchtpu.targets import tpu_target

    out = {}
    for name in args.models:
        c = _layers(name, args.layers)
        _, decode = serving_jax._steps(json.dumps(c, sort_keys=True))
        weights = {k: jax.ShapeDtypeStruct(s, jnp.bfloat16)
                   for k, s in serving_jax.shapes(c).items()}
        rows = []
        for b in args.batch:
            shape = (2, b, c["num_key_value_heads"], args.context, serving_jax.head_dim(c))
            cache = tuple(jax.ShapeDtypeStruct(shape, jnp.bfloat16)
                          for _ in range(c["num_hidden_layers"]))
            ids = jax.ShapeDtypeStruct((b,), jnp.int32)
            r = tpu_target.compile_function(decode, weights, ids, cache, ids,
                                            name=f"anchor_{b}", target_name=TARGET)
            cache_bytes = 2 * c["num_hidden_layers"] * 2 * b * c["num_key_value_heads"] \
                * args.context * serving_jax.head_dim(c)
            row = {"batch": b, "context": args.context} | _figures(r, c, b, args.context,
                                                                    cache_bytes)
            dump = settings.TPU_DUMP.get()
            hlo = sorted(Path(dump).glob(f"anchor_{b}.*.hlo.txt")) if dump else []
            if hlo:
                row |= _breakdown(hlo[-1].read_text(), c, b, args.context, False,
                                  args.max_model_len)
            print(name, json.dumps(row), flush=True)
            rows.append(row)
        out[name] = rows
    return out


def _model_dir(name: str, root: Path, layers: int | None, real: bool) -> Path:
    """A config-only model directory (vLLM's dummy weights need no checkpoint), or with
    ``real`` a checkpoint of random weights (``serving_chip.make_model``)."""
    spec = _layers(name, layers)
    path = root / f"{name}-{spec['num_hidden_layers']}{'-real' * real}"
    if real:
        if not (path / "config.json").exists():
            serving_chip.make_model(name, path, layers=layers)
        return path
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(
        spec | {"torch_dtype": "bfloat16", "eos_token_id": spec["vocab_size"] - 1,
                "bos_token_id": 0}))
    return path


def part_vllm(args) -> dict:
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
    os.environ["TORCHTPU_VLLM_CAPTURE"] = "lazy"
    import numpy as np
    from vllm import LLM

    from torchtpu import settings
    from torchtpu.eager import tpu_graph
    from torchtpu.targets import tpu_target

    # captured, not run: a replay would compile and run the step on this CPU
    tpu_graph.TPUGraph.replay = lambda self: None
    out = {"paged": os.environ.get("TORCHTPU_VLLM_PAGED", "auto"), "weights": args.weights}
    real = args.weights == "real"
    dump = settings.TPU_DUMP.get()
    for name in args.models:
        c = _layers(name, args.layers)
        # room for every request's whole pages (16 to 256 tokens: paged.page_size) and two more
        per_request = -(-args.max_model_len // 256) * 256
        kv_bytes = (max(args.batch) * per_request + 512) * serving_jax.kv_bytes_per_token(c)
        llm = LLM(model=str(_model_dir(name, Path(args.models_dir), args.layers, real)),
                  dtype="bfloat16", load_format="auto" if real else "dummy",
                  skip_tokenizer_init=True, seed=0,
                  max_model_len=args.max_model_len, max_num_seqs=max(args.batch),
                  max_num_batched_tokens=max(args.max_model_len, max(args.batch)),
                  kv_cache_memory_bytes=kv_bytes)
        runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
        cache_bytes = sum(t.numel() * t.element_size() for t in runner.kv_caches)
        odd = odd_storages(runner.model)
        # the smallest weight matrix of a layer: a move of one is a weight's
        smallest = min(p.numel() * p.element_size() for p in runner.model.parameters()
                       if p.dim() == 2)
        rows = []
        for b in args.batch:
            graphs = runner.step_graphs
            before = set(graphs._graphs)
            runner._dummy_step(np.ones(b, dtype=np.int64), args.context,
                               args.program == "tokens")
            runner._fed = runner._sampled = None
            (key,) = set(graphs._graphs) - before
            captured = graphs._graphs[key][0]._captured
            avals = [jax_aval(a) for a in captured._io.arguments()]
            # (the logits program's name as before: earlier sections' commands read its dump)
            program = f"vllm_{'decode' if args.program == 'logits' else 'tokens'}_{b}"
            start = time.perf_counter()
            r = tpu_target.compile_function(captured._fn.jitted, *avals, name=program,
                                            target_name=TARGET)
            row = {"batch": b, "context": args.context, "max_model_len": args.max_model_len,
                   "program": args.program,
                   "ops": captured.ops,
                   "arguments": len(avals),
                   "compile_s": time.perf_counter() - start, "odd_storages": odd,
                   "byte_arguments": sum(str(a.dtype) == "uint8" for a in avals)}
            hlo = sorted(Path(dump).glob(f"{program}.*.hlo.txt")) if dump else []
            if hlo:
                row["big_ops"] = big_ops(hlo[-1].read_text(), smallest)
                row |= _breakdown(hlo[-1].read_text(), c, b, args.context,
                                  out["paged"] == "on", args.max_model_len)
            row |= _figures(r, c, b, args.context, cache_bytes)
            print(name, json.dumps(row), flush=True)
            rows.append(row)
            del graphs._graphs[key]
        out[name] = rows
        del llm, runner
    return out


def _whole_or_stacked(array: tuple, param: tuple) -> bool:
    """Whether a storage array of this shape holds a parameter of that shape as it is, or
    stacked: ``[n, *param]``, or the stack's first two dims merged (how ``torch.stack``'s
    concatenation leaves it)."""
    return (array == param or array[1:] == param
            or (len(array) == len(param) > 0 and array[1:] == param[1:]
                and array[0] % param[0] == 0))


def odd_storages(model) -> list[str]:
    """Parameters whose device array is not of their own dtype and shape, nor a stack of such
    (``integrations/vllm/stacked.py``: one layer's weight a whole index of it): bytes a weight's
    parts were copied into, a flattened array, which each step would convert back."""
    from torchtpu.eager.capture import storage_of

    out = []
    for n, p in model.named_parameters():
        a = storage_of(p)._tpu_array
        if a is None or str(a.dtype) != str(p.dtype).removeprefix("torch.") \
                or not _whole_or_stacked(tuple(a.shape), tuple(p.shape)):
            out.append(f"{n}: {None if a is None else (str(a.dtype), tuple(a.shape))}")
    return out


def jax_aval(a):
    import jax

    return jax.ShapeDtypeStruct(a.shape, a.dtype)


def kernel_kv_bytes(c: dict, batch: int, context: int, max_model_len: int) -> int:
    """What the paged kernel reads that the cost model does not see: libtpu gives a Mosaic
    custom call no cost (JAX's kernel declares none), so its KV reads are added here. It copies
    whole KV blocks a sequence (``ragged_paged_attention.blocks``, pages by the platform's rule
    for ``max_model_len``), past the sequence's end too."""
    from torchtpu.integrations.vllm.paged import page_size
    from torchtpu.kernels.ragged_paged_attention import blocks

    page, token = page_size(max_model_len), serving_jax.kv_bytes_per_token(c)
    per_seq = -(-max_model_len // page)
    per_block = page * blocks(batch, batch, per_seq, page,
                              token // c["num_hidden_layers"])["num_kv_pages_per_block"]
    return batch * -(-context // per_block) * per_block * token


def table(result: dict) -> str:
    """A Markdown table of ``serving_aot.json``: each vLLM path beside the anchor's step."""
    anchor = {(m, r["batch"]): r for part, res in result.items() if part.startswith("anchor")
              and res for m, rows in res.items() for r in rows}
    lines = ["| model | batch | program | bytes accessed (GB) | / roofline bytes | "
             "at 819 GB/s (ms) | cost model (ms) | roofline (ms) | vs anchor (cost model) | "
             "GFLOP | temporaries (MB) | KV cache | HBM bytes moved / roofline |",
             "| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- "
             "| ---: |"]
    for part, res in result.items():
        for m, rows in (res or {}).items():
            if not isinstance(rows, list):
                continue
            what = ("anchor" if part.startswith("anchor") else
                    "paged kernel" if res.get("paged") == "on" else "gathered")
            for r in rows:
                if not r.get("compiles"):
                    lines.append(f"| {m} | {r['batch']} | {what} | refused: {r.get('error')} |")
                    continue
                a = anchor.get((m, r["batch"]))
                extra = (kernel_kv_bytes(serving_jax.CONFIGS[m], r["batch"], r["context"],
                                         r.get("max_model_len", 1024))
                         if what == "paged kernel" else 0)
                total = r["bytes_accessed"] + extra
                seconds = (r["cost_model_s"] or 0) + extra / serving_jax.V5E_HBM_BYTES_S
                vs = (f"{seconds / a['cost_model_s']:.2f}x"
                      if a and r.get("cost_model_s") and a.get("cost_model_s") else "")
                cost = f"{seconds * 1e3:.2f}" if r.get("cost_model_s") else "-"
                # what the program moves to and from HBM (step_breakdown: each array once)
                moved = (f"{r['hbm_bytes'] / r['roofline_bytes']:.2f}x" if "hbm_bytes" in r
                         else "-")
                lines.append(
                    f"| {m} | {r['batch']} | {what} | {total / 1e9:.2f} | "
                    f"{total / r['roofline_bytes']:.2f} | "
                    f"{total / serving_jax.V5E_HBM_BYTES_S * 1e3:.2f} | {cost} | "
                    f"{r['roofline_s'] * 1e3:.2f} | {vs} | {r['flops'] / 1e9:.1f} | "
                    f"{r['hbm'].get('temporaries', 0) / 1e6:.0f} | "
                    f"{'in place' if r['cache_in_place'] else 'COPIED'} | "
                    f"{moved} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--part", choices=("anchor", "vllm", "all"), default="all")
    ap.add_argument("--models", nargs="+", default=["qwen2-0.5b", "llama-1b"])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64, 256])
    ap.add_argument("--context", type=int, default=576,
                    help="each request's tokens at the step (512 in, 64 of 128 out)")
    ap.add_argument("--max-model-len", type=int, default=640,
                    help="the served engine's (the chip bench's 512 in + 128 out)")
    ap.add_argument("--paths", nargs="+", default=["on", "off"],
                    help="TORCHTPU_VLLM_PAGED values to compile the vLLM step under")
    ap.add_argument("--no-anchor", dest="anchor", action="store_false",
                    help="leave the anchor out (its JSON already in --out)")
    ap.add_argument("--weights", choices=("dummy", "real"), default="dummy",
                    help="vLLM's dummy weights, or a checkpoint read by its loader")
    ap.add_argument("--layers", type=int, help="decoder layers (default: the config's)")
    ap.add_argument("--program", choices=("logits", "tokens"), default="logits",
                    help="the decode bucket's program: logits and greedy tokens (any step), "
                         "or the tokens alone (an all-greedy step's)")
    ap.add_argument("--models-dir", default="/tmp/serving_aot_models")
    ap.add_argument("--out", default="/tmp/serving_aot")
    ap.add_argument("--tag", help="the part's JSON file name (default: the part's)")
    ap.add_argument("--table", help="print the Markdown table of this serving_aot.json, only")
    args = ap.parse_args(argv)
    if args.table:
        print(table(json.loads(Path(args.table).read_text())))
        return {}
    Path(args.out).mkdir(parents=True, exist_ok=True)
    if args.part == "anchor":
        result = part_anchor(args)
    elif args.part == "vllm":
        result = part_vllm(args)
    else:
        result = {}
        base = [sys.executable, __file__, "--batch", *map(str, args.batch), "--context",
                str(args.context), "--max-model-len", str(args.max_model_len), "--models-dir",
                args.models_dir, "--out", args.out, "--weights", args.weights,
                "--program", args.program,
                *(["--layers", str(args.layers)] if args.layers else [])]
        # one process a model and path: an engine's memory is not handed back within one
        runs = [("anchor", args.models, {})] * args.anchor + [
            ("vllm", [m], {"TORCHTPU_VLLM_PAGED": p}) for p in args.paths for m in args.models]
        for part, models, env in runs:
            tag = "_".join([part, *models] + [f"paged_{v}" for v in env.values()])
            subprocess.run([*base, "--part", part, "--models", *models, "--tag", tag],
                           check=False, env={**os.environ, "TORCHTPU_VLLM": "1", **env})
            f = Path(args.out) / f"{tag}.json"
            result[tag] = json.loads(f.read_text()) if f.exists() else None
        for f in sorted(Path(args.out).glob("anchor*.json")):
            result.setdefault(f.stem, json.loads(f.read_text()))
        (Path(args.out) / "serving_aot.json").write_text(json.dumps(result, indent=1))
        return result
    tag = args.tag or args.part
    (Path(args.out) / f"{tag}.json").write_text(json.dumps(result, indent=1))
    return result


if __name__ == "__main__":
    main()
