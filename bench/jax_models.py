"""JAX ports of the benchmark registry's Hugging Face decoders, and the AdamW train step they share.

``port(model)`` reads a Hugging Face ``LlamaForCausalLM``, ``Qwen3ForCausalLM`` or
``Gemma3ForCausalLM`` (its config and its parameters, as ``jnp`` arrays) and returns the same
next-token loss written in plain ``jax.numpy``: RMSNorm (Gemma's ``1 + w`` form), RoPE with the
config's rope type (default or llama3), grouped-query attention with causal and sliding-window
masks, SwiGLU (Gemma: gelu-tanh) MLPs, Qwen3's and Gemma-3's q/k norms, Gemma-3's embedding scale,
``query_pre_attn_scalar``, pre/post feed-forward norms and final logit soft-capping, and a head tied
to the embedding where the model ties it. ``train_step`` is one step of ``torch.optim.AdamW`` (the
registry's hyperparameters, optionally after ``clip_grad_norm_``) around any such loss, for one
``jax.jit`` with the parameters and moments donated.

The ports follow the models' own arithmetic (float32 throughout), so their losses equal torch's
on CPU to float rounding; ``bench/registry.py`` shows the difference per row.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import jax
import jax.numpy as jnp
import numpy as np

_FAMILIES = ("llama", "qwen3", "gemma3_text")


def _inv_freq(rope: dict, head_dim: int) -> np.ndarray:
    """RoPE's inverse frequencies for one rope-parameters dict, as transformers computes them."""
    inv = 1.0 / (rope["rope_theta"] ** (np.arange(0, head_dim, 2, dtype=np.float32) / head_dim))
    kind = rope.get("rope_type", "default")
    if kind == "default":
        return inv
    if kind != "llama3":
        raise NotImplementedError(f"torchtpu.bench: JAX port has no rope_type {kind!r}; "
                                  "it knows 'default' and 'llama3'")
    # Llama 3.1's scaling: long wavelengths slowed by `factor`, short ones kept, a smooth blend
    # between the two cut-offs.
    factor, low, high = rope["factor"], rope["low_freq_factor"], rope["high_freq_factor"]
    context = rope["original_max_position_embeddings"]
    wavelen = 2 * math.pi / inv
    scaled = np.where(wavelen > context / low, inv / factor, inv)
    smooth = (context / wavelen - low) / (high - low)
    blended = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= context / high) & (wavelen <= context / low)
    return np.where(medium, blended, scaled).astype(np.float32)


def _rms_norm(x, w, eps: float, offset: float):
    return x * jax.lax.rsqrt(jnp.mean(x * x, -1, keepdims=True) + eps) * (offset + w)


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + jnp.concatenate([-x[..., half:], x[..., :half]], -1) * sin


def _attention(q, k, v, mask, scaling: float):
    # q: (batch, heads, seq, dim); k, v: (batch, kv heads, seq, dim), each shared by a group of
    # consecutive query heads (transformers' repeat_kv).
    groups = q.shape[1] // k.shape[1]
    k, v = jnp.repeat(k, groups, axis=1), jnp.repeat(v, groups, axis=1)
    scores = jnp.where(mask, q @ k.swapaxes(-1, -2) * scaling, -jnp.inf)
    return jax.nn.softmax(scores, -1) @ v


def _linear(p: dict, name: str, x):
    return x @ p[f"{name}.weight"].T


