"""``python -m torchtpu.integrations.sglang.install``: SGLang 0.5.23 beside torch 2.13.0+cpu.

SGLang's wheel names its CUDA stack as hard requirements (``torch==2.14.1``, flashinfer,
sglang-kernel, flash-attn-4, cuda-python, nvidia-* and more), so ``pip install sglang`` either
replaces the CPU torch or fails to resolve against ``torch==2.13.0``. Its own CPU install builds
from source with a separate dependency list (``python/pyproject_cpu.toml``) and sgl-kernel's C++
CPU kernels (not on PyPI). This installs the wheel with ``--no-deps`` and then the part of its
dependency list that a text model on device "tpu" imports (:data:`DEPS`), with torch held at
2.13.0 by a constraints file.

SGLang imports torchvision at start-up (multimodal preprocessing, imported for every model).
PyPI's torchvision 0.28.0 (the one for torch 2.13) is a CUDA build whose C++ ops do not load
beside the CPU torch, and its ``_meta_registrations`` then stops the import at an unguarded
``register_fake("torchvision::nms")``. :func:`guard_torchvision` makes those two registrations
conditional on the ops having loaded, as every other one in that file already is, so the
pure-Python transforms import and ``torchvision.ops.nms`` raises torchvision's own "Couldn't load
custom C++ ops". Last it marks the environment (``MARKER``) so that SGLang picks device "tpu".
"""

from __future__ import annotations

import re
import subprocess
import sys
import tempfile
from pathlib import Path

from torchtpu import settings
from torchtpu.integrations import engine_opt_in
from torchtpu.integrations.sglang import MARKER

SGLANG = "sglang==0.5.23"
TORCH = "torch==2.13.0"
TORCHVISION = "torchvision==0.28.0"
# sglang 0.5.23's requirements that its text-generation path imports, at its own pins where it
# pins them; left out: the CUDA kernels and runtimes, torchaudio/torchcodec, timm, outlines
DEPS = (
    TORCH, "transformers==5.19.0", "tokenizers==0.23.2", "compressed-tensors==0.18.0",
    "xgrammar==0.2.7", "openai==2.8.0", "openai-harmony==0.0.4", "blobfile==3.0.0",
    "sentencepiece==0.2.1", "soundfile==0.13.1", "llguidance>=1.7.6,<2", "mistral_common>=1.11.5",
    "anthropic>=0.20.0", "prometheus-client>=0.20.0", "pyzmq>=25.1.2", "uvicorn>=0.51",
    "python-dateutil<3", "aiohttp", "build", "datasets", "distro", "easydict", "einops",
    "fastapi", "gguf", "interegular", "IPython", "msgspec", "ninja", "numpy", "orjson",
    "packaging", "partial_json_parser", "pillow", "psutil", "pybase64", "pydantic",
    "python-multipart", "regex", "requests", "scipy", "setproctitle", "tiktoken", "uvloop",
    "watchfiles", "xxhash", "zstandard",
)
# the two registrations torchvision 0.28.0 makes whatever its C++ ops did
_UNGUARDED = re.compile(r'^@torch\.library\.register_fake\("torchvision::(q?nms)"\)$', re.M)


def guard_torchvision(path: Path) -> int:
    """Rewrite ``path`` (torchvision's ``_meta_registrations.py``) so that its nms and qnms
    registrations use the file's own guarded ``register_meta``; return how many it changed."""
    text = path.read_text()
    fixed, count = _UNGUARDED.subn(r'@register_meta("\1")', text)
    if count:
        path.write_text(fixed)
    return count


def commands(python: str = sys.executable, constraints: str = "constraints.txt") -> list[list[str]]:
    pip = [python, "-m", "pip"]
    return [
        [*pip, "install", "-c", constraints, *DEPS],
        [*pip, "install", "--no-deps", "-c", constraints, SGLANG, TORCHVISION],
    ]


def _torchvision_file(python: str) -> Path:
    # find the file without importing torchvision: importing it is what fails
    out = subprocess.run(
        [python, "-c", "import importlib.util as u; "
         "print(u.find_spec('torchvision').submodule_search_locations[0])"],
        check=True, capture_output=True, text=True).stdout.strip()
    return Path(out) / "_meta_registrations.py"


def main() -> None:
    with tempfile.TemporaryDirectory() as tmp:
        constraints = Path(tmp) / "constraints.txt"
        constraints.write_text(TORCH + "\n")  # no CUDA torch through any dependency
        for cmd in commands(constraints=str(constraints)):
            print("+", " ".join(cmd), flush=True)
            subprocess.run(cmd, check=True)
    guarded = guard_torchvision(_torchvision_file(sys.executable))
    print("torchvision registrations guarded:", guarded)
    check = ("import torch, sglang, torchvision; "
             "print('sglang', sglang.__version__, 'torch', torch.__version__)")
    subprocess.run([sys.executable, "-c", check], check=True)
    engine_opt_in.mark("SGLang", settings.SGLANG, MARKER)


if __name__ == "__main__":
    main()
