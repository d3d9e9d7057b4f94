"""The data-parallel tests' single-process reference step (their model, TinyGPT, is the demo's:
``torchtpu/demo/gpt.py``)."""

from __future__ import annotations

import torch


def sgd_full_batch(model: torch.nn.Module, x: torch.Tensor, steps: int, lr: float = 0.1
                   ) -> tuple[torch.Tensor, list[torch.Tensor]]:
    """The single-process reference of the data-parallel tests: ``steps`` SGD steps on the mean
    square of ``model(x)``; the per-step losses and the trained parameters."""
    opt = torch.optim.SGD(model.parameters(), lr=lr)
    losses = []
    for _ in range(steps):
        loss = model(x).square().mean()
        loss.backward()
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach())
    return torch.stack(losses), [p.detach() for p in model.parameters()]
