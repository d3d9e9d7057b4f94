"""A persistent compile cache entry's bytes: its header, the checks a reader makes, the read-back.

The format and the rules are ``compile_cache``'s (its module doc): an entry is
``MAGIC | sha256(rest) | rest``, rest = compile seconds, kind, host, payload. ``problem_of``
says why a reader refuses an entry; ``read_back`` is what its writer does before publishing an
executable's entry.
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import platform
import struct
import warnings

import jax
from jax._src import compilation_cache as jax_cache

from torchtpu.cache.map_room import make_room

MAGIC = b"TTPU3"
_FORMAT = b"TTPU"  # any version: an older one is replaced quietly
_DIGEST = 32
_HEAD = len(MAGIC) + _DIGEST
_SECONDS = struct.Struct(">d")
_HOST_LEN = struct.Struct(">H")
READ_BACK, OTHER = b"X", b"R"  # kinds: an executable its writer deserialized; anything else
_FIXED = _HEAD + _SECONDS.size + 1 + _HOST_LEN.size


class CompileCacheWarning(UserWarning):
    """A persistent cache entry was unreadable; the program is recompiled."""


@functools.cache
def host() -> str:
    """What this process's executables are built for (see the module doc)."""
    device = jax.devices()[0]
    text = f"{device.platform} {device.client.platform_version}; jaxlib {jax.lib.__version__}"
    if device.platform == "cpu":
        text += f"; cpu {platform.machine()} {cpu_features()}"
    return text


def cpu_features() -> str:
    """The CPU's feature flags (Linux: /proc/cpuinfo), hashed, with the vector ones named."""
    flags: list = []
    with contextlib.suppress(OSError):
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith(("flags", "Features")):
                    flags = sorted(line.split(":", 1)[1].split())
                    break
    if not flags:
        flags = [platform.processor()]
    vector = [f for f in flags if f.startswith(("avx", "amx", "sve", "asimd", "sse4"))]
    digest = hashlib.sha256(" ".join(flags).encode()).hexdigest()[:16]
    return f"{digest} ({' '.join(vector) or 'no vector flags'})"


def pack(value: bytes, seconds: float, kind: bytes, written_on: str | None = None) -> bytes:
    """An entry's bytes: value with its header, for this host unless written_on names one."""
    where = (host() if written_on is None else written_on).encode()
    rest = _SECONDS.pack(seconds) + kind + _HOST_LEN.pack(len(where)) + where + value
    return MAGIC + hashlib.sha256(rest).digest() + rest


def parts(data: bytes) -> tuple[float, bytes, str, bytes]:
    """A whole entry's (compile seconds, kind, host, payload)."""
    at = _HEAD + _SECONDS.size
    size, = _HOST_LEN.unpack_from(data, at + 1)
    start = at + 1 + _HOST_LEN.size
    return (_SECONDS.unpack_from(data, _HEAD)[0], data[at:at + 1],
            data[start:start + size].decode(errors="replace"), data[start + size:])


def problem_of(data: bytes) -> str | None:
    """Why an entry cannot be used ("" for an older format, replaced quietly); None if whole."""
    if not data.startswith(MAGIC):
        return "" if data.startswith(_FORMAT) else "it has no torchtpu header"
    if len(data) <= _FIXED:
        return f"it is truncated ({len(data)} bytes)"
    if hashlib.sha256(data[_HEAD:]).digest() != data[len(MAGIC):_HEAD]:
        return "its checksum does not match (truncated or damaged)"
    written_on = parts(data)[2]
    if written_on != host():
        return f"it was written for another host ({written_on}; this one is {host()})"
    return None


def read_back(value: bytes, executable, backend) -> bool:
    """Whether JAX's entry value deserializes into an executable here (warns if not)."""
    try:
        serialized, _ = jax_cache.extract_executable_and_time(
            jax_cache.decompress_executable(value))
        make_room()
        backend.deserialize_executable(serialized, executable.local_devices())
    except Exception as e:  # noqa: BLE001 (whatever XLA says: the program is not cached)
        warnings.warn(f"torchtpu.cache: a compiled program does not read back from its "
                      f"serialized form ({type(e).__name__}: {e}); it is not cached",
                      CompileCacheWarning, stacklevel=3)
        return False
    return True
