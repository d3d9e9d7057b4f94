"""``torchtpu.testing.llama.Llama`` written in JAX, with ``torch.autocast``'s casts: the chip
benchmark's anchor.

The same math as the torch model under autocast to bfloat16: float32 master weights and residual
stream; RMSNorms in float32; every linear with bfloat16 operands, float32 accumulation and a
bfloat16 result; rotary tables cast to bfloat16; attention naive (scores with float32
accumulation, a float32 softmax, bfloat16 probabilities) or through JAX's Pallas splash kernel;
the loss's log-softmax in float32. The step is ``jax_models``' AdamW with ``clip_grad_norm_(1.0)``
(one ``jax.jit``, parameters and moments donated), as ``train_step`` in the torch model.

Imports no torch (the chip machine may have none): ``c`` is any object with ``LlamaConfig``'s
fields, ``config()`` gives the benchmark's.
"""

from __future__ import annotations

from types import SimpleNamespace

import jax
import jax.numpy as jnp

BF16, F32 = jnp.bfloat16, jnp.float32


def config(**changes) -> SimpleNamespace:
    """``torchtpu.testing.llama.LlamaConfig()``'s fields (issue 35's model), with changes."""
    c = dict(vocab=32768, dim=1024, layers=12, heads=8, hidden=2816, seq=1024, eps=1e-5,
             rope_theta=10000.0) | changes
    return SimpleNamespace(**c, head_dim=c["dim"] // c["heads"])


def shapes(c) -> dict:
    block = {"attn_norm": (c.dim,), "q": (c.dim, c.dim), "k": (c.dim, c.dim),
             "v": (c.dim, c.dim), "o": (c.dim, c.dim), "mlp_norm": (c.dim,),
             "gate": (c.hidden, c.dim), "up": (c.hidden, c.dim), "down": (c.dim, c.hidden)}
    return {"embed": (c.vocab, c.dim), "norm": (c.dim,), "head": (c.vocab, c.dim),
            "blocks": [dict(block) for _ in range(c.layers)]}


def init(c, key) -> dict:
    """Normal(0.02) weights and unit norms, as the torch model initializes them."""
    keys = iter(jax.random.split(key, 16 * c.layers + 8))
    return jax.tree.map(lambda s: jnp.ones(s, F32) if len(s) == 1
                        else 0.02 * jax.random.normal(next(keys), s, F32),
                        shapes(c), is_leaf=lambda s: isinstance(s, tuple))


def _linear(x, w):  # autocast's mm: bf16 operands, f32 accumulation, bf16 result; w (out, in)
    return jnp.dot(x.astype(BF16), w.astype(BF16).T, preferred_element_type=F32).astype(BF16)


def _norm(x, w, eps):
    h = x.astype(F32)
    return w * (h * jax.lax.rsqrt(jnp.mean(h * h, -1, keepdims=True) + eps))


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def naive_attention(q, k, v):
    t = q.shape[2]
    s = jnp.einsum("bhqd,bhkd->bhqk", q, k, preferred_element_type=F32) * q.shape[-1] ** -0.5
    s = jnp.where(jnp.tril(jnp.ones((t, t), bool)), s, -jnp.inf)
    p = jax.nn.softmax(s, -1).astype(BF16)
    return jnp.einsum("bhqk,bhkd->bhqd", p, v, preferred_element_type=F32).astype(BF16)


def splash_attention(block_q: int | None = None, block_kv: int | None = None,
                     fused_backward: bool = False):
    """JAX's Pallas splash attention (causal): its default blocks (128), or ``block_q`` query
    rows and ``block_kv`` keys per block in the forward and backward kernels alike."""
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_kernel as sk,
    )
    from jax.experimental.pallas.ops.tpu.splash_attention import (
        splash_attention_mask as sm,
    )

    def attend(q, k, v):
        b, h, t, d = q.shape
        mask = sm.MultiHeadMask([sm.CausalMask((t, t)) for _ in range(h)])
        blocks = None
        if block_q is not None:
            bq, bkv = min(block_q, t), min(block_kv, t)
            dq = {} if fused_backward else {"block_q_dq": bq, "block_kv_dq": bkv}
            blocks = sk.BlockSizes(block_q=bq, block_kv=bkv, block_kv_compute=bkv,
                                   block_q_dkv=bq, block_kv_dkv=bkv, block_kv_dkv_compute=bkv,
                                   use_fused_bwd_kernel=fused_backward, **dq)
        kernel = sk.make_splash_mha(mask, head_shards=1, q_seq_shards=1, block_sizes=blocks)
        return jax.vmap(kernel)(q * d ** -0.5, k, v).astype(BF16)
    return attend


def loss_fn(c, attention=naive_attention):
    def loss(p: dict, ids, targets):
        b, t = ids.shape
        inv = 1.0 / c.rope_theta ** (jnp.arange(0, c.head_dim, 2, dtype=F32) / c.head_dim)
        angle = jnp.arange(t, dtype=F32)[:, None] * inv
        angle = jnp.concatenate([angle, angle], -1)
        cos, sin = jnp.cos(angle).astype(BF16), jnp.sin(angle).astype(BF16)
        x = p["embed"][ids]
        for lp in p["blocks"]:
            h = _norm(x, lp["attn_norm"], c.eps)
            q, k, v = (_linear(h, lp[n]).reshape(b, t, c.heads, c.head_dim).transpose(0, 2, 1, 3)
                       for n in "qkv")
            y = attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v)
            x = x + _linear(y.transpose(0, 2, 1, 3).reshape(b, t, c.dim), lp["o"]).astype(F32)
            h = _norm(x, lp["mlp_norm"], c.eps)
            g = _linear(h, lp["gate"])
            x = x + _linear(jax.nn.silu(g) * _linear(h, lp["up"]), lp["down"]).astype(F32)
        logits = _linear(_norm(x, p["norm"], c.eps), p["head"]).astype(F32)
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, targets[..., None], -1).mean()
    return loss
