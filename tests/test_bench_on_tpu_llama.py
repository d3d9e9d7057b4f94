"""bench/on_tpu_llama.py (the chip suite's Llama row) times the loop users write: the loss read on
the host after every step (``--read-every 1``, the default) or every Nth, in the torch modes and
the JAX twins alike, each round a whole number of reads; and ``torchtpu.testing.memory_floor``,
the PyTorch eager floor its rows are set against, counts on fake tensors what CPU eager saves."""

import importlib.util
import json
import math
import os

import jax
import pytest
import torch
from jax._src.array import ArrayImpl

from torchtpu.testing.llama import Llama, LlamaConfig
from torchtpu.testing.memory_floor import eager_floor

_PATH = os.path.join(os.path.dirname(__file__), os.pardir, "bench", "on_tpu_llama.py")
_spec = importlib.util.spec_from_file_location("bench_on_tpu_llama", _PATH)
on_tpu_llama = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(on_tpu_llama)


@pytest.mark.parametrize(("read_every", "steps", "per_round"), [(1, 5, 5), (4, 5, 8), (3, 3, 3)])
def test_timed_rounds_read_every_nth_step_and_end_each_round_on_a_read(read_every, steps,
                                                                       per_round):
    events = []

    def run_step():
        events.append("step")
        return len(events)

    out = on_tpu_llama._timed_rounds(run_step, lambda x: events.append("read"), steps, 2, 60.0,
                                     read_every)
    one_round = (["step"] * read_every + ["read"]) * (per_round // read_every)
    assert events == one_round * 2
    assert out["steps_per_round"] == per_round and out["reads"] == 2 * per_round // read_every
    assert len(out["rounds_ms"]) == len(out["issue_ms"]) == len(out["read_ms"]) == 2
    assert all(t >= i + r for t, i, r in zip(out["rounds_ms"], out["issue_ms"], out["read_ms"]))


def _tiny(layers: int = 2) -> LlamaConfig:
    return LlamaConfig(**on_tpu_llama.TINY, layers=layers, seq=64)


def test_the_floor_on_fake_tensors_is_what_cpu_eager_saves():
    c = _tiny()

    def inputs():
        g = torch.Generator().manual_seed(1)
        return (torch.randint(c.vocab, (4, c.seq), generator=g),
                torch.randint(c.vocab, (4, c.seq), generator=g))

    fake = eager_floor(lambda: Llama(c), inputs)
    real = eager_floor(lambda: Llama(c), inputs, fake=False)
    assert fake == real
    n = sum(p.numel() for p in Llama(c).parameters())
    assert fake.parameter_count == n
    assert (fake.parameters, fake.gradients, fake.moments) == (4 * n, 4 * n, 8 * n)
    # At least each block's bf16 MLP activations (gate, up, their product) and the f32
    # log-softmax over the vocabulary.
    assert fake.saved > c.layers * 3 * 4 * c.seq * c.hidden * 2 + 4 * c.seq * c.vocab * 4
    assert fake.total == fake.parameters + fake.gradients + fake.moments + fake.saved
    # Twice the batch saves twice the activations, but once each weight's bf16 cast (autocast's
    # cache: one per forward) and each block's bf16 rotary tables (and a scalar or so).
    twice = eager_floor(lambda: Llama(c), lambda: tuple(torch.cat([t, t]) for t in inputs()))
    model = Llama(c)
    casts = sum(m.weight.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.Linear))
    tables = c.layers * 2 * c.seq * c.head_dim * 2
    assert 0 <= 2 * fake.saved - twice.saved - casts - tables <= 16


def test_the_issue50_config_is_450m_with_head_dim_128():
    c = LlamaConfig(**on_tpu_llama.CONFIGS["issue50"])
    assert c.head_dim == 128
    with torch.device("meta"):
        n = sum(p.numel() for p in Llama(c).parameters())
    assert 420e6 < n < 480e6, n
    # The JAX twin's parameters for the same config: the same count.
    twin = on_tpu_llama.tpu_llama.shapes(on_tpu_llama.tpu_llama.config(
        **on_tpu_llama.CONFIGS["issue50"]))
    leaves = jax.tree.leaves(twin, is_leaf=lambda s: isinstance(s, tuple))
    assert sum(math.prod(s) for s in leaves) == n


@pytest.mark.parametrize("read_every", [1, 4])
def test_every_mode_reads_the_loss_every_nth_step(read_every, tmp_path, monkeypatch):
    """The JAX twin's reads counted at ``float`` on its arrays, the torch mode's as the bytes
    torchtpu sent to the host per timed step (the f32 loss: 4 bytes a read)."""
    floats = []
    real_float = ArrayImpl.__float__

    def counted(self):
        floats.append(self.shape)
        return real_float(self)

    monkeypatch.setattr(ArrayImpl, "__float__", counted)
    path = tmp_path / "rows.json"
    rows = on_tpu_llama.main(["--tiny", "--layers", "1", "--tokens", "128", "--lengths", "32",
                              "--modes", "jax,defer", "--steps", "2", "--rounds", "2",
                              "--read-every", str(read_every), "--json", str(path)])
    assert [r["mode"] for r in rows] == ["jax", "defer"]
    assert not [r["error"] for r in rows if "error" in r]
    per_round = max(2, read_every)
    for r in rows:
        assert (r["read_every"], r["steps_per_round"]) == (read_every, per_round)
        assert r["config"] == "suite" and r["floor_gib"]["total"] > 0 and r["peak_over_floor"] >= 0
    jax_row, defer_row = rows
    # The twin: 3 warm-up steps read, then every Nth step of its rounds.
    assert len(floats) == 3 + len(jax_row["rounds_ms"]) * per_round // read_every
    assert defer_row["per_step"]["device_to_host_bytes"] == 4 / read_every
    assert json.loads(path.read_text())[1]["read_every"] == read_every
