"""python -m torchtpu.tune: a bounded search over settings, one child process per trial, the best
setting with the command that reproduces it; bad input exits 2."""

from __future__ import annotations

import importlib.util
import json
import shlex
import subprocess
import sys

import pytest
import torch

from torchtpu.commands import ToolError
from torchtpu.tools import aot, aot_step
from torchtpu.tools import tune as tuner

_SCRIPT = """
import torch

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, (torch.randn(4, 8),)

def broken():
    return torch.nn.Linear(8, 4), (torch.randn(4, 5),)
"""


needs_libtpu = pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                                  reason="libtpu is not installed (pip install -e '.[tpu-aot]')")


@pytest.fixture
def script(tmp_path):
    path = tmp_path / "tiny.py"
    path.write_text(_SCRIPT)
    return path


def test_two_trials_in_children_and_the_best_with_its_command(script, monkeypatch):
    scores = iter([5.0, 2.0])  # the second trial (defer) is made the faster one

    real_child = tuner._child

    def child(target, setting, **kw):
        trial = real_child(target, setting, **kw)
        assert trial.error is None and trial.ms_per_step > 0, trial  # each ran and was timed
        trial.ms_per_step = next(scores)  # (host times under load decide nothing: fix them)
        return trial

    monkeypatch.setattr(tuner, "_child", child)
    r = tuner.tune(f"{script}:make", trials=2, budget=600, step="forward", steps=1, warmup=1)
    assert [t.setting["mode"] for t in r.trials] == ["strict", "defer"]
    assert r.best is r.trials[1] and r.best.setting == {**tuner.DEFAULT, "mode": "defer"}
    assert "--setting" in r.command and json.dumps(r.best.setting, sort_keys=True) in r.command
    assert r.code == ["torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE)"]
    assert len(r.loadavg) == 2 and "best: 2.000 ms/step" in tuner.format_report(r)


def test_the_search_moves_axis_by_axis_from_the_best(script, monkeypatch):
    times = {"strict": 9.0, "defer": 7.0, "compile": 3.0, "captured": 4.0, "buckets": 8.0}
    seen = []

    def child(target, setting, **kw):
        seen.append(dict(setting))
        bonus = 1.0 if setting["xla"] == "xla_optimization_level=O3" else 0.0
        return tuner.Trial(setting, times[setting["mode"]] - bonus, seconds=0.1)

    monkeypatch.setattr(tuner, "_child", child)
    r = tuner.tune(f"{script}:make", trials=7, step="forward")
    assert [s["mode"] for s in seen[:5]] == ["strict", "defer", "compile", "captured", "buckets"]
    assert all(s["mode"] == "compile" for s in seen[5:])  # the xla axis on top of the best
    assert r.best.setting == {"mode": "compile", "precision": "highest",
                              "xla": "xla_optimization_level=O3"}
    assert r.code[0] == "export TORCH_TPU_INTERNAL_XLA_OPTIONS=xla_optimization_level=O3"


def test_one_setting_in_process_matches_cpu_and_takes_xla_options(script):
    model = torch.nn.Linear(8, 4)
    trial = tuner.run_setting(model, (torch.randn(2, 8),),
                              {"mode": "compile", "xla": "xla_optimization_level=O1"},
                              step="forward", steps=1, warmup=1)
    assert trial.ms_per_step > 0 and trial.setting["precision"] == "highest"
    with pytest.raises(ToolError, match="unknown setting axes"):
        tuner.check_setting({"speed": "max"})
    with pytest.raises(ToolError, match="mode 'fast' is not one of"):
        tuner.check_setting({"mode": "fast"})


def test_a_trial_past_its_timeout_is_killed(script):
    t = tuner._child(f"{script}:make", dict(tuner.DEFAULT), step="forward", steps=1, warmup=1,
                     topology=None, timeout=0.5)
    assert t.ms_per_step is None and t.error == "timed out after 0.5 s"


