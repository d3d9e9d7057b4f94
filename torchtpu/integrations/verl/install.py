"""``python -m torchtpu.integrations.verl.install``: verl 0.9.1 into the vLLM venv.

verl 0.9.1's wheel requires ``transformers>=5.5.3,<5.11`` while vLLM-TorchTPU's venv holds 5.19.0
(``integrations/vllm/install.py``), and its extras pin torch 2.11 and vLLM 0.24 (CUDA builds), so
``pip install verl`` would move the pins the engine runs on. This installs the wheel with
``--no-deps`` and then its plain requirements that the GRPO path imports (:data:`DEPS`, with
torch and Transformers held by a constraints file), ``TransferQueue`` (verl 0.9's default trainer
moves batches through it) and TRL at verl's own pin (0.27.0, its fsdp extra's: verl's model
patches import ``trl.experimental.ppo``, gone from TRL 1.16). That TRL replaces the rl extra's,
so TRL's own GRPO (``tests/test_trl_vllm.py``) no longer runs in that venv afterwards: CI runs
this stage after vLLM's. Transformers 5.19 instead of verl's <5.11 was run here for the GRPO
path only (``tests/test_verl.py``).
"""

from __future__ import annotations

import subprocess
import sys
import tempfile
from pathlib import Path

VERL = "verl==0.9.1"
TRL = "trl==0.27.0"
HELD = ("torch==2.13.0", "transformers==5.19.0")
DEPS = ("codetiming", "hydra-core", "pylatexenc", "torchdata", "tensordict==0.10.0", "peft",
        "pybind11", "TransferQueue==0.1.11")


def commands(python: str = sys.executable, constraints: str = "constraints.txt") -> list[list[str]]:
    pip = [python, "-m", "pip"]
    return [
        [*pip, "install", "-c", constraints, *DEPS],
        [*pip, "install", "--no-deps", VERL, TRL],
        [python, "-c", "import verl, vllm; print('verl', verl.__version__, vllm.__version__)"],
    ]


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text("\n".join(HELD) + "\n")
        for cmd in commands(constraints=str(constraints)):
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)


if __name__ == "__main__":
    main()
