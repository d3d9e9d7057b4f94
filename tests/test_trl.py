"""TRL 1.16 on tpu: ``GRPOTrainer`` with Transformers' generate (``use_vllm=False``).

A tiny Llama from a config and a byte-level tokenizer (``torchtpu/testing/grpo.py``): three GRPO
steps on tpu give the rewards of the same run on CPU exactly (greedy generation, a deterministic
reward), and its losses and gradient norms and trained weights to float32 rounding; on tpu,
TRL's ``pad_to_multiple_of="auto"`` pads to 16 (``integrations/trl.py``), so the steps after the
first, whose prompts have other lengths, reuse the first's programs (each builds or loads under a
tenth of the first step's). Each run is a fresh process: Accelerate keeps one device per process.
Needs ``pip install -e '.[rl]'``.
"""

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[rl]'")

STEPS = 3


def _grpo(device: str, folder) -> dict:
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    proc = subprocess.run([sys.executable, "-m", "torchtpu.testing.grpo", device, str(STEPS),
                           str(folder)], env=env, capture_output=True, text=True, timeout=600)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("GRPO_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("GRPO_RESULT "):])


def test_auto_padding_is_16_on_tpu_only():
    from trl import GRPOConfig

    def pad(**kw):
        return GRPOConfig(output_dir="unused", report_to="none", **kw).pad_to_multiple_of

    assert pad() == 16
    assert pad(use_cpu=True) is None
    assert pad(pad_to_multiple_of=None) is None and pad(pad_to_multiple_of=64) == 64


def test_grpo_on_tpu_matches_cpu(tmp_path):
    cpu = _grpo("cpu", tmp_path)
    tpu = _grpo("tpu", tmp_path)  # the same tiny model, written by the CPU run
    assert cpu["device"] == "cpu" and tpu["device"].startswith("tpu")
    assert len(tpu["steps"]) == len(cpu["steps"]) == STEPS
    for got, want in zip(tpu["steps"], cpu["steps"]):
        assert got["reward"] == want["reward"]
        assert got["loss"] == pytest.approx(want["loss"], abs=1e-6)
        assert got["grad_norm"] == pytest.approx(want["grad_norm"], rel=1e-5)
        assert want["grad_norm"] > 1  # the policy does learn
    for name, want in cpu["weights"].items():
        assert tpu["weights"][name] == pytest.approx(want, rel=1e-4, abs=1e-5), name
    programs = [t["programs"] for t in tpu["timings"]]
    assert all(n <= programs[0] / 10 for n in programs[1:]), programs


def test_grpo_defers_only_with_vllm_colocated_on_tpu_in_strict(monkeypatch):
    # (the run itself: tests/test_trl_vllm.py, whose steps report the mode they ran in)
    from types import SimpleNamespace

    import torch
    from trl import GRPOTrainer

    from torchtpu.integrations.trl import defers

    def trainer(device="tpu", use_vllm=True, mode="colocate"):
        return SimpleNamespace(accelerator=SimpleNamespace(device=torch.device(device)),
                               use_vllm=use_vllm, vllm_mode=mode)

    assert getattr(GRPOTrainer.train, "_torchtpu", False)  # the hook wrapped it at import
    assert defers(trainer())
    assert not defers(trainer("cpu"))
    assert not defers(trainer(use_vllm=False))  # generate's decode loop stays Strict
    assert not defers(trainer(mode="server"))
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        assert not defers(trainer())  # a mode the user chose is left alone
    monkeypatch.setenv("TORCHTPU_TRL_DEFER", "0")
    assert not defers(trainer())
