"""What a user sees when an op fails: CPU's traceback, frame for frame, and CPU's one message.

A child process makes each bad call on CPU and then on tpu and prints both tracebacks as Python
prints an uncaught error; by default the tpu one names the same frames (the user's, and
torch.nn.functional's where CPU's does), no torchtpu frame, and has no "During handling of the
above exception" chain. With TORCHTPU_DEBUG=1 torchtpu's frames are shown.
"""

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

CHILD = '''
import sys, traceback
import torch
import torch.nn.functional as F
import torchtpu
from torchtpu.device import asserts

def mm_shapes(d):
    return torch.mm(torch.ones(3, 4, device=d), torch.ones(5, 6, device=d))

def mm_dtypes(d):
    return torch.mm(torch.ones(3, 3, device=d), torch.ones(3, 3, dtype=torch.long, device=d))

def gelu_long(d):
    return F.gelu(torch.arange(4, device=d))

def target_out_of_bounds(d):
    return F.cross_entropy(torch.ones(2, 3, device=d), torch.tensor([0, 3], device=d))

def to_channels_last_1d(d):
    # ``Tensor.to``'s kernel (``kernels._replayed``, which trims its errors itself).
    return torch.ones(3, device=d).to(torch.float16, memory_format=torch.channels_last)

def strict_on_a_tpu(d):
    # A check of values the device runs, raised at the next host read (Strict on a TPU).
    asserts._host_reads_stall = lambda: True
    return F.embedding(torch.tensor([1, 12], device=d), torch.ones(10, 4, device=d)).cpu()

for case in sys.argv[1:]:
    for d in ("cpu", "tpu"):
        try:
            globals()[case](d)
        except Exception:
            print(f"=== {case} {d}")
            traceback.print_exc(file=sys.stdout)
'''

CASES = ["mm_shapes", "mm_dtypes", "gelu_long", "target_out_of_bounds", "to_channels_last_1d",
         "strict_on_a_tpu"]


def _run(tmp_path: Path, debug: bool) -> dict:
    script = tmp_path / "child.py"
    script.write_text(CHILD)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    env.pop("TORCHTPU_DEBUG", None)
    if debug:
        env["TORCHTPU_DEBUG"] = "1"
    done = subprocess.run([sys.executable, str(script), *CASES], capture_output=True, text=True,
                          env=env, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    blocks = {}
    for block in done.stdout.split("=== ")[1:]:
        head, _, text = block.partition("\n")
        blocks[tuple(head.split())] = text
    return blocks


def _frames(text: str) -> list:
    return re.findall(r'^  File "([^"]+)", line \d+, in (\S+)$', text, re.MULTILINE)


def _torchtpu_frames(text: str) -> list:
    package = str(ROOT / "torchtpu") + os.sep
    return [f for f in _frames(text) if f[0].startswith(package)]


@pytest.fixture(scope="module")
def by_default(tmp_path_factory):
    return _run(tmp_path_factory.mktemp("tracebacks"), debug=False)


@pytest.mark.parametrize("case", CASES)
def test_a_failed_call_shows_cpus_traceback(by_default, case):
    tpu = by_default[(case, "tpu")]
    assert "During handling" not in tpu and "direct cause" not in tpu, tpu
    assert _torchtpu_frames(tpu) == [], tpu
    if case == "strict_on_a_tpu":  # CPU's check raises at the call, the device's at the read
        assert tpu.rstrip().splitlines()[-2].startswith(
            "IndexError: torchtpu.check: aten.embedding.default: index 12 is out of bounds"), tpu
        return
    cpu = by_default[(case, "cpu")]
    assert _frames(tpu) == _frames(cpu), tpu
    # One message, CPU's, as the last line.
    assert tpu.rstrip().splitlines()[-1] == cpu.rstrip().splitlines()[-1], tpu
    assert "Traceback" not in tpu.split("Traceback", 1)[1], tpu


def test_torchtpu_debug_shows_torchtpus_frames(tmp_path):
    debug = _run(tmp_path, debug=True)
    for case in CASES:
        assert _torchtpu_frames(debug[(case, "tpu")]), debug[(case, "tpu")]
    # CPU's error, caused by the one torchtpu met first.
    mm = debug[("mm_shapes", "tpu")]
    assert "direct cause" in mm and "must have same reduction dim" in mm, mm
    assert mm.rstrip().splitlines()[-1] == debug[("mm_shapes", "cpu")].rstrip().splitlines()[-1]
