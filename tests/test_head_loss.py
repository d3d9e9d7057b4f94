"""The Llama row's head and loss, as the lowering table lowers them for a TPU, compile to fewer
estimated cycles than the JAX twin's form (bench/head_loss.py, compile-only for v5e at the real
widths): the NLL's pick is a masked sum, which the TPU compiler fuses with the log-softmax and
the backward's one-hot sum. Needs libtpu (CI's tpu stage); one target per process."""

import importlib.util
import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.join(os.path.dirname(__file__), os.pardir)


@pytest.mark.skipif(importlib.util.find_spec("libtpu") is None,
                    reason="libtpu is not installed (pip install -e '.[tpu-aot]')")
def test_head_and_loss_take_fewer_cycles_than_the_twins(tmp_path):
    env = dict(os.environ, TORCHTPU_NOTICES="0",
               PYTHONPATH=os.pathsep.join([ROOT, os.environ.get("PYTHONPATH", "")]))
    out = tmp_path / "head_loss.json"
    done = subprocess.run([sys.executable, os.path.join(ROOT, "bench", "head_loss.py"),
                           "--json", str(out)], env=env, capture_output=True, text=True,
                          timeout=900)
    assert done.returncode == 0, done.stderr[-3000:]
    sides = json.loads(out.read_text())
    # 27.8 M against the twin's 30.4 M (loss1: the sums counted multi-output fusions, the
    # products among them, from then on; 13.8 against 20.2 without them). The gather's form
    # costs the twin's.
    assert sides["table"]["mcycles"] < 0.95 * sides["twin"]["mcycles"], sides
