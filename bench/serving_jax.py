"""The serving benchmark's anchor: a Llama/Qwen2 decoder in plain JAX, prefill + decode with a
static KV cache, one ``jax.jit`` per step and the cache donated (no torch, no vLLM).

``bench/serving_chip.py`` serves the same model with vLLM on torchtpu; this is what that ought
to approach on the same chip. Weights: random (``init``, at a Hugging Face config's shapes) or
read from the ``model.safetensors`` that ``save_pretrained`` wrote (``load``), so both serve the
same weights. Math as Hugging Face's bfloat16 forward: bfloat16 weights and activations, float32
RMSNorm and softmax, rotary embedding at ``rope_theta`` (no rope scaling), grouped-query
attention, SwiGLU, q/k/v biases for Qwen2, tied or untied output head.

The cache is one ``[2, batch, kv_heads, max_len, head_dim]`` bfloat16 buffer a layer; a decode
step writes position ``pos`` of every row and attends over all ``max_len`` positions, masked
past each row's length (the static shape: the step reads the whole cache, which is what its
roofline counts). Prefill fills ``rows`` cache rows from a ``[rows, T]`` prompt batch.

    python bench/serving_jax.py --model qwen2-0.5b --batch 64 --prompt 512 --output 128
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import struct
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

BF16, F32 = jnp.bfloat16, jnp.float32
# HBM bandwidth of one v5e chip (bytes/s), the decode roofline's denominator
V5E_HBM_BYTES_S = 819e9

# Hugging Face configs (config.json keys) of the served models: Qwen2.5-0.5B's and
# Llama-3.2-1B's shapes, without Llama 3's rope scaling (random weights; "-class" models)
CONFIGS = {
    "qwen2-0.5b": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=896,
                       intermediate_size=4864, num_hidden_layers=24, num_attention_heads=14,
                       num_key_value_heads=2, vocab_size=151936, tie_word_embeddings=True,
                       rope_theta=1e6, rms_norm_eps=1e-6, max_position_embeddings=4096),
    "llama-1b": dict(model_type="llama", architectures=["LlamaForCausalLM"], hidden_size=2048,
                     intermediate_size=8192, num_hidden_layers=16, num_attention_heads=32,
                     num_key_value_heads=8, vocab_size=128256, tie_word_embeddings=True,
                     rope_theta=500000.0, rms_norm_eps=1e-5, max_position_embeddings=4096),
    # CPU smoke tests: 64-wide heads, two KV heads (packed in pairs by the paged path)
    "tiny": dict(model_type="qwen2", architectures=["Qwen2ForCausalLM"], hidden_size=256,
                 intermediate_size=512, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, vocab_size=512, tie_word_embeddings=True,
                 rope_theta=10000.0, rms_norm_eps=1e-6, max_position_embeddings=512),
}


def head_dim(c: dict) -> int:
    return c.get("head_dim") or c["hidden_size"] // c["num_attention_heads"]


def rope_theta(c: dict) -> float:
    """The rotary base: config.json's ``rope_theta`` (Transformers 4) or ``rope_parameters``'
    (Transformers 5); rope scaling is refused (this decoder has none)."""
    rope = c.get("rope_parameters") or c.get("rope_scaling") or {}
    if rope.get("rope_type", "default") != "default":
        raise ValueError(f"rope type {rope['rope_type']!r}: the JAX anchor has no rope scaling")
    return float(c.get("rope_theta") or rope["rope_theta"])


def shapes(c: dict) -> dict:
    """Parameter shapes by Hugging Face's names (torch's (out, in) for linear weights)."""
    d, f, hd = c["hidden_size"], c["intermediate_size"], head_dim(c)
    q, kv = c["num_attention_heads"] * hd, c["num_key_value_heads"] * hd
    out = {"model.embed_tokens.weight": (c["vocab_size"], d), "model.norm.weight": (d,)}
    if not c["tie_word_embeddings"]:
        out["lm_head.weight"] = (c["vocab_size"], d)
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        out |= {p + "input_layernorm.weight": (d,), p + "post_attention_layernorm.weight": (d,),
                p + "self_attn.q_proj.weight": (q, d), p + "self_attn.k_proj.weight": (kv, d),
                p + "self_attn.v_proj.weight": (kv, d), p + "self_attn.o_proj.weight": (d, q),
                p + "mlp.gate_proj.weight": (f, d), p + "mlp.up_proj.weight": (f, d),
                p + "mlp.down_proj.weight": (d, f)}
        if c["model_type"] == "qwen2":
            out |= {p + "self_attn.q_proj.bias": (q,), p + "self_attn.k_proj.bias": (kv,),
                    p + "self_attn.v_proj.bias": (kv,)}
    return out


def weight_bytes(c: dict) -> int:
    return 2 * sum(math.prod(s) for s in shapes(c).values())


def kv_bytes_per_token(c: dict) -> int:
    return 2 * 2 * c["num_hidden_layers"] * c["num_key_value_heads"] * head_dim(c)


def init(c: dict, seed: int = 0) -> dict:
    """Random bfloat16 weights (normal, std 0.02; norms 1) at c's shapes, on the default device."""
    key = jax.random.PRNGKey(seed)
    params = {}
    for i, (name, shape) in enumerate(sorted(shapes(c).items())):
        if name.endswith("norm.weight"):
            params[name] = jnp.ones(shape, BF16)
        else:
            params[name] = (0.02 * jax.random.normal(jax.random.fold_in(key, i), shape,
                                                     F32)).astype(BF16)
    return params


