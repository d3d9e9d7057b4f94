"""Keys of warm starts: stable text for what a program depends on, the same in every process.

A program found by torchtpu's own key (``warm.py``) runs without being traced, so its key must
name everything it was built from. ``canonical`` turns op names, specs, view geometries,
module-level and ``named`` functions into stable text and raises ``Unstable`` for anything whose
identity is only an address (a closure, a lambda, an object without a stable form);
``fingerprint`` adds what every key depends on besides its caller's parts (versions, the device,
the XLA flags, a hash of torchtpu's own source).
"""

from __future__ import annotations

import enum
import functools
import hashlib
import os
import types
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.runtime import platform


class Unstable(Exception):
    """A value whose identity does not survive the process (an address, a closure)."""


@functools.cache
def source_digest() -> str:
    """A hash of torchtpu's own source (its Python files, by path)."""
    source = hashlib.sha256()
    root = Path(__file__).resolve().parent.parent
    for path in sorted(root.rglob("*.py")):
        source.update(str(path.relative_to(root)).encode())
        source.update(path.read_bytes())
    return source.hexdigest()


@functools.cache
def fingerprint() -> str:
    """What every key depends on besides its caller's parts (and, for a program, the settings
    and argument signature of its first call): versions, platform, XLA flags, own source."""
    # The device this process drives, not jax.devices()[0] nor jax.local_devices()[0]: each
    # process's programs are compiled for its own device, and one loading another's executable
    # fails at launch (ranks of a multi-process run; processes of one host that each see all
    # its devices and drive one, as Ray Serve's replicas do).
    device = platform.local_device()
    parts = [torch.__version__, jax.__version__, jax.lib.__version__, np.__version__,
             device.platform, device.device_kind, device.client.platform_version, str(device.id),
             os.environ.get("XLA_FLAGS", ""), source_digest()]
    return hashlib.sha256("\0".join(parts).encode()).hexdigest()


def named(fn, *parts):
    """fn (a jitted function) known by parts in keys; returns fn."""
    fn._ttpu_parts = parts
    return fn


_PLAIN = (int, str, type(None))
# Types a key may name (``meta.exact_key`` pairs each value with its type)
_NAMED_TYPES = frozenset({bool, int, float, complex, str, type(None), torch.dtype, torch.device,
                          torch.memory_format, torch.layout})


def canonical(x) -> str:
    """Stable text for x: the same in every process, or ``Unstable``."""
    cls = type(x)
    if cls in _PLAIN or cls is bool or cls is complex:
        return repr(x)
    if cls is tuple and all(type(v) in _PLAIN for v in x):  # most of a recording's references
        return repr(x)
    if cls is float:  # not np.float64, a float too: a strong dtype makes another program
        return x.hex()
    if isinstance(x, tuple) and hasattr(x, "_fields"):  # a NamedTuple (a view Geometry)
        return f"{type(x).__qualname__}({','.join(canonical(v) for v in x)})"
    if isinstance(x, (tuple, list)):
        inner = ",".join(canonical(v) for v in x)
        return f"({inner})" if isinstance(x, tuple) else f"[{inner}]"
    if isinstance(x, dict):
        return "{" + ",".join(f"{canonical(k)}:{canonical(v)}"
                              for k, v in sorted(x.items(), key=lambda kv: repr(kv[0]))) + "}"
    if isinstance(x, np.dtype) or (isinstance(x, type) and issubclass(x, np.generic)):
        return f"dtype:{np.dtype(x).name}"
    if isinstance(x, np.generic):
        return f"{x.dtype.name}:{canonical(x.item())}"
    if isinstance(x, np.ndarray) and x.size <= 64:
        return f"array:{x.dtype.name}{x.shape}:{x.tobytes().hex()}"
    if isinstance(x, (torch.dtype, torch.device, torch.memory_format, torch.layout)):
        return str(x)
    if isinstance(x, type) and x in _NAMED_TYPES:
        return f"type:{x.__name__}"
    if isinstance(x, jax.tree_util.PyTreeDef):
        return f"tree:{x}"
    if isinstance(x, jax.ShapeDtypeStruct):  # a shape-only argument (``lowers(shape_only)``)
        return f"struct:{canonical(tuple(x.shape))}{np.dtype(x.dtype).name}"
    if isinstance(x, torch._ops.OpOverload):
        return f"op:{x}"
    if isinstance(x, enum.Enum):
        return f"{type(x).__module__}.{type(x).__qualname__}.{x.name}"
    if isinstance(x, slice):
        return f"slice{canonical((x.start, x.stop, x.step))}"
    if x is Ellipsis:
        return "..."
    parts = getattr(x, "_ttpu_parts", None)
    if parts is not None:
        text = getattr(x, "_ttpu_text", None)
        if text is None:  # once per function: recorded programs name the same ones often
            text = x._ttpu_text = f"named{canonical(parts)}"
        return text
    if isinstance(x, functools.partial):
        return f"partial({canonical(x.func)},{canonical(x.args)},{canonical(x.keywords)})"
    wrapped = getattr(x, "__wrapped__", None)  # a jitted function
    if wrapped is not None and not isinstance(x, types.FunctionType):
        return f"jit({canonical(wrapped)})"
    if isinstance(x, (types.FunctionType, types.BuiltinFunctionType, np.ufunc)):
        qualname = getattr(x, "__qualname__", "") or getattr(x, "__name__", "")
        module = getattr(x, "__module__", None) or type(x).__module__
        closure = getattr(x, "__closure__", None)
        if closure or "<" in qualname or not module:
            raise Unstable(f"{x!r} is a closure or lambda")
        return f"fn:{module}.{qualname}"
    if isinstance(x, jnp.ufunc):  # jnp.negative (aten.neg's lowering): one object per name
        return f"jnp.ufunc:{x.__name__}"
    raise Unstable(f"no stable form for {type(x).__name__}")


def key_of(*parts) -> str | None:
    """The hash of parts (with the fingerprint), or None if some part has no stable form."""
    try:
        text = canonical(parts)
    except Unstable:
        return None
    return hashlib.sha256(f"{fingerprint()}\0{text}".encode()).hexdigest()