def port(model, scan: bool = False) -> tuple[dict, Callable]:
    """(parameters, loss(parameters, ids, targets)) of a Hugging Face causal LM, in JAX.

    The parameters are the model's own (``named_parameters``, so a tied head is one array); the
    loss is ``cross_entropy(model(input_ids=ids).logits, targets)``, mean over tokens. With
    ``scan`` the decoder layers run as one ``jax.lax.scan`` body over their stacked parameters
    (all layers must be of one attention type)."""
    config = model.config
    family = config.model_type
    if family not in _FAMILIES:
        raise NotImplementedError(f"torchtpu.bench: no JAX port of model_type {family!r}; "
                                  f"ported: {', '.join(_FAMILIES)}")
    if getattr(config, "use_bidirectional_attention", False):
        raise NotImplementedError("torchtpu.bench: the JAX port is causal only "
                                  "(use_bidirectional_attention=True)")
    gemma = family == "gemma3_text"
    layers, heads = config.num_hidden_layers, config.num_attention_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    eps = config.rms_norm_eps
    offset = 1.0 if gemma else 0.0  # Gemma's norms scale by (1 + w), their weights start at 0
    scaling = (config.query_pre_attn_scalar if gemma else head_dim) ** -0.5
    layer_types = getattr(config, "layer_types", None) or ["full_attention"] * layers
    # Gemma-3 keeps one rope-parameters dict per layer type, the others one for all layers.
    ropes = config.rope_parameters
    rope_of = (lambda kind: ropes[kind]) if gemma else (lambda kind: ropes)  # noqa: E731
    freqs = {kind: _inv_freq(rope_of(kind), head_dim) for kind in set(layer_types)}
    act = ((lambda x: jax.nn.gelu(x, approximate=True)) if gemma  # gelu_pytorch_tanh
           else jax.nn.silu)
    embed_scale = np.float32(config.hidden_size ** 0.5) if gemma else None
    window = getattr(config, "sliding_window", None)
    softcap = getattr(config, "final_logit_softcapping", None)
    # Gemma-3's attention passes no soft-cap to its attention functions, so
    # attn_logit_softcapping changes nothing in torch and is left out here as well.
    pad = model.model.embed_tokens.padding_idx
    has_qk_norm = family != "llama"
    params = {name: jnp.asarray(t.detach().cpu().numpy()) for name, t in model.named_parameters()}
    head_name = "lm_head.weight" if "lm_head.weight" in params else "model.embed_tokens.weight"
    suffixes = [n[len("model.layers.0."):] for n in params if n.startswith("model.layers.0.")]
    if scan and len(set(layer_types)) > 1:
        raise NotImplementedError("torchtpu.bench: a scanned JAX port needs one attention type "
                                  f"for all layers, not {sorted(set(layer_types))}")

    def loss(p: dict, ids, targets):
        b, t = ids.shape
        x = p["model.embed_tokens.weight"][ids]
        if pad is not None:  # nn.Embedding(padding_idx=...) sends no gradient to that row
            x = jnp.where((ids == pad)[..., None], jax.lax.stop_gradient(x), x)
        if embed_scale is not None:
            x = x * embed_scale
        pos = jnp.arange(t, dtype=jnp.float32)
        rope = {}
        for kind, inv in freqs.items():
            angle = jnp.concatenate([pos[:, None] * inv] * 2, -1)
            rope[kind] = jnp.cos(angle), jnp.sin(angle)
        causal = jnp.tril(jnp.ones((t, t), bool))
        near = jnp.arange(t)[:, None] - jnp.arange(t)[None, :] < (window or t)
        masks = {"full_attention": causal, "sliding_attention": causal & near}

        def norm(name: str, z):
            return _rms_norm(z, p[f"{name}.weight"], eps, offset)

        def block(x, lp: dict, kind: str):
            """One decoder layer; lp: its parameters by name within the layer."""
            def lnorm(name: str, z):
                return _rms_norm(z, lp[f"{name}.weight"], eps, offset)

            h = lnorm("input_layernorm", x)
            q, k, v = (_linear(lp, f"self_attn.{n}_proj", h).reshape(b, t, -1, head_dim)
                       for n in "qkv")
            if has_qk_norm:  # over head_dim, per head
                q, k = lnorm("self_attn.q_norm", q), lnorm("self_attn.k_norm", k)
            q, k, v = (z.transpose(0, 2, 1, 3) for z in (q, k, v))
            q, k = _rotate(q, *rope[kind]), _rotate(k, *rope[kind])
            out = _attention(q, k, v, masks[kind], scaling).transpose(0, 2, 1, 3)
            out = _linear(lp, "self_attn.o_proj", out.reshape(b, t, heads * head_dim))
            if gemma:  # sandwich norms: after attention, and around the MLP
                x = x + lnorm("post_attention_layernorm", out)
                h = lnorm("pre_feedforward_layernorm", x)
            else:
                x = x + out
                h = lnorm("post_attention_layernorm", x)
            h = act(_linear(lp, "mlp.gate_proj", h)) * _linear(lp, "mlp.up_proj", h)
            h = _linear(lp, "mlp.down_proj", h)
            return x + (lnorm("post_feedforward_layernorm", h) if gemma else h)

        if scan:  # the layers' parameters stacked per call, one body (as torchtpu.scan_layers)
            stacked = {s: jnp.stack([p[f"model.layers.{i}.{s}"] for i in range(layers)])
                       for s in suffixes}
            x, _ = jax.lax.scan(lambda h, lp: (block(h, lp, layer_types[0]), None), x, stacked)
        else:
            for i, kind in enumerate(layer_types):
                pre = f"model.layers.{i}."
                x = block(x, {s: p[pre + s] for s in suffixes}, kind)
        logits = norm("model.norm", x) @ p[head_name].T
        if softcap is not None:
            logits = jnp.tanh(logits / softcap) * softcap
        logp = jax.nn.log_softmax(logits, -1)
        return -jnp.take_along_axis(logp, targets[..., None], -1).mean()

    return params, loss


def train_step(loss: Callable, lr: float, betas: tuple, eps: float, weight_decay: float,
               max_norm: float | None = None) -> Callable:
    """One ``torch.optim.AdamW`` step (decoupled decay, bias-corrected moments; after
    ``clip_grad_norm_(max_norm)`` when given) around ``loss``:
    ``step(params, m, v, count, *batch) -> (params, m, v, count, loss)``."""
    b1, b2 = betas

    def step(p, m, v, count, *batch):
        value, g = jax.value_and_grad(loss)(p, *batch)
        if max_norm is not None:
            norm = jnp.sqrt(sum(jnp.sum(x * x) for x in jax.tree.leaves(g)))
            g = jax.tree.map(lambda x: x * jnp.minimum(1.0, max_norm / (norm + 1e-6)), g)
        count = count + 1
        m = jax.tree.map(lambda a, x: b1 * a + (1 - b1) * x, m, g)
        v = jax.tree.map(lambda a, x: b2 * a + (1 - b2) * x * x, v, g)
        step_size = lr / (1 - b1 ** count)
        root_c2 = jnp.sqrt(1 - b2 ** count)

        def update(w, a, s):
            return w * (1 - lr * weight_decay) - step_size * a / (jnp.sqrt(s) / root_c2 + eps)

        return jax.tree.map(update, p, m, v), m, v, count, value

    return step
