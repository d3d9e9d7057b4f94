"""Checks of a model directory before vLLM's engine starts on device "tpu": a clear error early.

- A tokenizer missing from a local model directory: Transformers would fail deep in vLLM's
  input processor (or, with a name that looks like a hub id, try the network, which a sandboxed
  TPU host has not got). :func:`check_tokenizer` runs in the platform's config check.
- Weights larger than the device: loading would fail with an allocation error part way through
  the load. :func:`check_weights_fit` runs in the worker before it loads, where the device is
  known; the bytes come from the checkpoint's safetensors headers (no tensor is read), at the
  dtype vLLM serves.

(vLLM itself refuses a ``max_model_len`` whose KV cache does not fit, naming the largest that
would, and a prompt longer than ``max_model_len``, per request.)
"""

from __future__ import annotations

import json
import math
import struct
from pathlib import Path

import torch

# files any of which makes a directory hold a tokenizer Transformers can load
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json",
                   "spiece.model", "tokenizer.tiktoken")


def check_tokenizer(model_config) -> None:
    """Raise if vLLM will load a tokenizer from a local directory that holds none."""
    if model_config is None or getattr(model_config, "skip_tokenizer_init", False):
        return
    path = Path(str(getattr(model_config, "tokenizer", None) or model_config.model))
    if not path.is_dir() or any((path / name).exists() for name in TOKENIZER_FILES):
        return
    raise ValueError(
        f"torchtpu.argument: the model directory {path} has no tokenizer (none of "
        f"{', '.join(TOKENIZER_FILES)}); save one there (tokenizer.save_pretrained(dir)), pass "
        "tokenizer=DIR, or skip_tokenizer_init=True and send token ids")


def checkpoint_elements(model_dir: str | Path) -> int | None:
    """How many weight elements a local directory's safetensors hold (headers only), or None."""
    files = sorted(Path(model_dir).glob("*.safetensors")) if Path(model_dir).is_dir() else []
    if not files:
        return None
    total = 0
    for f in files:
        with open(f, "rb") as fh:
            (n,) = struct.unpack("<Q", fh.read(8))
            header = json.loads(fh.read(n))
        total += sum(math.prod(meta["shape"]) for name, meta in header.items()
                     if name != "__metadata__")
    return total


def check_weights_fit(model_dir: str | Path, dtype: torch.dtype, device_bytes: int,
                      utilization: float, device_name: str) -> None:
    """Raise ``torch.OutOfMemoryError`` if the checkpoint's weights at ``dtype`` exceed the
    device's share ``utilization`` (vLLM's ``gpu_memory_utilization``) of ``device_bytes``."""
    elements = checkpoint_elements(model_dir)
    if elements is None:
        return
    need = elements * torch.finfo(dtype).bits // 8 if dtype.is_floating_point else elements
    allowed = int(device_bytes * utilization)
    if need <= allowed:
        return
    gib = 1 << 30
    raise torch.OutOfMemoryError(
        f"torchtpu.memory: the model in {model_dir} has {elements:,} weights, "
        f"{need / gib:.2f} GiB in {str(dtype).removeprefix('torch.')}, more than device 'tpu' "
        f"({device_name}, {device_bytes / gib:.2f} GiB) can hold at "
        f"gpu_memory_utilization={utilization} ({allowed / gib:.2f} GiB), before any KV "
        "cache; serve a smaller model, quantize its weights (quantization='fp8' halves "
        "bfloat16 ones), or raise gpu_memory_utilization")
