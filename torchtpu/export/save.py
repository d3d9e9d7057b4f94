"""``save`` and ``stablehlo``: a torch.export program as a ``jax.export`` artifact directory.

The program (``program.JaxProgram``) is traced once by ``jax.export`` at symbolic input shapes
(``shapes.Symbols``), so one artifact serves every batch and sequence size its
``torch.export.Dim``s allow. The directory's layout and manifest are ``torchtpu_artifact``'s,
which loads it without torch.
"""

from __future__ import annotations

import json
import os
import shutil
from collections.abc import Sequence

import jax
import numpy as np
from torch.export import ExportedProgram

import torchtpu_artifact as artifact
from torchtpu.export.program import JaxProgram
from torchtpu.export.shapes import Symbols


def _exported(program: JaxProgram, platforms: Sequence[str] | None):
    symbols = Symbols(program)

    def run(*arrays):
        return program(*arrays)

    run.__name__ = "torchtpu_export"
    exported = jax.export.export(jax.jit(run), platforms=platforms)(*symbols.specs(program))
    return exported, symbols


def _entries(slots: list, avals: Sequence) -> list[dict]:
    return [{"name": s.name, "kind": s.kind, "dtype": str(np.dtype(a.dtype)),
             "shape": [d if isinstance(d, int) else str(d) for d in a.shape]}
            for s, a in zip(slots, avals, strict=True)]


def save(exported_program: ExportedProgram, directory: str | os.PathLike,
         platforms: Sequence[str] | None = None) -> str:
    """Write exported_program (``torch.export.export(...)``'s result) to directory as a JAX
    artifact that ``torchtpu_artifact.load`` (or ``torchtpu.export.load``) runs without torch;
    platforms: ``jax.export``'s (default: this process's platform, e.g. ``("cpu", "tpu")``).
    Returns the directory."""
    program = JaxProgram(exported_program)
    exported, symbols = _exported(program, platforms)
    path = os.fspath(directory)
    os.makedirs(path, exist_ok=True)
    manifest = {
        "format": artifact.FORMAT,
        "calling_convention": (
            f"{artifact.PROGRAM} holds f(*inputs) -> outputs in the orders below; the inputs "
            f"that are not user inputs are read from {artifact.WEIGHTS} by name; "
            "buffer_mutation outputs are the buffers' new values"),
        "platforms": list(exported.platforms),
        "symbols": symbols.ranges,
        "inputs": _entries(program.inputs, exported.in_avals),
        "outputs": _entries(program.outputs, exported.out_avals),
    }
    artifact.write_safetensors(os.path.join(path, artifact.WEIGHTS), program.weights())
    with open(os.path.join(path, artifact.PROGRAM), "wb") as f:
        f.write(exported.serialize())
    with open(os.path.join(path, artifact.MANIFEST), "w") as f:
        json.dump(manifest, f, indent=1)
    shutil.copyfile(artifact.__file__, os.path.join(path, artifact.LOADER))
    return path


def stablehlo(exported_program: ExportedProgram,
              platforms: Sequence[str] | None = None) -> str:
    """The program's StableHLO module as text (MLIR), shape-polymorphic as ``save`` writes it:
    its arguments are the manifest's inputs in order (weights first, as ``save`` names them)."""
    exported, _ = _exported(JaxProgram(exported_program), platforms)
    return exported.mlir_module()
