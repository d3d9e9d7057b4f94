"""TorchTitan runs for tests: offline assets, and a CPU reference launcher.

TorchTitan's debug config reads a tokenizer from ``./tests/assets/tokenizer`` and the ``c4_test``
dataset from ``./tests/assets/c4_test``, which its wheel does not ship (they live in its source
tree) and which may not be downloaded at run time. ``make_assets(root)`` writes stand-ins under
``root``: a small byte-level BPE tokenizer trained on generated text and a JSON-lines dataset of
documents of varied lengths (so packed batches hold several documents, the case varlen attention
exists for).

``python torchtpu/testing/titan.py ARGS`` (this file run by its path, ``REFERENCE``; also under
torchrun) is the CPU reference of ``python -m torchtpu.titan ARGS``: TorchTitan on device "cpu"
with gloo, torchtpu not loaded (``TORCH_DEVICE_BACKEND_AUTOLOAD=0``, which the caller sets, and
this file's helpers loaded by path), and CPU kernels for the flash attention ops
(``testing/flash.py``), which CPU lacks; FSDP2's reductions by a factor of 1 go to gloo as SUM.
"""

from __future__ import annotations

import importlib.util
import json
import os
import random
import sys
import types

_WORDS = ("the a model device tensor train step loss batch token layer attention weight "
          "gradient shard rank process compile program memory value cache query key head "
          "sequence document packed length norm embedding output input data test run").split()


def _documents(count: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    return [" ".join(rng.choice(_WORDS) for _ in range(rng.randint(8, 120))) + "."
            for _ in range(count)]


def make_assets(root: str, documents: int = 400, vocab_size: int = 512) -> None:
    """Write ``root/tests/assets/{tokenizer,c4_test}`` for TorchTitan's llama3 debug config."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    assets = os.path.join(root, "tests", "assets")
    tokenizer_dir, data_dir = os.path.join(assets, "tokenizer"), os.path.join(assets, "c4_test")
    os.makedirs(tokenizer_dir, exist_ok=True)
    os.makedirs(data_dir, exist_ok=True)
    texts = _documents(documents, seed=0)
    bos, eos = "<|begin_of_text|>", "<|end_of_text|>"
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    tokenizer.train_from_iterator(texts, trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[bos, eos], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    tokenizer.save(os.path.join(tokenizer_dir, "tokenizer.json"))
    with open(os.path.join(tokenizer_dir, "tokenizer_config.json"), "w") as f:
        json.dump({"bos_token": bos, "eos_token": eos, "add_bos_token": True,
                   "add_eos_token": True}, f)
    with open(os.path.join(data_dir, "train.json"), "w") as f:
        for text in texts:
            f.write(json.dumps({"text": text}) + "\n")


def _as_training_device(cpu) -> None:
    """Give ``torch.cpu`` the device functions TorchTitan calls (memory figures: none)."""
    stand_ins = {
        "get_device_name": lambda device=None: "cpu",
        "get_device_properties": lambda device=None: types.SimpleNamespace(
            name="cpu", total_memory=os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")),
        "memory_stats": lambda device=None: {},
        "reset_peak_memory_stats": lambda device=None: None,
        "empty_cache": lambda: None,
    }
    for name, fn in stand_ins.items():
        if not hasattr(cpu, name):
            setattr(cpu, name, fn)
    # An index, as an accelerator's: TorchTitan passes it to barrier(device_ids=...).
    cpu.current_device = lambda: 0


def _sum_for_gloo() -> None:
    """FSDP2's gradient reduction with a factor of 1 (TorchTitan divides by tokens itself) as a
    plain SUM: it is PREMUL_SUM(1.0) otherwise, which tpu_dist has and gloo does not."""
    from torch.distributed.fsdp import FSDPModule

    set_factor = FSDPModule.set_gradient_divide_factor

    def set_gradient_divide_factor(self, factor: float) -> None:
        set_factor(self, factor)
        if factor == 1.0:
            self.set_force_sum_reduction_for_comms(True)

    FSDPModule.set_gradient_divide_factor = set_gradient_divide_factor


def _load(relative: str):
    """A module of this package by its file path, without importing torchtpu itself."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    name = "_titan_reference_" + os.path.basename(relative)[:-3]
    spec = importlib.util.spec_from_file_location(name, os.path.join(root, relative))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    import torch

    # TorchTitan takes the first available accelerator when it is imported, else CUDA.
    torch._utils._get_available_device_type = lambda: "cpu"
    _as_training_device(torch.cpu)
    _sum_for_gloo()
    _load("testing/flash.py").install_cpu_kernels()
    launcher = _load("integrations/titan.py")
    # ``--module torchtpu.titan`` names the tpu launcher's configs, which that file defines:
    # found under the same name here without importing torchtpu (TorchTitan imports --module).
    sys.modules["torchtpu.titan"] = launcher
    launcher.main()


REFERENCE = os.path.abspath(__file__)

if __name__ == "__main__":
    main()
