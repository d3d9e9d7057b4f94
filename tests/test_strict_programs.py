"""``bench/strict_breakdown.py --programs``, the tool that found Strict's byte-array products:
each distinct program of a Strict Llama step compiled for v5e on its own, costed, its HLO
written. Needs libtpu (CI's tpu stage); the target is one per process, so it runs as one."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]')")
def test_every_program_of_a_strict_step_is_costed_for_v5e(tmp_path):
    env = dict(os.environ, TORCHTPU_TPU_TARGET="v5e:1x1", TORCHTPU_NOTICES="0",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "strict_breakdown.py"), "--small",
         "--layers", "1", "--programs", str(tmp_path), "--json", str(tmp_path / "out.json")],
        env=env, capture_output=True, text=True, timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    out = json.loads((tmp_path / "out.json").read_text())
    rows = json.loads((tmp_path / "programs.json").read_text())
    assert len(rows) == out["distinct_programs"]
    assert all(r["compiles"] and r["us"] is not None and r["moved"] > 0 for r in rows)
    assert sum("aten.mm" in r["program"] for r in rows) >= 6
    assert len(list(tmp_path.glob("*.hlo.txt"))) == len(rows)
    assert out["programs_top"] == rows[:15]
