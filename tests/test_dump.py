"""TORCHTPU_DUMP: every program's StableHLO and optimized HLO, named after what built it."""

from __future__ import annotations

import os
import subprocess
import sys

_SCRIPT = """
import torch
x = torch.randn(8, 8, device="tpu")
y = (x @ x).sum()  # two op programs
f = torch.compile(lambda a: a.sin() * 2, backend="tpu")
f(x)               # one compiled graph
print(y.item())
"""


def _run(tmp_path, cache):
    env = {**os.environ, "TORCHTPU_DUMP": str(tmp_path / "dump"), "TORCHTPU_CACHE_DIR": cache}
    script = tmp_path / "user.py"
    script.write_text(_SCRIPT)
    run = subprocess.run([sys.executable, str(script)], env=env, capture_output=True,
                         text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return sorted((tmp_path / "dump").iterdir())


def test_each_program_is_dumped_by_name_also_from_the_cache(tmp_path):
    cache = str(tmp_path / "cache")
    files = _run(tmp_path, cache)
    names = [f.name for f in files]
    assert any("aten_mm" in n and n.endswith(".stablehlo.mlir") for n in names), names
    assert any("aten_sum" in n for n in names), names
    assert any("jit_compiled_inference" in n for n in names), names
    mm = next(f for f in files if "aten_mm" in f.name and f.name.endswith(".hlo.txt"))
    text = mm.read_text()
    assert text.startswith(f"// built at {tmp_path / 'user.py'}:4 on cpu")
    assert "HloModule" in text and " dot(" in text
    stablehlo = next(f for f in files if "aten_mm" in f.name and ".stablehlo" in f.name)
    assert "stablehlo.dot" in stablehlo.read_text()
    # a second process finds the programs in the persistent cache: dumped all the same
    for f in files:
        f.unlink()
    again = [f.name for f in _run(tmp_path, cache)]
    assert sorted(n.split("-", 1)[1] for n in again) == sorted(n.split("-", 1)[1] for n in names)


def test_unset_wraps_nothing():
    code = ("import torch, torchtpu; from jax._src import compiler; "
            "print(compiler.compile_or_get_cached.__module__)")
    env = {k: v for k, v in os.environ.items() if k != "TORCHTPU_DUMP"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=300, check=True).stdout.split()[-1]
    assert out == "jax._src.compiler"
