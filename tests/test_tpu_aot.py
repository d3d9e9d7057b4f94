"""``python -m torchtpu.aot`` (tools/aot.py), the check users run before they rent a TPU: its
JSON estimate of a step, its refusals of bad input without a traceback, and a sharded Llama step
compiled for each chip of a target, training as on CPU. Each run is a subprocess (a target is one
per process) and needs libtpu (the ``tpu-aot`` extra): skipped without it; CI's ``tpu`` stage runs
them.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest
import torch

from torchtpu.targets import tpu_target

needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu-aot]')")


_MLP = """\
    import torch
    def make():
        torch.manual_seed(0)
        model = torch.nn.Sequential(torch.nn.Linear(256, 512), torch.nn.GELU(),
                                    torch.nn.Linear(512, 256))
        return model, (torch.randn(64, 256),)
    def broken():
        return torch.nn.Linear(4, 4), (torch.randn(3, 5),)
"""
_FORWARD_FLOPS = 2 * 64 * 256 * 512 * 2


def _aot(tmp_path, *args, script: str = _MLP, timeout: float = 600):
    (tmp_path / "model.py").write_text(textwrap.dedent(script))
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(tmp_path / "cache")}
    env.pop(tpu_target.ENV, None)
    run = subprocess.run([sys.executable, "-m", "torchtpu.aot", *args], capture_output=True,
                         text=True, env=env, timeout=timeout, cwd=tmp_path)
    return run


@needs_libtpu
@pytest.mark.parametrize("mode,step", [("compile", "train"), ("strict", "forward"),
                                       ("captured", "forward")])
def test_aot_json_estimates_the_step(tmp_path, mode, step):
    run = _aot(tmp_path, "--topology", "v5e:2x2", "--json", "--mode", mode, "--step", step,
               "model.py:make")
    assert run.returncode == 0, run.stderr
    out = json.loads(run.stdout)
    assert out["topology"] == "v5e:2x2" and out["ok"]
    assert all(p["compiles"] and {"name", "kind", "hbm_bytes", "flops", "bytes_accessed",
                                  "seconds"} <= set(p) for p in out["programs"])
    s = out["step"]
    # Forward: two matmuls; train: forward, two weight grads and one input grad (5/2 of it).
    expected = _FORWARD_FLOPS * (2.5 if step == "train" else 1)
    assert expected <= s["flops"] <= expected * 1.1
    assert s["seconds"] > 0 and 0 < s["mfu"] < 1 and s["fits"]
    assert s["hbm_capacity_bytes"] == 16 << 30 and s["hbm_peak_bytes"] > 4 * 256 * 512 * 2
    # Strict: the first Linear's program, then GELU held (a pointwise one-tensor op) and run inside
    # the second Linear's program; more than one program either way.
    assert s["unknown_runs"] == 0 and s["programs_run"] >= (2 if mode == "strict" else 1)
    if mode == "strict":
        assert any(p["kind"] == "op" for p in out["programs"])
    if step == "train":
        # Parameters, AdamW's two moments, the input: gradients are no state of the step
        # (zero_grad sets them to None), so they are no arguments of its program.
        params = (256 * 512 + 512 + 512 * 256 + 256) * 4
        biggest = max(out["programs"], key=lambda p: p["hbm"].get("arguments", 0))
        assert 3 * params <= biggest["hbm"]["arguments"] < 3.5 * params


@needs_libtpu
@pytest.mark.parametrize("args,message", [
    (["--topology", "v9:9x9", "model.py:make"], "'v9:9x9' is not a TPU topology"),
    (["--topology", "v5e:2x2", "--world", "8", "model.py:make"], "v5e:2x2 has 4 chips"),
    (["--topology", "v5e:2x2", "model.py:broken"], "the model fails on CPU"),
])
def test_aot_bad_input_exits_2_without_a_traceback(tmp_path, args, message):
    run = _aot(tmp_path, *args)
    assert run.returncode == 2 and message in run.stderr, run.stderr
    assert "Traceback" not in run.stderr


# The registry's Llama-3.2 row (bench/registry.py) with its loss: the output is the batch mean.
_LLAMA = f"""\
    import importlib.util
    import sys

    import torch
    import torch.nn.functional as F
    from torch import nn

    spec = importlib.util.spec_from_file_location(
        "bench_registry", {os.path.join(os.path.dirname(__file__), "..", "bench", "registry.py")!r})
    registry = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = registry  # its dataclasses look their module up
    spec.loader.exec_module(registry)


    class CausalLM(nn.Module):
        def __init__(self, inner):
            super().__init__()
            self.inner = inner

        def forward(self, x, y):
            return F.cross_entropy(self.inner(input_ids=x).logits.flatten(0, 1), y.flatten())


    def make():
        lm = CausalLM(registry.hf("llama-3.2")())
        draw = registry.tokens(registry.HF_VOCAB, registry.HF_SEQ, registry.HF_BATCH)
        return lm, draw(torch.Generator().manual_seed(0))
"""


def _cpu_losses(tmp_path, steps: int) -> list:
    """The unsharded CPU model's losses over steps of the tool's AdamW, on the full batch."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("aot_llama", tmp_path / "model.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    model, inputs = module.make()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    losses = []
    for _ in range(steps):
        loss = model(*inputs)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        losses.append(loss.item())
    return losses


@needs_libtpu
# The 2 x 2 case (FSDP2 x TP): 23 min at load ~45 (bench/RESULTS.md, issue 19 session 15).
@pytest.mark.parametrize("world,tp", [(2, 1), pytest.param(4, 2, marks=pytest.mark.full)])
def test_aot_sharded_llama_step_compiles_for_each_chip_and_trains_as_on_cpu(tmp_path, world, tp):
    """FSDP over 2 ranks (simple_fsdp) and FSDP2 x TP on 2 x 2, each rank's compiled step for
    its chip of v5e:2x2: every program compiles (those with collectives over the ranks' chips),
    the step has a cost-model time and fits, and the losses are the CPU model's."""
    run = _aot(tmp_path, "--topology", "v5e:2x2", "--json", "--step", "train",
               "--world", str(world), "--tp", str(tp), "model.py:make", script=_LLAMA,
               timeout=2400)
    assert run.returncode == 0, run.stderr[-3000:]
    (tmp_path / "report.json").write_text(run.stdout)  # kept for a look at the figures
    out = json.loads(run.stdout)
    assert (out["world"], out["tp"], out["ok"]) == (world, tp, True), out["ranks"]
    assert len(out["ranks"]) == world
    for rank in out["ranks"]:
        assert rank["refused"] == 0 and rank["programs"] > 0, rank
        # The programs with collectives over a group of 2 ranks (FSDP's, TP's) compiled over
        # 2 chips, the others over 1.
        assert set(rank["devices"]) == {"1", "2"}, rank
    s = out["step"]
    assert s["seconds"] > 0 and s["flops"] > 0 and s["fits"] and s["unknown_runs"] == 0
    torch.testing.assert_close(out["losses"], _cpu_losses(tmp_path, len(out["losses"])),
                               atol=1e-4, rtol=1e-4)
