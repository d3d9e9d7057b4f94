"""A program's 64-bit types narrowed to 32 bits, for the TPU cost model's time only.

libtpu's cost model gives no time (``optimal_seconds`` < 0) for a program with any 64-bit op,
and nearly every program PyTorch builds has some: token ids, ``arange`` positions and loss
targets are int64, Python numbers fold in as float64. The TPU emulates those types with 32-bit
ops, and on a TPU they are commonly narrowed outright (PyTorch/XLA's ``XLA_USE_32BIT_LONG``).
``narrowed(text)`` is the module's text with int64/float64 types made int32/float32 (float64
constants re-encoded); the target compiles it only to read the cost model's seconds, which its
report then marks as taken from the narrowed program. Its HBM and bytes stay the real program's.
``None`` when the narrowed text is not a valid program (a constant outside int32, a bitcast
between widths): the time then stays unknown. Attributes that are i64 by definition stay 64-bit
(a collective's ``replica_groups``, ``source_target_pairs``, a window's ``padding``: the compiler
takes them as i64 only).
"""

from __future__ import annotations

import re
import struct

import numpy as np

_TYPES = ((re.compile(r"(?<=[x<])(u?)i64>"), r"\1i32>"),
          (re.compile(r"(?<=[x<])f64>"), "f32>"),
          (re.compile(r"complex<f64>"), "complex<f32>"))
# A float64 splat constant written as its bits (inf, nan, -0.0): ``dense<0xFFF0000000000000>``.
_F64_BITS = re.compile(r"dense<0x([0-9A-Fa-f]{16})>")
_INT = re.compile(r"dense<(-?\d+)>\s*:\s*tensor<(?:[0-9]+x)*u?i32>")
# A large constant is printed as its raw little-endian bytes: still 8 per element once its type
# says 32 bits.
_BLOB = re.compile(r'dense<"0x([0-9A-Fa-f]+)">(\s*:\s*tensor<((?:[0-9]+x)*)(ui32|i32|f32)>)')
_WIDE = {"i32": ("<i8", "<i4"), "ui32": ("<u8", "<u4"), "f32": ("<f8", "<f4")}
_I32 = (-(1 << 31), (1 << 32) - 1)
# Attributes that are i64 by the op's definition, not data: device ids of an SPMD program's
# collectives, a window's padding (reduce_window, select_and_scatter: a cumsum's).
_DEVICE_IDS = re.compile(r"\b(?:replica_groups|source_target_pairs|padding)\s*=\s*dense<[^>]*>"
                         r"\s*:\s*tensor<[0-9x]*i64>")


def _f32_bits(m: re.Match) -> str:
    value = struct.unpack(">d", bytes.fromhex(m.group(1)))[0]
    return "dense<0x" + struct.pack(">f", value).hex().upper() + ">"


def narrowed(text: str) -> str | None:
    """text (StableHLO) with its 64-bit element types 32-bit, or None if that cannot hold."""
    if "64>" not in text:
        return None
    kept: list[str] = []

    def keep(m: re.Match) -> str:
        kept.append(m.group(0))
        return f"@torchtpu_kept_{len(kept) - 1}@"

    out = _DEVICE_IDS.sub(keep, text)
    if "64>" not in out:
        return None
    for pattern, repl in _TYPES:
        out = pattern.sub(repl, out)
    out = _F64_BITS.sub(_f32_bits, out)
    for m in _INT.finditer(out):
        if not _I32[0] <= int(m.group(1)) <= _I32[1]:
            return None  # an int64 sentinel (INT64_MAX) has no int32 twin
    try:
        out = _BLOB.sub(_narrow_blob, out)
    except OverflowError:
        return None
    return re.sub(r"@torchtpu_kept_(\d+)@", lambda m: kept[int(m.group(1))], out)


def _narrow_blob(m: re.Match) -> str:
    count = int(np.prod([int(d) for d in m.group(3).split("x") if d], dtype=np.int64))
    data = bytes.fromhex(m.group(1))
    wide, narrow = _WIDE[m.group(4)]
    if len(data) != 8 * count:
        return m.group(0)  # a 32-bit constant already
    values = np.frombuffer(data, wide)
    if values.dtype.kind in "iu":
        limits = np.iinfo(np.dtype(narrow))
        if values.size and (values.min() < limits.min or values.max() > limits.max):
            raise OverflowError
    return f'dense<"0x{values.astype(narrow).tobytes().hex().upper()}">{m.group(2)}'