def read_safetensors(path: str | Path) -> dict[str, np.ndarray]:
    """The tensors of one safetensors file as NumPy arrays (bfloat16 via ml_dtypes)."""
    import ml_dtypes

    dtypes = {"BF16": ml_dtypes.bfloat16, "F16": np.float16, "F32": np.float32,
              "I64": np.int64}
    data = Path(path).read_bytes()
    (n,) = struct.unpack("<Q", data[:8])
    header = json.loads(data[8:8 + n])
    base = 8 + n
    out = {}
    for name, meta in header.items():
        if name == "__metadata__":
            continue
        start, end = meta["data_offsets"]
        out[name] = np.frombuffer(data, dtypes[meta["dtype"]], (end - start) //
                                  np.dtype(dtypes[meta["dtype"]]).itemsize,
                                  base + start).reshape(meta["shape"])
    return out


def load(model_dir: str | Path) -> tuple[dict, dict]:
    """(config, bfloat16 parameters on the default device) of a save_pretrained directory."""
    model_dir = Path(model_dir)
    c = json.loads((model_dir / "config.json").read_text())
    arrays = {}
    for f in sorted(model_dir.glob("*.safetensors")):
        arrays |= read_safetensors(f)
    want = shapes(c)
    missing = sorted(set(want) - set(arrays))
    if missing:
        raise ValueError(f"{model_dir}: no tensors {missing[:3]}... in its safetensors")
    return c, {k: jnp.asarray(arrays[k], BF16) for k in want}


def _norm(x, w, eps):
    h = x.astype(F32)
    return (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps)).astype(BF16) * w


def _rope(x, pos, theta):
    """x [..., T, hd] rotated at positions pos [..., T] (Hugging Face's rotate_half form)."""
    hd = x.shape[-1]
    inv = 1.0 / theta ** (jnp.arange(0, hd, 2, dtype=F32) / hd)
    angle = pos[..., None].astype(F32) * inv
    angle = jnp.concatenate([angle, angle], -1)
    cos, sin = jnp.cos(angle).astype(BF16), jnp.sin(angle).astype(BF16)
    half = hd // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def _linear(x, p, name):
    y = jnp.einsum("...i,oi->...o", x, p[name + ".weight"], preferred_element_type=F32)
    if name + ".bias" in p:
        y = y + p[name + ".bias"].astype(F32)
    return y.astype(BF16)


