"""Activation checkpointing that XLA keeps: in a captured training step (one program for forward
and backward) ``torch.utils.checkpoint`` in both forms cuts the program's temporary memory (XLA's
memory analysis of the compiled program), with CPU's loss and gradients; so does Hugging Face's
``gradient_checkpointing_enable`` on a Llama step, captured, as a whole step and as Dynamo's
graphs, whose recomputed random ops draw what the forward drew."""

import copy

import pytest
import torch
from torch.utils import checkpoint as ckpt

from torchtpu import metrics
from torchtpu.testing import checkpoint_memory
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


# The Llama step of bench/checkpoint_memory.py (the registry's Llama-3.2 row), at 2 layers.
@pytest.fixture(scope="module")
def cpu_grads():
    pytest.importorskip("transformers")
    return checkpoint_memory.cpu_gradients(2)


@pytest.mark.parametrize(("path", "form"), [
    ("captured", "non_reentrant"),
    pytest.param("dynamo", "non_reentrant", marks=pytest.mark.full),
    pytest.param("captured", "reentrant", marks=pytest.mark.full),
    pytest.param("whole_step", "non_reentrant", marks=pytest.mark.full),
    pytest.param("dynamo", "selective", marks=pytest.mark.full),
])
def test_a_checkpointed_llama_step_keeps_less_with_cpus_gradients(cpu_grads, path, form):
    before = metrics.snapshot()["cpu_fallbacks"]
    plain, plain_diff = checkpoint_memory.measure(path, "none", 2, cpu_grads)
    kept, diff = checkpoint_memory.measure(path, form, 2, cpu_grads)
    assert metrics.snapshot()["cpu_fallbacks"] == before
    assert max(plain_diff, diff) < 1e-5, (plain_diff, diff)
    share = SELECTIVE_SHARE if form == "selective" else LLAMA_SHARE[path]
    assert kept <= share * plain, (kept, plain)


# What 2 of the row's layers keep checkpointed, at most, of what they keep without (the
# embedding, the tied head's logits and the loss are not checkpointed; 8 layers save more:
# bench/RESULTS.md).
# Under Dynamo the min-cut partition saves less without checkpointing too (1.85 MB here, was
# 2.58 MB with AOTAutograd's default partition; checkpointed 1.13, was 1.36): 61%, was 53%.
LLAMA_SHARE = {"captured": 0.6, "whole_step": 0.6, "dynamo": 0.65}
# A selective policy keeps every mm output: under Dynamo's graphs 2 layers keep 1.46 MB, 79% of
# the min-cut's 1.84 MB without checkpointing (65% of the default partition's 2.61 MB before).
# Without the recomputation's scheduling they keep 1.91 MB, 104% (XLA recomputes at the
# backward's start).
SELECTIVE_SHARE = 0.85


def test_a_recomputed_random_region_draws_what_the_forward_drew(fresh_dynamo):
    """Under Dynamo's graphs the partitioner wraps a checkpointed dropout in
    run_and_save_rng_state / run_with_rng_state: the backward's recomputation must draw the
    forward's mask, which the gradient shows (2 * cos(x) where the output kept x, else 0)."""
    graphs: list = []

    def f(x):
        return ckpt.checkpoint(lambda t: torch.nn.functional.dropout(t.sin(), 0.5, True), x,
                               use_reentrant=False)

    compiled = torch.compile(f, backend="tpu",
                             options={"debug_callback": lambda gm, text: graphs.append(gm)})
    x = torch.randn(64, 64, device="tpu", requires_grad=True)
    y = compiled(x)
    y.sum().backward()
    targets = {n.target for gm in graphs for n in gm.graph.nodes}
    assert torch.ops.higher_order.run_with_rng_state in targets
    kept = y.cpu() != 0
    assert 0.3 < kept.float().mean() < 0.7
    expected = torch.where(kept, 2 * x.detach().cpu().cos(), 0.0)
    torch.testing.assert_close(x.grad.cpu(), expected)
