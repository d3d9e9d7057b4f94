"""A Llama-style decoder in plain PyTorch, and its training step: the chip benchmark's model.

``Llama`` is what a user writes from the Llama papers without any library: token embedding,
pre-RMSNorm blocks with rotary attention through ``F.scaled_dot_product_attention(is_causal=True)``,
a SwiGLU MLP, a final RMSNorm and an untied head. Casts follow Hugging Face's Llama, so under
``torch.autocast("tpu", torch.bfloat16)`` the norms run in float32, the rotary tables are cast to
the activations' dtype and every product is bfloat16. ``bench/tpu_llama.py`` is the same model in
JAX; ``bench/on_tpu.py`` times both on a chip, and tests run the model at small sizes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn


@dataclass(frozen=True)
class LlamaConfig:
    vocab: int = 32768
    dim: int = 1024
    layers: int = 12
    heads: int = 8
    hidden: int = 2816
    seq: int = 1024
    eps: float = 1e-5
    rope_theta: float = 10000.0

    @property
    def head_dim(self) -> int:
        return self.dim // self.heads


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h = x.float()
        h = h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * h.to(x.dtype)


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    half = x.shape[-1] // 2
    turned = torch.cat((-x[..., half:], x[..., :half]), dim=-1)
    return x * cos + turned * sin


class Attention(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.heads, self.head_dim = c.heads, c.head_dim
        self.q, self.k, self.v, self.o = (nn.Linear(c.dim, c.dim, bias=False) for _ in range(4))

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        b, t, d = x.shape
        q, k, v = (p(x).view(b, t, self.heads, self.head_dim).transpose(1, 2)
                   for p in (self.q, self.k, self.v))
        cos, sin = cos.to(q.dtype), sin.to(q.dtype)  # as HF's apply_rotary_pos_emb
        y = F.scaled_dot_product_attention(_rotate(q, cos, sin), _rotate(k, cos, sin), v,
                                           is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, d))


class Block(nn.Module):
    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.attn_norm, self.mlp_norm = RMSNorm(c.dim, c.eps), RMSNorm(c.dim, c.eps)
        self.attn = Attention(c)
        self.gate = nn.Linear(c.dim, c.hidden, bias=False)
        self.up = nn.Linear(c.dim, c.hidden, bias=False)
        self.down = nn.Linear(c.hidden, c.dim, bias=False)

    def forward(self, x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.attn_norm(x), cos, sin)
        h = self.mlp_norm(x)
        return x + self.down(F.silu(self.gate(h)) * self.up(h))


class Llama(nn.Module):
    """``forward(ids, targets)`` returns the mean next-token cross-entropy."""

    def __init__(self, c: LlamaConfig) -> None:
        super().__init__()
        self.config = c
        self.embed = nn.Embedding(c.vocab, c.dim)
        self.blocks = nn.ModuleList(Block(c) for _ in range(c.layers))
        self.norm = RMSNorm(c.dim, c.eps)
        self.head = nn.Linear(c.dim, c.vocab, bias=False)
        inv = 1.0 / c.rope_theta ** (torch.arange(0, c.head_dim, 2).float() / c.head_dim)
        angle = torch.outer(torch.arange(c.seq).float(), inv)
        angle = torch.cat((angle, angle), dim=-1)
        self.register_buffer("cos", angle.cos(), persistent=False)
        self.register_buffer("sin", angle.sin(), persistent=False)
        for m in self.modules():
            if isinstance(m, (nn.Linear, nn.Embedding)):
                nn.init.normal_(m.weight, std=0.02)

    def forward(self, ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        t = ids.shape[1]
        cos, sin = self.cos[:t], self.sin[:t]
        x = self.embed(ids)
        for blk in self.blocks:
            x = blk(x, cos, sin)
        logits = self.head(self.norm(x))
        return F.cross_entropy(logits.view(-1, logits.shape[-1]).float(), targets.reshape(-1))


def model_flops(c: LlamaConfig, params: int, tokens: int) -> float:
    """nanoGPT's count of a training step's flops: 6N a token plus attention's 12 L d T."""
    return tokens * (6 * params + 12 * c.layers * c.dim * c.seq)


def train_step(model: Llama, lr: float = 3e-4, dtype: torch.dtype | None = torch.bfloat16
               ) -> tuple[Callable, torch.optim.Optimizer]:
    """(step(ids, targets) -> loss, the optimizer): forward under autocast to ``dtype`` (none
    when ``None``), ``backward``, ``clip_grad_norm_(1.0)``, AdamW, ``zero_grad(set_to_none)``."""
    device = next(model.parameters()).device.type
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=0.1)

    def step(ids: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
        with torch.autocast(device, dtype=dtype or torch.float32, enabled=dtype is not None):
            loss = model(ids, targets)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    return step, opt


def seeded_step(config: LlamaConfig, device: str, batch: int = 2
                ) -> tuple[Llama, Callable, torch.Tensor, torch.Tensor]:
    """(model, step, ids, targets) on ``device``: the model from seed 0, ``train_step``'s step,
    one batch of ids from seed 1, so a run on tpu and one on CPU start alike."""
    torch.manual_seed(0)
    model = Llama(config).to(device)
    step, _ = train_step(model)
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(config.vocab, (batch, config.seq + 1), generator=g)
    return model, step, ids[:, :-1].contiguous().to(device), ids[:, 1:].contiguous().to(device)