def _decoder(c: dict, p: dict, ids, pos, attend):
    """Logits [B, T, V] (float32) of ids [B, T] at positions pos [B, T]; ``attend(layer, q, k,
    v)`` (q [B, heads, T, hd], k and v [B, kv_heads, T, hd], rotated) gives each layer's
    attention output [B, heads, T, hd] and keeps its cache."""
    b, t = ids.shape
    hd, heads = head_dim(c), c["num_attention_heads"]
    eps, theta = c["rms_norm_eps"], rope_theta(c)
    x = p["model.embed_tokens.weight"][ids]
    for i in range(c["num_hidden_layers"]):
        pre = f"model.layers.{i}."
        h = _norm(x, p[pre + "input_layernorm.weight"], eps)
        q, k, v = (_linear(h, p, pre + f"self_attn.{n}_proj").reshape(b, t, -1, hd)
                   .transpose(0, 2, 1, 3) for n in "qkv")
        o = attend(i, _rope(q, pos[:, None], theta), _rope(k, pos[:, None], theta), v)
        x = x + _linear(o.transpose(0, 2, 1, 3).reshape(b, t, heads * hd), p,
                        pre + "self_attn.o_proj")
        h = _norm(x, p[pre + "post_attention_layernorm.weight"], eps)
        g, u = _linear(h, p, pre + "mlp.gate_proj"), _linear(h, p, pre + "mlp.up_proj")
        x = x + _linear((jax.nn.silu(g.astype(F32)) * u.astype(F32)).astype(BF16), p,
                        pre + "mlp.down_proj")
    head = p.get("lm_head.weight", p["model.embed_tokens.weight"])
    h = _norm(x, p["model.norm.weight"], eps)
    return jnp.einsum("btd,vd->btv", h, head, preferred_element_type=F32)


