"""python -m torchtpu.tune: a bounded search over settings, one child process per trial, the best
setting with the command that reproduces it; bad input exits 2."""

from __future__ import annotations

import json

import pytest
import torch

from torchtpu.tools import tune as tuner
from torchtpu.tools.target import ToolError

_SCRIPT = """
import torch

def make():
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, (torch.randn(4, 8),)

def broken():
    return torch.nn.Linear(8, 4), (torch.randn(4, 5),)
"""


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
