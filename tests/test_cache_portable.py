"""A compile cache that moves still hits: the directory copied to another path (a copied volume,
another mount point, another user's home) and read by a copy of the checkout at another path
(another checkout of the same torchtpu): every program comes from the cache, none is compiled,
found by torchtpu's keys, or by JAX's where a directory others can write keeps to those.

Keys hold no path: JAX's leave the StableHLO's locations out, torchtpu's name the source by
relative paths, and the directory's own path stays out of XLA's compile options
(``compile_cache.enable``)."""

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

_ROOT = Path(__file__).resolve().parent.parent

_CHILD = r"""
import json, torch, torchtpu
from torchtpu import metrics
torch.manual_seed(0)
model = torch.nn.Sequential(torch.nn.Linear(6, 16), torch.nn.Tanh(), torch.nn.Linear(16, 3))
x = torch.randn(5, 6)
eager = model.to("tpu")(x.to("tpu")).sum().item()       # per-op programs
static = x.to("tpu")
g = torch.tpu.TPUGraph()
with torch.tpu.graph(g):
    out = (model(static) * 2).sum()
g.replay()                                              # a captured program: torchtpu's key
m = metrics.snapshot()
print("RESULT " + json.dumps({"torchtpu": torchtpu.__file__, "values": [eager, out.item()],
                              "compiles": m["executable_compiles"],
                              "hits": m["persistent_cache_hits"],
                              "by_key": m.get("programs_loaded_by_key", 0)}))
"""


def _checkout(at: Path) -> Path:
    shutil.copytree(_ROOT / "torchtpu", at / "torchtpu",
                    ignore=shutil.ignore_patterns("__pycache__"))
    return at


def _run(checkout: Path, cache: Path, script: str = _CHILD) -> dict:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(cache), "PYTHONPATH": str(checkout)}
    env.pop("TORCHINDUCTOR_CACHE_DIR", None)
    proc = subprocess.run([sys.executable, "-c", script], env=env, cwd=checkout,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.split("RESULT ")[-1])
    assert found["torchtpu"].startswith(str(checkout)), found  # the copy's torchtpu ran
    return found


def test_a_copied_cache_read_by_another_checkout_hits_every_program(tmp_path):
    first = _checkout(tmp_path / "first")
    cold = _run(first, first / "cache")
    assert cold["compiles"] > 0 and cold["by_key"] == 0
    second = tmp_path / "elsewhere" / "second"
    shutil.copytree(first, second, symlinks=True)
    moved = _run(second, second / "cache")
    # Every program by torchtpu's key: the per-op ones (warm_dispatch) and the captured one.
    assert moved["compiles"] == moved["hits"] == 0 and moved["by_key"] == cold["compiles"], moved
    assert moved["values"] == cold["values"]
    # JAX's own keys: a directory others can write keeps to them (traced, then found).
    third = tmp_path / "shared" / "third"
    shutil.copytree(first, third, symlinks=True)
    (third / "cache").chmod(0o777)
    shared = _run(third, third / "cache")
    assert shared["compiles"] == shared["by_key"] == 0 and shared["hits"] == cold["compiles"]
    assert shared["values"] == cold["values"]


@pytest.mark.full  # two processes that import Dynamo and compile: ~20 s of CPU
def test_dynamo_graphs_of_a_moved_cache_and_checkout_are_loaded_untraced(tmp_path):
    """PyTorch's precompiled Dynamo graphs (test_warm_start's child) from a copied cache, run by
    a copied checkout: nothing is traced, both graphs are loaded."""
    first = _checkout(tmp_path / "first")
    (first / "tests").mkdir()
    shutil.copy(_ROOT / "tests" / "test_warm_start.py", first / "tests")
    script = """
import contextlib, io, json, runpy, sys, torchtpu
sys.argv[1:], out = ["precompile"], io.StringIO()
with contextlib.redirect_stdout(out):
    runpy.run_path("tests/test_warm_start.py", run_name="__main__")
found = {**json.loads(out.getvalue().splitlines()[-1]), "torchtpu": torchtpu.__file__}
print("RESULT " + json.dumps(found))
"""
    cold = _run(first, first / "cache", script)
    second = tmp_path / "elsewhere" / "second"
    shutil.copytree(first, second, symlinks=True)
    moved = _run(second, second / "cache", script)
    assert cold["aot_traced"] >= 1 and cold["loaded"] == 0
    assert moved["precompiled"] == 1 and moved["dynamo_graphs"] == 0, moved
    assert moved["aot_traced"] == 0 and moved["loaded"] == 2, moved
    assert moved["tpu"] == cold["tpu"]
