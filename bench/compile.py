"""torch.compile(backend="tpu") figures: training throughput against Strict and JAX, dynamic shapes.

In one run: the compiled TinyGPT training step (2 layers, width 64, sequence 32, batch 8, AdamW
with clipping), as one captured program per call (the whole step, ``compile/whole_step.py``) and
as Dynamo's graphs (``options={"whole_step": False}``), against Strict eager and against the same
step written directly in JAX (same weights, same batches, one ``jax.jit``); and the XLA programs
built for 27 new sequence lengths under ``dynamic=True``. First steps in a new process, cold
cache against warm, are ``bench/warm_start.py``'s.

    python bench/compile.py [--steps 20] [--warmup 4]
"""

from __future__ import annotations

import argparse
import importlib.util
import math
import os
import sys
import time

import jax
import jax.numpy as jnp
import torch
import torch.nn.functional as F
from torch import nn

import torchtpu
from torchtpu.demo.gpt import TinyGPT


def bench_module(name: str):
    """bench/<name>.py, loaded once (bench/ is no package; its scripts run by path)."""
    key = f"bench_{name}"
    if key not in sys.modules:
        spec = importlib.util.spec_from_file_location(
            key, os.path.join(os.path.dirname(os.path.abspath(__file__)), f"{name}.py"))
        sys.modules[key] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[key])
    return sys.modules[key]


jm = bench_module("jax_models")

VOCAB, BLOCK, WIDTH, LAYERS, HEADS, BATCH = 96, 32, 64, 2, 2, 8
LR, BETAS, EPS, WD, MAX_NORM = 3e-3, (0.9, 0.999), 1e-8, 0.1, 1.0


def _model() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, BLOCK, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH)


def _batches(n: int) -> list:
    gen = torch.Generator().manual_seed(1)
    data = torch.randint(VOCAB, (4096,), generator=gen)
    out = []
    for _ in range(n):
        starts = torch.randint(len(data) - BLOCK - 1, (BATCH,), generator=gen).tolist()
        out.append((torch.stack([data[s:s + BLOCK] for s in starts]),
                    torch.stack([data[s + 1:s + BLOCK + 1] for s in starts])))
    return out


def _step(model, opt, x, y):
    _, loss = model(x, y)
    opt.zero_grad(set_to_none=True)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
    opt.step()
    return loss


def _torch_run(step, batches, warmup: int, mode=None) -> tuple[float, list]:
    """(seconds per timed step, losses) of a TinyGPT trained on tpu by step."""
    model = _model().to("tpu")
    opt = torch.optim.AdamW(model.parameters(), lr=LR, betas=BETAS, eps=EPS, weight_decay=WD)
    context = torch.tpu.set_eager_mode(mode) if mode is not None else _Nothing()
    losses = []
    with context:
        for i, (x, y) in enumerate(batches):
            if i == warmup:
                start = time.perf_counter()
            losses.append(step(model, opt, x.to("tpu"), y.to("tpu")).item())
        elapsed = time.perf_counter() - start
    return elapsed / (len(batches) - warmup), losses


class _Nothing:
    def __enter__(self) -> None:
        return None

    def __exit__(self, *exc) -> None:
        return None


# The same model and step written directly in JAX.
def _jax_params(model: TinyGPT) -> dict:
    # The head is tied to the token embedding: one array for both, as in the torch model.
    return {k: jnp.asarray(v.detach().numpy()) for k, v in model.state_dict().items()
            if k != "head.weight"}


def _layer_norm(x, w, b):
    mean = x.mean(-1, keepdims=True)
    var = ((x - mean) ** 2).mean(-1, keepdims=True)
    return (x - mean) * jax.lax.rsqrt(var + 1e-5) * w + b


def _linear(p, name, x):
    return x @ p[f"{name}.weight"].T + p[f"{name}.bias"]


def _jax_loss(p, idx, targets):
    b, t = idx.shape
    x = p["tok_emb.weight"][idx] + p["pos_emb.weight"][jnp.arange(t)]
    d = WIDTH // HEADS
    mask = jnp.tril(jnp.ones((t, t), bool))
    for i in range(LAYERS):
        pre = f"blocks.{i}"
        h = _layer_norm(x, p[f"{pre}.ln1.weight"], p[f"{pre}.ln1.bias"])
        q, k, v = jnp.split(_linear(p, f"{pre}.attn.qkv", h), 3, axis=-1)
        q, k, v = (z.reshape(b, t, HEADS, d).transpose(0, 2, 1, 3) for z in (q, k, v))
        att = jnp.where(mask, q @ k.transpose(0, 1, 3, 2) / math.sqrt(d), -jnp.inf)
        y = (jax.nn.softmax(att, -1) @ v).transpose(0, 2, 1, 3).reshape(b, t, WIDTH)
        x = x + _linear(p, f"{pre}.attn.proj", y)
        h = _layer_norm(x, p[f"{pre}.ln2.weight"], p[f"{pre}.ln2.bias"])
        h = jax.nn.gelu(_linear(p, f"{pre}.mlp.0", h), approximate=False)
        x = x + _linear(p, f"{pre}.mlp.2", h)
    logits = _layer_norm(x, p["ln_f.weight"], p["ln_f.bias"]) @ p["tok_emb.weight"].T
    logp = jax.nn.log_softmax(logits, -1)
    return -jnp.take_along_axis(logp, targets[..., None], -1).mean()


