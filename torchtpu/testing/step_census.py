"""What an eager step does to the device, counted rather than timed: the census of a block.

``with census() as c: step()`` records, for everything launched while the block runs:

- ``launches``: program launches by name (an op overload, or the jitted function's name for the
  device layer's own programs: ``read_view``, ``write_view``, ``copy``, casts);
- ``programs``: the distinct programs among them (a jitted function and its arguments' shapes),
  each with its runs and one example call (``examples``: its name, the jitted function and its
  arguments as ``jax.ShapeDtypeStruct``s, to compile it again: ``bench/strict_breakdown.py``
  compiles each for a TPU target);
- ``host_waits``: every place the host read a device value or waited for one (``np.asarray`` or
  ``np.array`` of a JAX array, its ``_value``, ``block_until_ready``), with the torchtpu frames
  that did it. On XLA:CPU a read costs nothing, but on a TPU each one stalls the host until the
  device catches up, so a Strict step should make none but the user's own ``.item()``. The block
  runs as on a device whose host reads stall (``eager/at_call.py`` then sends data checks to the
  device, as it does on a TPU);
- ``scalar_transfers``: the values that crossed to the device with a launch, as Python numbers
  or NumPy arrays among its arguments (each one a host-to-device copy per call), by program;
- ``byte_inputs``: the programs given a uint8 array, by program: a storage held as raw bytes
  (one first written through a view that is not all of it reads as zero bytes; a uint8 tensor
  counts too). A program reading a tensor of another dtype out of bytes bitcasts them, which on
  a TPU re-tiles the whole storage (a product reading its operand that way took ~40x its time);
- ``dots``: every ``dot_general`` and ``convolution`` in the launched programs (their StableHLO),
  by (program, operand dtypes, result dtype, precision).

Tests assert on these (``tests/test_strict_step.py``); ``bench/strict_breakdown.py`` prints them
for the Llama step.
"""

from __future__ import annotations

import collections
import contextlib
import re
import traceback
from dataclasses import dataclass, field

import jax
import numpy as np
from jax._src.array import ArrayImpl

from torchtpu.device.hooks import HOOKS

# The device layer's copies around views (``device/tensors.py``): a view read, a write through
# a view, a run or whole rows written at an offset, a buffer copied whole.
VIEW_COPIES = ("read_view", "write_view", "write_run", "write_rows", "copy")


@dataclass
class Census:
    launches: collections.Counter = field(default_factory=collections.Counter)
    programs: collections.Counter = field(default_factory=collections.Counter)
    examples: dict = field(default_factory=dict)
    host_waits: list = field(default_factory=list)
    scalar_transfers: collections.Counter = field(default_factory=collections.Counter)
    byte_inputs: collections.Counter = field(default_factory=collections.Counter)
    dots: collections.Counter = field(default_factory=collections.Counter)

    @property
    def launch_count(self) -> int:
        return sum(self.launches.values())

    @property
    def view_copies(self) -> dict:
        return {k: v for k, v in self.launches.items() if k in VIEW_COPIES}

    def summary(self) -> dict:
        return {
            "launches": self.launch_count,
            "distinct_programs": len(self.programs),
            "host_waits": len(self.host_waits),
            "host_wait_sites": dict(collections.Counter(w for w in self.host_waits)),
            "scalar_transfers": sum(self.scalar_transfers.values()),
            "scalar_transfers_by_program": dict(self.scalar_transfers),
            "byte_inputs": dict(self.byte_inputs),
            "view_copies": self.view_copies,
            "dots": [{"program": p, "operands": list(o), "result": r, "precision": prec,
                      "count": n} for (p, o, r, prec), n in sorted(self.dots.items())],
            "launches_by_program": dict(self.launches.most_common()),
        }


def _name(label, fn) -> str:
    if label is not None:
        return str(label)
    return getattr(fn, "__name__", type(fn).__name__)


