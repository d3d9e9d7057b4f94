"""The demo's model: a tiny GPT-style language model and its training loop (tests and
benchmarks train it too).

``TinyGPT`` is a decoder-only transformer: token and position embeddings, pre-LayerNorm blocks
with causal ``scaled_dot_product_attention`` and a GELU MLP, and an output head tied to the token
embedding. ``train_steps`` trains it with AdamW and gradient clipping on batches drawn from a
1-D token tensor by a CPU generator, so runs on different devices see the same batches.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.nn.functional as F
from torch import nn


class CausalSelfAttention(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        if n_embd % n_head:
            raise ValueError(f"torchtpu.argument: n_embd={n_embd} is not a multiple of "
                             f"n_head={n_head}")
        self.n_head = n_head
        self.qkv = nn.Linear(n_embd, 3 * n_embd)
        self.proj = nn.Linear(n_embd, n_embd)
        self.dropout = dropout
        self.resid_drop = nn.Dropout(dropout)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        b, t, c = x.shape
        q, k, v = self.qkv(x).split(c, dim=2)
        # (b, t, c) -> (b, heads, t, head_dim)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        p = self.dropout if self.training else 0.0
        y = F.scaled_dot_product_attention(q, k, v, dropout_p=p, is_causal=True)
        return self.resid_drop(self.proj(y.transpose(1, 2).reshape(b, t, c)))


class Block(nn.Module):
    def __init__(self, n_embd: int, n_head: int, dropout: float) -> None:
        super().__init__()
        self.ln1 = nn.LayerNorm(n_embd)
        self.attn = CausalSelfAttention(n_embd, n_head, dropout)
        self.ln2 = nn.LayerNorm(n_embd)
        self.mlp = nn.Sequential(
            nn.Linear(n_embd, 4 * n_embd),
            nn.GELU(),
            nn.Linear(4 * n_embd, n_embd),
            nn.Dropout(dropout),
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x = x + self.attn(self.ln1(x))
        return x + self.mlp(self.ln2(x))


class TinyGPT(nn.Module):
    """A decoder-only transformer; ``forward(idx, targets)`` returns (logits, loss or None)."""

    def __init__(self, vocab: int, block: int, n_layer: int = 2, n_head: int = 2,
                 n_embd: int = 32, dropout: float = 0.0) -> None:
        super().__init__()
        self.block = block
        self.tok_emb = nn.Embedding(vocab, n_embd)
        self.pos_emb = nn.Embedding(block, n_embd)
        self.drop = nn.Dropout(dropout)
        self.blocks = nn.ModuleList(Block(n_embd, n_head, dropout) for _ in range(n_layer))
        self.ln_f = nn.LayerNorm(n_embd)
        self.head = nn.Linear(n_embd, vocab, bias=False)
        self.head.weight = self.tok_emb.weight
        self.apply(self._init)

    @staticmethod
    def _init(m: nn.Module) -> None:
        # Small initial weights keep the first losses near log(vocab), as in GPT-2.
        if isinstance(m, (nn.Linear, nn.Embedding)):
            nn.init.normal_(m.weight, std=0.02)
        if isinstance(m, nn.Linear) and m.bias is not None:
            nn.init.zeros_(m.bias)

    def forward(self, idx: torch.Tensor, targets: torch.Tensor | None = None
                ) -> tuple[torch.Tensor, torch.Tensor | None]:
        t = idx.shape[1]
        if t > self.block:
            raise ValueError(f"torchtpu.argument: sequence of {t} tokens is longer than the block "
                             f"size {self.block}")
        pos = torch.arange(t, device=idx.device)
        x = self.drop(self.tok_emb(idx) + self.pos_emb(pos))
        for blk in self.blocks:
            x = blk(x)
        logits = self.head(self.ln_f(x))
        if targets is None:
            return logits, None
        loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]), targets.reshape(-1))
        return logits, loss


def batch(data: torch.Tensor, batch_size: int, block: int, generator: torch.Generator
          ) -> tuple[torch.Tensor, torch.Tensor]:
    """Random (inputs, next-token targets) windows from the 1-D CPU token tensor data."""
    starts = torch.randint(len(data) - block - 1, (batch_size,), generator=generator)
    x = torch.stack([data[s:s + block] for s in starts.tolist()])
    y = torch.stack([data[s + 1:s + block + 1] for s in starts.tolist()])
    return x, y


def train_steps(model: TinyGPT, data: torch.Tensor, steps: int, device: str | torch.device,
                *, batch_size: int = 8, lr: float = 3e-3, weight_decay: float = 0.1,
                max_norm: float = 1.0, fused: bool | None = None, seed: int = 0,
                shard: tuple[int, int] | None = None,
                on_step: Callable[[int, float], None] | None = None) -> list[float]:
    """Train model (already on device) for steps AdamW steps with clipping; per-step losses.

    Batches come from a CPU generator seeded with seed, so every device sees the same ones.
    ``shard=(rank, world_size)`` trains on this rank's contiguous share of each batch: under
    data parallelism (DDP, FSDP2), which averages gradients, the ranks together take the
    full-batch steps, and the losses returned are this rank's.
    ``on_step(step, loss)`` is called after each step (the demo's progress bar).
    """
    opt = torch.optim.AdamW(model.parameters(), lr=lr, weight_decay=weight_decay, fused=fused)
    gen = torch.Generator().manual_seed(seed)
    model.train()
    losses = []
    for step in range(steps):
        x, y = batch(data, batch_size, model.block, gen)
        if shard is not None:
            rank, world_size = shard
            x, y = x.chunk(world_size)[rank], y.chunk(world_size)[rank]
        _, loss = model(x.to(device), y.to(device))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), max_norm)
        opt.step()
        losses.append(loss.item())
        if on_step is not None:
            on_step(step, losses[-1])
    return losses
