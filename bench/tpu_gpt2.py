"""GPT-2 small (124M) as a JAX program with ``torch.autocast``'s casts, for the TPU cost model.

The JAX side of ``bench/tpu_cost.py --gpt2``: HF ``GPT2LMHeadModel``'s math (pre-norm blocks,
fused qkv ``Conv1D``s, tanh GELU, a head tied to the token embedding, no dropout) with the dtypes
autocast gives torch's step on tpu: float32 master weights; linears (``addmm``) and attention's
products in bfloat16 with float32 accumulation; layer norms, softmax and the loss in float32; the
residual stream float32 (a float32 tensor plus a bfloat16 one). The step is ``jax_models``'
AdamW (torch's defaults, ``lr=1e-3``), so it is what ``torchtpu.aot``'s train step runs.
``compile_step`` compiles it for one chip of a target without running it anywhere: no weights,
only their shapes.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

from torchtpu.targets import tpu_target

BF16, F32 = jnp.bfloat16, jnp.float32
VOCAB, POSITIONS, WIDTH, HEADS = 50257, 1024, 768, 12


def shapes(layers: int = 12, positions: int = POSITIONS) -> dict:
    """The parameters' shapes (HF's: ``Conv1D`` weights are (in, out))."""
    d = WIDTH
    block = {"ln1_g": (d,), "ln1_b": (d,), "qkv_w": (d, 3 * d), "qkv_b": (3 * d,),
             "proj_w": (d, d), "proj_b": (d,), "ln2_g": (d,), "ln2_b": (d,),
             "fc_w": (d, 4 * d), "fc_b": (4 * d,), "out_w": (4 * d, d), "out_b": (d,)}
    return {"wte": (VOCAB, d), "wpe": (positions, d), "lnf_g": (d,), "lnf_b": (d,),
            "blocks": [dict(block) for _ in range(layers)]}


def _linear(x, w, b):  # autocast's addmm: bf16 operands, f32 accumulation, a bf16 result
    y = jnp.dot(x.astype(BF16), w.astype(BF16), preferred_element_type=F32)
    return (y + b.astype(BF16).astype(F32)).astype(BF16)


def _norm(x, g, b, eps: float = 1e-5):  # autocast's layer_norm: float32
    x = x.astype(F32)
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + eps) * g + b


def _attention(x, p):
    n, t, d = x.shape
    qkv = _linear(x, p["qkv_w"], p["qkv_b"]).reshape(n, t, 3, HEADS, d // HEADS)
    q, k, v = (qkv[:, :, i].transpose(0, 2, 1, 3) for i in range(3))
    s = jnp.einsum("nhqd,nhkd->nhqk", q, k, preferred_element_type=F32) / math.sqrt(d // HEADS)
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    prob = jax.nn.softmax(s, axis=-1).astype(BF16)
    o = jnp.einsum("nhqk,nhkd->nhqd", prob, v, preferred_element_type=F32).astype(BF16)
    return _linear(o.transpose(0, 2, 1, 3).reshape(n, t, d), p["proj_w"], p["proj_b"])


def _mlp(x, p):
    return _linear(jax.nn.gelu(_linear(x, p["fc_w"], p["fc_b"]), approximate=True),
                   p["out_w"], p["out_b"])


def loss(params: dict, ids, targets):
    """Mean cross-entropy of the next token (float32), as ``registry.hf_loss`` of HF's model."""
    x = params["wte"][ids] + params["wpe"][: ids.shape[1]]
    for p in params["blocks"]:
        x = x + _attention(_norm(x, p["ln1_g"], p["ln1_b"]), p).astype(F32)
        x = x + _mlp(_norm(x, p["ln2_g"], p["ln2_b"]), p).astype(F32)
    h = _norm(x, params["lnf_g"], params["lnf_b"])
    logits = jnp.dot(h.astype(BF16), params["wte"].astype(BF16).T,
                     preferred_element_type=F32).astype(BF16).astype(F32)
    logp = jax.nn.log_softmax(logits, axis=-1)
    return -jnp.take_along_axis(logp, targets[..., None], axis=-1).mean()


def compile_step(topology: str, batch: int, seq: int = POSITIONS, layers: int = 12,
                 adamw: dict | None = None) -> tpu_target.Report:
    """The whole train step (loss, gradients, AdamW) compiled for one chip of topology."""
    from compile import bench_module  # bench/'s own loader (the caller put bench/ on the path)

    jm = bench_module("jax_models")
    a = adamw or dict(lr=1e-3, betas=(0.9, 0.999), eps=1e-8, weight_decay=0.01)
    step = jax.jit(jm.train_step(loss, a["lr"], a["betas"], a["eps"], a["weight_decay"]),
                   donate_argnums=(0, 1, 2))
    params = jax.tree.map(lambda s: jax.ShapeDtypeStruct(s, F32), shapes(layers, seq),
                          is_leaf=lambda s: isinstance(s, tuple))
    ids = jax.ShapeDtypeStruct((batch, seq), jnp.int32)
    return tpu_target.compile_function(step, params, params, params,
                                       jax.ShapeDtypeStruct((), F32), ids, ids,
                                       name=f"gpt2 jax train {layers} blocks {batch}x{seq}",
                                       target_name=topology)