def _where() -> str:
    frames = [f for f in traceback.extract_stack()[:-3] if "/torchtpu/" in f.filename
              and "/testing/" not in f.filename]
    return " <- ".join(f"{f.filename.rsplit('/torchtpu/', 1)[-1]}:{f.lineno}"
                       for f in reversed(frames[-3:])) or "outside torchtpu"


_DOT = re.compile(r"stablehlo\.(dot_general|convolution)")
_TYPES = re.compile(r"\(tensor<([^>]*)>, tensor<([^>]*)>\) -> tensor<([^>]*)>")
_PRECISION = re.compile(r"precision_config = \[([^\]]*)\]|precision = \[([^\]]*)\]")


def _element(t: str) -> str:
    return t.rsplit("x", 1)[-1]


def dots_of(text: str) -> list:
    """(operand dtypes, result dtype, precision) of each dot and convolution in StableHLO."""
    found = []
    for line in text.splitlines():
        if not _DOT.search(line):
            continue
        types = _TYPES.search(line)
        prec = _PRECISION.search(line)
        precision = ",".join(p.strip().removeprefix("#stablehlo<precision ").rstrip(">")
                             for p in (prec.group(1) or prec.group(2)).split(",")) \
            if prec else "DEFAULT"
        if types:
            found.append(((_element(types.group(1)), _element(types.group(2))),
                          _element(types.group(3)), precision))
    return found


@contextlib.contextmanager
def census(dots: bool = True):
    """Count what the block launches and waits for (see the module doc)."""
    c = Census()
    lowered: dict = {}
    previous = HOOKS.launch_observer
    reading = [True]

    def observe(label, fn, args):
        name = _name(label, fn)
        c.launches[name] += 1
        leaves = jax.tree_util.tree_leaves(args)
        key = (id(fn), tuple((getattr(a, "shape", None), str(getattr(a, "dtype", type(a))))
                             for a in leaves))
        c.programs[key] += 1
        if key not in c.examples:
            c.examples[key] = (name, fn, jax.tree_util.tree_map(
                lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype) if isinstance(a, jax.Array)
                else a, args))
        for a in leaves:
            if not isinstance(a, jax.Array) and isinstance(a, (int, float, complex, np.ndarray,
                                                                np.generic)):
                c.scalar_transfers[name] += 1
            elif getattr(a, "dtype", None) == np.uint8:
                c.byte_inputs[name] += 1
        if dots and key not in lowered and hasattr(fn, "lower"):
            reading[0] = False  # lowering is no host wait
            try:
                lowered[key] = dots_of(fn.lower(*args).as_text())
            except Exception:  # noqa: BLE001 - a program that cannot be lowered alone
                lowered[key] = []
            finally:
                reading[0] = True
        for d in lowered.get(key, ()):
            c.dots[(name, *d)] += 1
        return fn(*args) if previous is None else previous(label, fn, args)

    def wait(kind):
        if reading[0]:
            c.host_waits.append(f"{kind} at {_where()}")

    saved = {n: getattr(np, n) for n in ("asarray", "array")}

    def host_read(name):
        original = saved[name]

        def read(a, *args, **kwargs):
            if isinstance(a, ArrayImpl):
                wait(f"np.{name}")
            return original(a, *args, **kwargs)
        return read

    value, block = ArrayImpl._value, ArrayImpl.block_until_ready

    def block_until_ready(self):
        wait("block_until_ready")
        return block(self)

    jax_block = jax.block_until_ready

    def block_all(x):
        wait("jax.block_until_ready")
        return jax_block(x)

    stall = HOOKS.host_reads_stall
    HOOKS.launch_observer = observe
    jax.block_until_ready = block_all
    for n in saved:
        setattr(np, n, host_read(n))
    ArrayImpl._value = property(lambda self: (wait("value"), value.fget(self))[1])
    ArrayImpl.block_until_ready = block_until_ready
    HOOKS.host_reads_stall = True
    try:
        yield c
    finally:
        HOOKS.host_reads_stall = stall
        jax.block_until_ready = jax_block
        ArrayImpl._value, ArrayImpl.block_until_ready = value, block
        for n, f in saved.items():
            setattr(np, n, f)
        HOOKS.launch_observer = previous
