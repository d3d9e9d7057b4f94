"""OpInfo samples through the TPU target (torchtpu/testing/tpu_opinfo.py): programs sorted into
lowering families, the TPU's refusals kept apart from host-lowered programs (a host-only call in
the host's StableHLO, which says nothing of the TPU). The sorting runs everywhere; the compile
needs libtpu and runs in a subprocess (one target per process)."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import pytest

from torchtpu import settings
from torchtpu.targets import tpu_target
from torchtpu.testing import tpu_opinfo


def _report(name, compiles, error=None):
    return tpu_target.Report(name=name, kind="op", target="v5e:2x2", compiles=compiles,
                             error=error)


def test_programs_sort_into_lowering_families_and_refusals_are_told_apart():
    families = tpu_opinfo.program_families()
    assert families["jit_aten_mm_default"] == "linalg"
    assert families["jit_aten_add_Tensor"] == "elementwise"
    out = tpu_opinfo.classify([
        _report("jit_aten_add_Tensor", True),
        _report("jit_aten_add_Tensor", False, "Bad lhs type"),
        _report("jit_aten_linalg_cholesky_ex_default", False,
                "custom call lapack_spotrf_ffi (the program was lowered for the host, ...)"),
        _report("jit_read_view", True),
    ], families)
    add, chol, other = out["elementwise"], out[families["jit_aten_linalg_cholesky_ex_default"]], \
        out["executor"]
    assert (add.programs, add.compiles, add.host_lowered, add.rate) == (2, 1, 0, 0.5)
    assert add.refused == [{"op": "aten_add_Tensor", "error": "Bad lhs type"}]
    assert (chol.programs, chol.host_lowered, chol.refused, chol.rate) == (1, 1, [], 1.0)
    assert (other.programs, other.compiles) == (1, 1)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]')")
def test_opinfo_samples_compile_for_v5e(tmp_path):
    out_file = tmp_path / "out.json"
    env = {k: v for k, v in os.environ.items() if k != settings.TPU_TARGET.name}
    proc = subprocess.run(
        [sys.executable, "-m", "torchtpu.testing.tpu_opinfo", "--ops", "mul|sum|linalg.cholesky",
         "--topology", "v5e:2x2", "--json", str(out_file)],
        capture_output=True, text=True, timeout=900, env=env)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    out = json.loads(out_file.read_text())
    fams = out["families"]
    assert fams["elementwise"]["compiles"] >= 1 and fams["reduction"]["compiles"] >= 1, out
    assert out["host_lowered"] >= 1 and out["rate"] == 1.0, out  # cholesky: LAPACK on the host
