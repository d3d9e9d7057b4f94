"""The benchmark registry (bench/registry.py): one row runs, its loss is CPU's, its figures are
filled in, bad row names are refused, and the JAX ports of its Hugging Face rows compute torch's
loss."""

import importlib.util
import os
import sys

import pytest
import torch

from torchtpu.demo.gpt import TinyGPT
from torchtpu.testing.hf_rows import HF_VOCAB, hf, tokens

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "registry.py")
_spec = importlib.util.spec_from_file_location("bench_registry", _PATH)
registry = importlib.util.module_from_spec(_spec)
sys.modules[_spec.name] = registry  # dataclasses look their module up
_spec.loader.exec_module(registry)

# A one-layer TinyGPT on 8 tokens: the registry's machinery at the smallest cost (the Hugging
# Face rows are the same machinery with another builder; importing transformers alone would
# take this test's budget).
def _tiny() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(64, 8, n_layer=1, n_head=2, n_embd=16)


TINY = registry.Model("tiny", _tiny, tokens(64, 8, 2), lambda m, x, y: m(x, y)[1])


def test_one_row_matches_cpu_and_reports_its_figures():
    row = registry.run_row(TINY, "forward", "defer", steps=1, warmup=0)
    model = TINY.build()
    x, y = TINY.batch(torch.Generator().manual_seed(1))
    with torch.no_grad():
        expected = TINY.loss(model, x, y).item()
    assert row["losses"] == pytest.approx([expected], rel=1e-5)
    assert row["steady"] > 0 and row["first"] > 0
    params = sum(p.numel() * p.element_size() for p in model.parameters())
    assert row["peak"] >= params  # the model's weights were live on the device
    text = registry.table([row])
    assert "| tiny | forward | defer |" in text


def test_unknown_names_are_refused():
    with pytest.raises(SystemExit, match="torchtpu.argument: unknown \\['nope'\\]"):
        registry.main(["--models", "nope"])


# The JAX ports of the Hugging Face rows (bench/jax_models.py) on tiny configs, weights drawn
# wide (std 0.5) so that every feature moves the loss: Gemma-3 with a sliding window shorter
# than the sequence, final logit soft-capping and padding tokens in the batch; Llama-3.2 with
# its llama3 RoPE scaling (dropping the scaling moves this loss by ~0.1).
@pytest.mark.parametrize("name,overrides", [
    ("gemma-3", dict(sliding_window=3, final_logit_softcapping=4.0)),
    ("llama-3.2", {}),
])
def test_jax_port_loss_equals_torch_cpu(name, overrides):
    jax = pytest.importorskip("jax")
    model = hf(name, hidden_size=32, intermediate_size=48, **overrides)()
    gen = torch.Generator().manual_seed(2)
    with torch.no_grad():
        for p in model.parameters():
            p.copy_(torch.randn(p.shape, generator=gen) * 0.5)
    x, y = tokens(HF_VOCAB, 8, 2)(gen)
    x[0, :3] = 0  # Gemma's padding_idx
    with torch.no_grad():
        expected = registry.hf_loss(model, x, y).item()
    params, loss = registry.jm.port(model)
    got = float(jax.jit(loss)(params, jax.numpy.asarray(x.numpy()), jax.numpy.asarray(y.numpy())))
    assert got == pytest.approx(expected, abs=1e-5)
