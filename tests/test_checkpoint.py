"""Activation checkpointing that XLA keeps: in a captured training step (one program for forward
and backward) ``torch.utils.checkpoint`` in both forms cuts the program's temporary memory (XLA's
memory analysis of the compiled program), with CPU's loss and gradients."""

import copy

import pytest
import torch
from torch.utils import checkpoint as ckpt

from torchtpu.testing.program_memory import temp_bytes


class _Block(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.a = torch.nn.Linear(64, 256)
        self.b = torch.nn.Linear(256, 64)

    def forward(self, x):
        return x + self.b(torch.nn.functional.gelu(self.a(x)))


def _blocks():
    torch.manual_seed(0)
    cpu = torch.nn.ModuleList(_Block() for _ in range(8))
    return cpu, copy.deepcopy(cpu).to("tpu")


def _loss(blocks, x, form):
    if form == "sequential":
        return (ckpt.checkpoint_sequential(torch.nn.Sequential(*blocks), 8, x,
                                           use_reentrant=False) ** 2).mean()
    for b in blocks:
        if form == "none":
            x = b(x)
        elif form == "selective":
            x = ckpt.checkpoint(b, x, use_reentrant=False,
                                context_fn=lambda: ckpt.create_selective_checkpoint_contexts(
                                    [torch.ops.aten.mm.default]))
        else:
            x = ckpt.checkpoint(b, x, use_reentrant=form == "reentrant")
    return (x ** 2).mean()


def _captured(form):
    cpu, dev = _blocks()
    x = torch.randn(256, 64)
    _loss(cpu, x.clone().requires_grad_(), form).backward()
    xd = x.to("tpu").requires_grad_()
    g = torch.tpu.TPUGraph()
    with torch.tpu.graph(g):
        loss = _loss(dev, xd, form)
        loss.backward()
    g.replay()
    for c, d in zip(cpu.parameters(), dev.parameters(), strict=True):
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=1e-5, rtol=1e-4)
    return temp_bytes(g.captured.hlo())


@pytest.mark.parametrize("form", ["reentrant", "non_reentrant",
                                  pytest.param("sequential", marks=pytest.mark.full),
                                  pytest.param("selective", marks=pytest.mark.full)])
def test_checkpointing_cuts_the_captured_steps_temporaries(form):
    plain = _captured("none")
    kept = _captured(form)
    assert kept <= 0.6 * plain, (kept, plain)
