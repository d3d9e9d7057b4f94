"""The demo's text, its character vocabulary, and sampling text from a trained TinyGPT."""

from __future__ import annotations

from importlib import resources

import torch

from torchtpu.demo.gpt import TinyGPT


def load_text() -> str:
    """The shipped story (original prose written for this demo)."""
    return resources.files("torchtpu.demo").joinpath("lighthouse.txt").read_text("utf-8")


class CharVocab:
    """One token per distinct character of a text."""

    def __init__(self, text: str) -> None:
        self.chars = sorted(set(text))
        self.index = {c: i for i, c in enumerate(self.chars)}

    def __len__(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        return torch.tensor([self.index[c] for c in text], dtype=torch.long)

    def decode(self, ids) -> str:
        return "".join(self.chars[i] for i in ids)


@torch.no_grad()
def sample(model: TinyGPT, prompt: torch.Tensor, n: int, *, temperature: float = 0.8,
           seed: int = 0) -> list[int]:
    """n token ids continuing prompt (a 1-D tensor of exactly ``model.block`` ids).

    The context window always holds ``model.block`` tokens, so every step has the same shapes
    and reuses one compiled program per op.
    """
    device = model.tok_emb.weight.device
    gen = torch.Generator(device=device).manual_seed(seed)
    window = prompt[-model.block:].to(device).unsqueeze(0)
    model.eval()
    out = []
    for _ in range(n):
        logits, _ = model(window)
        probs = torch.softmax(logits[0, -1] / temperature, dim=-1)
        nxt = torch.multinomial(probs, 1, generator=gen)
        window = torch.cat([window[:, 1:], nxt.unsqueeze(0)], dim=1)
        out.append(nxt)
    return torch.cat(out).tolist()
