"""Load and run a torchtpu export artifact with JAX alone: no torch, no torchtpu package root.

``torchtpu.export.save(exported_program, directory)`` writes a directory of four files:

- ``manifest.json``: the calling convention (``FORMAT``): the program's inputs in order (the
  module's parameters, buffers and constants by their state-dict names, then the user inputs by
  their argument names), its outputs in order (the buffers it updates, then the user outputs),
  each with its dtype and its shape, where a dimension is an int or a JAX symbolic expression
  (``"batch"``, ``"2*seq"``), and each symbol's range;
- ``program.jax``: the serialized ``jax.export.Exported`` (``jax.export.deserialize``) of
  ``f(*inputs) -> outputs``, shape-polymorphic in those symbols;
- ``weights.safetensors``: the parameters, buffers and constants, by name (any safetensors reader
  opens it; this module reads it with NumPy);
- ``torchtpu_artifact.py``: a copy of this file, so the directory runs where torchtpu is not
  installed (``sys.path.insert(0, directory); import torchtpu_artifact``).

This module imports only the standard library, NumPy, ml_dtypes and JAX, so a serving process
never imports torch::

    from torchtpu_artifact import load
    program = load("artifact/")
    logits = program(input_ids)                       # user outputs
    outputs, buffers = program.call(program.weights, input_ids)  # pure: for jax.jit, jax.grad

Inputs are checked against the manifest before the call: a wrong rank, dtype, fixed size, a
symbol bound to two sizes or out of its range names the input and the shape it expects.
"""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Sequence
from typing import Any

import jax
import ml_dtypes
import numpy as np

FORMAT = "torchtpu.export/1"
MANIFEST, PROGRAM, WEIGHTS, LOADER = ("manifest.json", "program.jax", "weights.safetensors",
                                      "torchtpu_artifact.py")
# Input and output kinds in the manifest (torch.export's InputKind / OutputKind, in lower case).
USER_INPUT, USER_OUTPUT, BUFFER_MUTATION = "user_input", "user_output", "buffer_mutation"

_SAFETENSORS_DTYPES = {
    "F64": np.float64, "F32": np.float32, "F16": np.float16, "BF16": ml_dtypes.bfloat16,
    "F8_E4M3": ml_dtypes.float8_e4m3fn, "F8_E5M2": ml_dtypes.float8_e5m2,
    "I64": np.int64, "I32": np.int32, "I16": np.int16, "I8": np.int8,
    "U64": np.uint64, "U32": np.uint32, "U16": np.uint16, "U8": np.uint8, "BOOL": np.bool_,
    "C64": np.complex64, "C128": np.complex128,
}
_SAFETENSORS_CODES = {np.dtype(v): k for k, v in _SAFETENSORS_DTYPES.items()}


def _error(text: str) -> str:
    return f"torchtpu.export: {text}"


