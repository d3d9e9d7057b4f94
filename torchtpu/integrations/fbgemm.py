"""FBGEMM (``fbgemm_gpu``, which TorchRec's sparse tensors call): its sparse helper ops get tpu
lowerings as soon as its libraries have registered them (``torchtpu.lowering.fbgemm``)."""

from __future__ import annotations

import importlib


def patch() -> None:
    importlib.import_module("torchtpu.lowering.fbgemm")