@pytest.mark.parametrize("argv, words", [
    (["{script}:broken", "--trials", "2"], "the model fails on CPU"),
    (["{script}:nothing"], "has no function 'nothing'"),
    (["{script}:make", "--trials", "0"], "--trials 0"),
    (["{script}:make", "--setting", "{bad"], "--setting is not JSON"),
    (["{script}:make", "--topology", "v9z:1x1"], "v9z"),
    (["{script}:make", "--setting", '{"xla": "xla_optimization_level=O7"}'], "O7"),
])
def test_bad_input_exits_2_with_a_tool_error(script, capsys, argv, words):
    assert tuner.main([a.replace("{script}", str(script)) for a in argv]) == 2
    err = capsys.readouterr().err
    assert err.startswith("torchtpu.tool: ") and words in err, err


def test_the_mcp_tool_reports_bad_input_as_an_error(tmp_path):
    from torchtpu.tools import mcp_server

    r = mcp_server._guarded(mcp_server._tune_target, f"{tmp_path}/missing.py:make", 2, 60.0,
                            "train", None)
    assert r["ok"] is False and r["error"].startswith("torchtpu.tool: ") and "missing.py" in \
        r["error"]


@needs_libtpu
def test_on_a_tpu_target_each_trial_is_the_cost_models_time_and_reproduces(script, capsys):
    """--topology: each trial (a child) compiles the step for a v5e chip and reports the cost
    model's time, no host time; the best one's command, run again, gives the same figure."""
    assert tuner.main([f"{script}:make", "--topology", "v5e:2x2", "--trials", "2", "--step",
                       "forward", "--steps", "1", "--warmup", "1", "--json"]) == 0
    r = json.loads(capsys.readouterr().out)
    assert [t["setting"]["mode"] for t in r["trials"]] == ["strict", "defer"]
    for t in r["trials"]:  # (a deferred forward whose output nobody reads would run nothing: 0)
        assert t["error"] is None and t["ms_per_step"] is None and t["cost_model_ms"] > 0, t
    best = min(r["trials"], key=lambda t: t["cost_model_ms"])
    assert r["best"] == best and "--topology v5e:2x2" in r["command"]
    again = subprocess.run([sys.executable, *shlex.split(r["command"])[1:], "--json"],
                           capture_output=True, text=True, timeout=300)
    assert again.returncode == 0, again.stderr[-2000:]
    assert json.loads(again.stdout.splitlines()[-1])["cost_model_ms"] == best["cost_model_ms"]


def test_a_step_the_cost_model_cannot_time_is_a_failed_trial_naming_its_programs(monkeypatch):
    """A cost model's step time with programs left out would flatter the setting: none."""
    from torchtpu.targets.tpu_target import Report

    def report(seconds, runs=3):
        step = aot_step.Step(seconds=seconds, flops=1.0, mfu=None, hbm_peak_bytes=1,
                             hbm_capacity_bytes=2, fits=True, peak_flops=1.0, chip="c",
                             programs_run=runs)
        programs = [Report("jit_timed", "op", "v5e:2x2", compiles=True, seconds=1e-6),
                    Report("jit_aten__foreach_mul_Scalar", "op", "v5e:2x2", compiles=True)]
        return lambda *a, **k: aot_step.AotReport("v5e:2x2", "strict", "train", 1, programs, step)

    model, inputs = torch.nn.Linear(2, 2), (torch.randn(1, 2),)
    monkeypatch.setattr(aot, "report", report(None))
    with pytest.raises(ToolError, match=r"no time for jit_aten__foreach_mul_Scalar, so"):
        tuner.run_setting(model, inputs, {}, topology="v5e:2x2")
    monkeypatch.setattr(aot, "report", report(2e-6, runs=0))
    with pytest.raises(ToolError, match="ran no program"):
        tuner.run_setting(model, inputs, {}, topology="v5e:2x2")
    monkeypatch.setattr(aot, "report", report(2e-6))
    trial = tuner.run_setting(model, inputs, {}, topology="v5e:2x2")
    assert trial.cost_model_ms == pytest.approx(2e-3) and trial.ms_per_step is None
    shown = tuner.format_report(tuner.TuneReport("t.py:make", "train", "v5e:2x2", [trial],
                                                 trial, "python -m torchtpu.tune ..."))
    assert "cost-model ms/step" in shown and "best: 0.002 cost-model ms/step" in shown