def jax_step():
    """TinyGPT's training step in JAX: clipping + AdamW, as the torch step."""
    return jm.train_step(_jax_loss, LR, BETAS, EPS, WD, MAX_NORM)


def _jax_run(batches, warmup: int) -> tuple[float, list]:
    p = _jax_params(_model())
    m = jax.tree.map(jnp.zeros_like, p)
    v = jax.tree.map(jnp.zeros_like, p)
    count = jnp.zeros((), jnp.float32)
    step = jax.jit(jax_step(), donate_argnums=(0, 1, 2))
    losses = []
    for i, (x, y) in enumerate(batches):
        if i == warmup:
            start = time.perf_counter()
        p, m, v, count, loss = step(p, m, v, count, jnp.asarray(x.numpy()), jnp.asarray(y.numpy()))
        losses.append(float(loss))
    return (time.perf_counter() - start) / (len(batches) - warmup), losses


class _TokenMLP(nn.Module):
    """TinyGPT's embedding and MLP without attention: position-wise over the sequence."""

    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, WIDTH)
        self.ln = nn.LayerNorm(WIDTH)
        self.up = nn.Linear(WIDTH, 4 * WIDTH)
        self.down = nn.Linear(4 * WIDTH, VOCAB)

    def forward(self, idx):
        return self.down(F.gelu(self.up(self.ln(self.emb(idx)))))


def _dynamic_programs(model: nn.Module) -> tuple[int, int]:
    """(XLA programs built, of which per exact shape) for 27 new sequence lengths."""
    compiled = torch.compile(model.to("tpu").eval(), backend="tpu", dynamic=True)
    lengths = list(range(5, 205, 7))  # 29 lengths
    with torch.no_grad():
        for t in lengths[:2]:  # Dynamo's first graph, then the 27 new lengths
            compiled(torch.randint(VOCAB, (BATCH, t), device="tpu"))
        before = torchtpu.metrics.snapshot()
        for t in lengths[2:]:
            out = compiled(torch.randint(VOCAB, (BATCH, t), device="tpu"))
            (out[0] if isinstance(out, tuple) else out).cpu()
    after = torchtpu.metrics.snapshot()
    torch._dynamo.reset()
    return tuple(after.get(k, 0) - before.get(k, 0)
                 for k in ("compiled_graphs", "dynamic_exact_shape_compiles"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=4)
    args = parser.parse_args()
    batches = _batches(args.warmup + args.steps)
    whole, w_losses = _torch_run(torch.compile(_step, backend="tpu"), batches, args.warmup)
    compiled, c_losses = _torch_run(
        torch.compile(_step, backend="tpu", options={"whole_step": False}), batches, args.warmup)
    strict, s_losses = _torch_run(_step, batches, args.warmup, torch.tpu.EagerMode.DEFER_NEVER)
    direct, j_losses = _jax_run(batches, args.warmup)
    print(f"TinyGPT {LAYERS} layers, width {WIDTH}, seq {BLOCK}, batch {BATCH}, AdamW + clipping;"
          f" {args.steps} timed steps after {args.warmup} warmup; platform "
          f"{torchtpu.runtime.platform.platform()}")
    print(f"{'run':<24}{'ms/step':>9}{'vs Strict':>11}{'vs JAX':>8}{'last loss':>11}")
    for name, sec, losses in (("whole-step compile", whole, w_losses),
                              ("compile, Dynamo graphs", compiled, c_losses),
                              ("tpu Strict eager", strict, s_losses),
                              ("jax.jit, same model", direct, j_losses)):
        print(f"{name:<24}{sec * 1e3:>9.2f}{strict / sec:>10.2f}x{direct / sec:>7.2f}x"
              f"{losses[-1]:>11.4f}")
    for name, losses in (("whole-step", w_losses), ("Dynamo graphs", c_losses)):
        print(f"max |loss difference| {name} vs JAX over {len(batches)} steps: "
              f"{max(abs(a - b) for a, b in zip(losses, j_losses, strict=True)):.2e}")
    torch.manual_seed(0)
    for name, model in (("position-wise model (embedding, LayerNorm, MLP)", _TokenMLP()),
                        ("TinyGPT (causal attention over the sequence)",
                         TinyGPT(VOCAB, 256, n_layer=LAYERS, n_head=HEADS, n_embd=WIDTH))):
        built, exact = _dynamic_programs(model)
        print(f"dynamic=True, 27 new sequence lengths 19..201, {name}: {built} XLA programs "
              f"built ({exact} per exact shape)")


if __name__ == "__main__":
    main()
