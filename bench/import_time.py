"""What ``import torch`` costs with torchtpu installed, and its first tpu op (issue 37).

Each round runs, in fresh interpreters and interleaved (so load drifts hit all alike): ``import
torch`` without torchtpu (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``), ``import torch`` with it, and
``import torch`` + a first tpu op (``torch.ones(3, device="tpu") + 1``, with its compiles from a
warm persistent cache). Prints one JSON line: the median seconds of each, and the added import
time. ``python bench/import_time.py [rounds]`` (default 7); record ``cat /proc/loadavg``.
"""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time

CASES = {
    "torch_alone": ("import torch", {"TORCH_DEVICE_BACKEND_AUTOLOAD": "0"}),
    "torch_with_torchtpu": ("import torch", {}),
    "first_op": ("import torch; (torch.ones(3, device='tpu') + 1).sum().item()", {}),
}


def _seconds(code: str, env: dict) -> float:
    start = time.perf_counter()
    subprocess.run([sys.executable, "-c", code], check=True, env={**os.environ, **env},
                   capture_output=True)
    return time.perf_counter() - start


def main() -> None:
    rounds = int(sys.argv[1]) if len(sys.argv) > 1 else 7
    _seconds(*CASES["first_op"])  # fills the compile cache: first ops below read it
    times: dict = {name: [] for name in CASES}
    for _ in range(rounds):
        for name, (code, env) in CASES.items():
            times[name].append(_seconds(code, env))
    medians = {name: round(statistics.median(t), 3) for name, t in times.items()}
    medians["added_by_import"] = round(medians["torch_with_torchtpu"] - medians["torch_alone"], 3)
    medians["rounds"] = rounds
    medians["loadavg"] = open("/proc/loadavg").read().split()[:3]
    print(json.dumps(medians))


if __name__ == "__main__":
    main()