def _attention(q, k, v, mask):
    """Grouped-query attention: q [B, heads, T, hd], k/v [B, kvh, L, hd], mask [B, T, L]."""
    b, heads, t, hd = q.shape
    kvh = k.shape[1]
    qg = q.reshape(b, kvh, heads // kvh, t, hd)
    s = jnp.einsum("bkgtd,bkld->bkgtl", qg, k, preferred_element_type=F32) * hd ** -0.5
    s = jnp.where(mask[:, None, None], s, -jnp.inf)
    a = jax.nn.softmax(s, -1).astype(BF16)
    o = jnp.einsum("bkgtl,bkld->bkgtd", a, v, preferred_element_type=F32).astype(BF16)
    return o.reshape(b, heads, t, hd)


def prefill_forward(c: dict, p: dict, ids, cache, row0):
    """Prompts ids [n, T] from position 0: their logits, their keys and values written to cache
    rows row0 .. row0 + n (positions 0 .. T - 1); attention causal over the prompt itself."""
    n, t = ids.shape
    pos = jnp.broadcast_to(jnp.arange(t), ids.shape)
    causal = jnp.broadcast_to(jnp.tril(jnp.ones((t, t), bool)), (n, t, t))
    box = list(cache)

    def attend(i, q, k, v):
        kv = jnp.stack([k, v])  # [2, n, kvh, T, hd]
        at = [jnp.asarray(v, row0.dtype) for v in (0, row0, 0, 0, 0)]
        box[i] = jax.lax.dynamic_update_slice(box[i], kv, at)
        return _attention(q, k, v, causal)

    return _decoder(c, p, ids, pos, attend), tuple(box)


def decode_forward(c: dict, p: dict, tokens, cache, pos):
    """One token a row (tokens [B], all cache rows) at positions pos [B]: logits [B, 1, V],
    each row's key and value written at its position, attention over the whole cache masked
    past it."""
    b = tokens.shape[0]
    rows = jnp.arange(b)
    mask = (jnp.arange(cache[0].shape[3])[None, None, :] <= pos[:, None, None])
    box = list(cache)

    def attend(i, q, k, v):
        new = jnp.stack([k[:, :, 0], v[:, :, 0]], 1)  # [B, 2, kvh, hd]
        # one scatter into the layer's donated buffer, in place
        box[i] = box[i].at[:, rows, :, pos].set(new)
        return _attention(q, box[i][0], box[i][1], mask)

    return _decoder(c, p, tokens[:, None], pos[:, None], attend), tuple(box)


def new_cache(c: dict, batch: int, max_len: int) -> tuple:
    """One ``[2, batch, kv_heads, max_len, head_dim]`` buffer a layer (XLA updates a buffer of
    its own in place; slices of one stacked cache were copied)."""
    return tuple(jnp.zeros((2, batch, c["num_key_value_heads"], max_len, head_dim(c)), BF16)
                 for _ in range(c["num_hidden_layers"]))


@functools.cache
def _steps(config_json: str):
    c = json.loads(config_json)

    @functools.partial(jax.jit, donate_argnums=(2,))
    def prefill(p, ids, cache, row0):
        logits, cache = prefill_forward(c, p, ids, cache, row0)
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache

    @functools.partial(jax.jit, donate_argnums=(2,))
    def decode(p, tokens, cache, pos):
        logits, cache = decode_forward(c, p, tokens, cache, pos)
        return jnp.argmax(logits[:, -1], -1).astype(jnp.int32), cache, pos + 1

    return prefill, decode


def prefill_rows(c: dict, prompt: int) -> int:
    """Prompts prefilled per call: attention scores of at most ~256 MiB (float32)."""
    per_row = c["num_attention_heads"] * prompt * prompt * 4
    return max(1, min(16, (256 << 20) // per_row))


def generate(c: dict, p: dict, prompts: np.ndarray, output: int, compiles: list | None = None
             ) -> dict:
    """Greedy generation of ``output`` tokens for every row of prompts [B, T] (int32), with
    timings: prefill seconds, decode step seconds, tokens [B, output]."""
    b, t = prompts.shape
    prefill, decode = _steps(json.dumps(c, sort_keys=True))
    cache = new_cache(c, b, t + output)
    chunk = min(b, prefill_rows(c, t))
    firsts = []
    start = time.perf_counter()
    for r0 in range(0, b, chunk):  # the last chunk overlaps the one before: one shape
        r0 = min(r0, max(0, b - chunk))
        first, cache = prefill(p, jnp.asarray(prompts[r0:r0 + chunk]), cache, jnp.int32(r0))
        firsts.append(first[len(firsts) * chunk - r0:])
    tokens = jnp.concatenate(firsts)
    tokens.block_until_ready()
    prefill_s = time.perf_counter() - start
    pos = jnp.full((b,), t, jnp.int32)
    out, steps = [tokens], []
    for _ in range(output - 1):
        s0 = time.perf_counter()
        tokens, cache, pos = decode(p, tokens, cache, pos)
        tokens.block_until_ready()
        steps.append(time.perf_counter() - s0)
        out.append(tokens)
    return {"prefill_s": prefill_s, "step_s": steps,
            "tokens": np.asarray(jnp.stack(out, 1))}


def roofline_s(c: dict, batch: int, context: int) -> float:
    """The least time a decode step can take: weights + the KV it attends, at HBM bandwidth."""
    return (weight_bytes(c) + batch * context * kv_bytes_per_token(c)) / V5E_HBM_BYTES_S


def bench(c: dict, p: dict, batch: int, prompt: int, output: int, seed: int = 0) -> dict:
    """One warm-up and one timed generation of ``batch`` random prompts; the figures."""
    rng = np.random.default_rng(seed)
    prompts = rng.integers(0, c["vocab_size"], (batch, prompt), dtype=np.int32)
    generate(c, p, prompts, output)  # compiles
    run = generate(c, p, prompts, output)
    steps = sorted(run["step_s"])
    step = steps[len(steps) // 2]
    roof = roofline_s(c, batch, prompt + output)  # the static cache: every position, every step
    return {"batch": batch, "prompt": prompt, "output": output,
            "prefill_s": run["prefill_s"], "decode_step_median_s": step,
            "decode_tok_s": batch / step,
            "output_tok_s": batch * output / (run["prefill_s"] + sum(run["step_s"])),
            "roofline_step_s": roof, "step_over_roofline": step / roof}


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", default="qwen2-0.5b", choices=sorted(CONFIGS))
    ap.add_argument("--model-dir", help="a save_pretrained directory (else random weights)")
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt", type=int, default=512)
    ap.add_argument("--output", type=int, default=128)
    ap.add_argument("--json", help="write the results here")
    args = ap.parse_args(argv)
    if args.model_dir:
        c, p = load(args.model_dir)
    else:
        c, p = CONFIGS[args.model], init(CONFIGS[args.model])
    results = {"device": str(jax.devices()[0].device_kind), "model": args.model,
               "weight_bytes": weight_bytes(c), "runs": []}
    for b in args.batch:
        r = bench(c, p, b, args.prompt, args.output)
        print(json.dumps(r), flush=True)
        results["runs"].append(r)
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=1))
    return results


if __name__ == "__main__":
    main()