def write_safetensors(path: str, arrays: dict[str, np.ndarray]) -> None:
    """arrays in the safetensors format: a little-endian u64 header size, a JSON header of
    dtype, shape and byte range per name, then the bytes, each tensor 8-byte aligned."""
    header: dict[str, Any] = {}
    offset = 0
    for name, a in arrays.items():
        code = _SAFETENSORS_CODES.get(a.dtype)
        if code is None:
            raise TypeError(_error(f"weight {name!r} has dtype {a.dtype}, which safetensors "
                                   "cannot hold"))
        header[name] = {"dtype": code, "shape": list(a.shape),
                        "data_offsets": [offset, offset + a.nbytes]}
        offset += -(-a.nbytes // 8) * 8
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for a in arrays.values():
            f.write(np.ascontiguousarray(a).tobytes())
            f.write(b"\0" * (-a.nbytes % 8))


def read_safetensors(path: str) -> dict[str, np.ndarray]:
    """The arrays of a safetensors file, by name (read-only views of one memory map)."""
    data = np.memmap(path, dtype=np.uint8, mode="r")
    (size,) = struct.unpack("<Q", data[:8].tobytes())
    header = json.loads(data[8:8 + size].tobytes())
    header.pop("__metadata__", None)
    base = 8 + size
    arrays = {}
    for name, entry in header.items():
        dtype = _SAFETENSORS_DTYPES.get(entry["dtype"])
        if dtype is None:
            raise TypeError(_error(f"{path}: weight {name!r} has safetensors dtype "
                                   f"{entry['dtype']}, which this loader does not read"))
        begin, end = entry["data_offsets"]
        arrays[name] = data[base + begin:base + end].view(dtype).reshape(entry["shape"])
    return arrays


def shape_text(dtype: str, shape: Sequence) -> str:
    """A manifest shape as JAX writes it: ``int64[batch, seq]``."""
    return f"{dtype}[{', '.join(str(d) for d in shape)}]"


class Program:
    """A loaded artifact: ``program(*inputs)`` gives the user outputs (one array, or a tuple of
    them), ``program.call(weights, *inputs)`` gives ``(outputs, updated buffers)`` purely."""

    def __init__(self, manifest: dict, exported: jax.export.Exported,
                 weights: dict[str, jax.Array]) -> None:
        self.manifest = manifest
        self.exported = exported
        self.weights = weights
        self.inputs = [i for i in manifest["inputs"] if i["kind"] == USER_INPUT]
        self.weight_names = [i["name"] for i in manifest["inputs"] if i["kind"] != USER_INPUT]
        self.outputs = [o for o in manifest["outputs"] if o["kind"] == USER_OUTPUT]
        self.symbols = manifest["symbols"]

    def __call__(self, *inputs, **named) -> Any:
        outputs, _ = self.call(self.weights, *inputs, **named)
        return outputs

    def call(self, weights: dict, *inputs, **named) -> tuple[Any, dict]:
        """(the user outputs, {buffer name: new value}) from weights (a dict name -> array, such
        as ``self.weights``) and the user inputs, by position or by name."""
        inputs = self._bind(inputs, named)
        self.check(inputs)
        missing = [n for n in self.weight_names if n not in weights]
        if missing:
            raise KeyError(_error(f"weights lack {', '.join(missing[:5])}"
                                  f"{' ...' if len(missing) > 5 else ''}"))
        given = iter(inputs)
        flat = self.exported.call(*(next(given) if i["kind"] == USER_INPUT else weights[i["name"]]
                                    for i in self.manifest["inputs"]))
        buffers, outputs = {}, []
        for spec, value in zip(self.manifest["outputs"], flat, strict=True):
            if spec["kind"] == BUFFER_MUTATION:
                buffers[spec["name"]] = value
            else:
                outputs.append(value)
        return (outputs[0] if len(outputs) == 1 else tuple(outputs)), buffers

    def _bind(self, inputs: tuple, named: dict) -> list:
        names = [i["name"] for i in self.inputs]
        unknown = [n for n in named if n not in names]
        if unknown or len(inputs) > len(names):
            raise TypeError(_error(f"the program takes the inputs {', '.join(names)}; got "
                                   f"{len(inputs)} positional and {sorted(named)} by name"))
        bound = dict(zip(names, inputs))
        for n, v in named.items():
            if n in bound:
                raise TypeError(_error(f"input {n!r} given twice"))
            bound[n] = v
        absent = [n for n in names if n not in bound]
        if absent:
            raise TypeError(_error(f"missing inputs {', '.join(absent)} (the program takes "
                                   f"{self.signature()})"))
        return [bound[n] for n in names]

    def signature(self) -> str:
        """The user inputs and outputs with their shapes, as the manifest gives them."""
        ins = ", ".join(f"{i['name']}: {shape_text(i['dtype'], i['shape'])}"
                        for i in self.inputs)
        outs = ", ".join(shape_text(o["dtype"], o["shape"]) for o in self.outputs)
        return f"({ins}) -> ({outs})"

    def check(self, inputs: Sequence) -> None:
        """Raise naming the input when one does not fit the manifest: its rank, dtype, a fixed
        size, a symbol's range, or a symbol two inputs give different sizes."""
        bound: dict[str, tuple[int, str]] = {}
        for spec, x in zip(self.inputs, inputs, strict=True):
            name, expected = spec["name"], shape_text(spec["dtype"], spec["shape"])
            if not hasattr(x, "shape"):
                x = np.asarray(x)
            shape, dtype = tuple(x.shape), str(x.dtype)
            got = shape_text(dtype, shape)
            if len(shape) != len(spec["shape"]):
                raise ValueError(_error(f"input {name!r} has rank {len(shape)} ({got}); the "
                                        f"program takes rank {len(spec['shape'])}: {expected}"))
            if dtype != spec["dtype"]:
                raise TypeError(_error(f"input {name!r} has dtype {dtype} ({got}); the program "
                                       f"takes {expected}"))
            for axis, (want, size) in enumerate(zip(spec["shape"], shape)):
                where = f"input {name!r} ({got}) dimension {axis}"
                if isinstance(want, int):
                    if size != want:
                        raise ValueError(_error(f"{where} is {size}; the program takes "
                                                f"{expected}"))
                    continue
                if want not in self.symbols or not isinstance(size, int):
                    continue  # an expression, or a size symbolic itself: JAX checks it
                low, high = self.symbols[want]["min"], self.symbols[want]["max"]
                if size < low or (high is not None and size > high):
                    raise ValueError(_error(
                        f"{where} is {size}, outside {want}'s range [{low}, "
                        f"{'inf' if high is None else high}] ({expected})"))
                seen = bound.setdefault(want, (size, name))
                if seen[0] != size:
                    raise ValueError(_error(
                        f"{where} is {size}, but {want} is {seen[0]} in input {seen[1]!r} "
                        f"({expected})"))


def _uses_64_bits(manifest: dict) -> bool:
    wide = {"int64", "uint64", "float64", "complex128"}
    return any(e["dtype"] in wide for e in manifest["inputs"] + manifest["outputs"])


def load(directory: str, device: jax.Device | None = None) -> Program:
    """The artifact torchtpu.export.save wrote in directory, with its weights on device (JAX's
    default device if None). Turns on ``jax_enable_x64`` when the program takes or gives 64-bit
    values (PyTorch's int64 token ids), without which JAX cannot hold them."""
    path = os.fspath(directory)
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            manifest = json.load(f)
    except FileNotFoundError:
        raise FileNotFoundError(_error(f"{path} has no {MANIFEST}: not a directory "
                                       "torchtpu.export.save wrote")) from None
    if manifest.get("format") != FORMAT:
        raise ValueError(_error(f"{path}: format {manifest.get('format')!r} is not {FORMAT!r}"))
    if _uses_64_bits(manifest):
        jax.config.update("jax_enable_x64", True)
    with open(os.path.join(path, PROGRAM), "rb") as f:
        exported = jax.export.deserialize(bytearray(f.read()))
    device = device or jax.devices()[0]
    weights = {name: jax.device_put(a, device)
               for name, a in read_safetensors(os.path.join(path, WEIGHTS)).items()}
    return Program(manifest, exported, weights)
