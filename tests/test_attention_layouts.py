"""An attention block's products and SDPA, as the lowering table lowers them for a TPU, compile
to no more layout copies than the JAX twin's form (bench/attention_layouts.py, compile-only for
v5e). Needs libtpu (CI's tpu stage); the target is one per process, so each runs as one."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


def _block(tmp_path, products: str) -> dict:
    env = dict(os.environ, TORCHTPU_NOTICES="0",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / f"{products}.json"
    done = subprocess.run(
        [sys.executable, os.path.join(ROOT, "bench", "attention_layouts.py"), "--products",
         products, "--json", str(out)], env=env, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return json.loads(out.read_text())


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]')")
def test_half_precision_products_keep_attention_copies_at_the_twins_count(tmp_path):
    table, bf16 = _block(tmp_path, "table"), _block(tmp_path, "bf16")
    # The JAX twin's form (f32 accumulation, then bf16) compiles to 10 copies on v5e: q, k, v
    # into the kernel, its output out of it and their gradients, plus two of the kernel's lse.
    assert table["copies"] <= 10, table
    assert bf16["copies"] > table["copies"] and bf16["mcycles"] > table["mcycles"], (table, bf16)
