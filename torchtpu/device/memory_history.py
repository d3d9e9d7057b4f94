"""Memory history in CUDA's snapshot format: ``torch.tpu.memory._record_memory_history`` & co.

PyTorch's memory visualizer (``torch.cuda._memory_viz``, pytorch.org/memory_viz) reads the
dictionary ``torch.cuda.memory._snapshot()`` returns; this module keeps the same one for device
"tpu". While recording is on, every device storage made for a tensor is an allocation: its
address (the storage's never-dereferenced data pointer), its byte size, and the Python stack
that asked for it (user frames first, torchtpu's own dispatch frames left out); the storage's
death is its free. XLA allocates per buffer with no caching pool, so each allocation is its own
segment of one block (what CUDA's allocator does for a fresh ``cudaMalloc``), and a free returns
the segment at once (``free_completed`` with a ``segment_free``).

A storage that was never written holds no device buffer yet, but it is counted from its
creation, as a CUDA tensor's memory is. Off (the default), recording costs one attribute read per
tensor made.
"""

from __future__ import annotations

import collections
import os
import pickle
import sys
import threading
import time
import traceback
import weakref
from typing import Any

import torch

recording = False  # read by tensors.py and storage.py on every storage they make
_lock = threading.Lock()
_live: dict[int, dict] = {}  # id(storage object) -> its block (address, size, frames, device)
_trace: collections.deque = collections.deque()
_settings = {"enabled": None, "context": "all", "max_entries": sys.maxsize}
_ENABLED = (None, "state", "all")
_CONTEXTS = (None, "state", "alloc", "all")
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# frames of these folders are torchtpu's own machinery between the user's call and the storage
_INTERNAL = tuple(os.path.join(_PACKAGE, d) + os.sep for d in ("device", "eager", "lowering",
                                                               "runtime"))
_LARGE = 1 << 20  # CUDA's allocator keeps allocations above 1 MB in its "large" pool


def record_memory_history(enabled: str | None = "all", context: str | None = "all",
                          stacks: str = "all", max_entries: int = sys.maxsize,
                          device: Any = None, clear_history: bool = False,
                          **ignored: Any) -> None:
    """Start (``"all"``: live state and every alloc/free; ``"state"``: live state only) or stop
    (``None``) recording, as ``torch.cuda.memory._record_memory_history`` does.

    ``context`` says which events keep their Python stacks (None, "state", "alloc", "all");
    ``stacks`` is accepted for CUDA's signature (there are no C++ frames to add); the history
    keeps the last ``max_entries`` events.
    """
    global recording, _trace
    if enabled not in _ENABLED:
        raise ValueError(f"torchtpu.argument: enabled={enabled!r} is not one of {_ENABLED}")
    if context not in _CONTEXTS:
        raise ValueError(f"torchtpu.argument: context={context!r} is not one of {_CONTEXTS}")
    if stacks not in ("python", "all"):
        raise ValueError(f"torchtpu.argument: stacks={stacks!r} is not 'python' or 'all'")
    if not isinstance(max_entries, int) or max_entries < 1:
        raise ValueError(f"torchtpu.argument: max_entries={max_entries!r} is not a positive int")
    with _lock:
        if clear_history or max_entries != _settings["max_entries"]:
            kept = () if clear_history else _trace
            _trace = collections.deque(kept, maxlen=min(max_entries, sys.maxsize))
        _settings.update(enabled=enabled, context=context, max_entries=max_entries)
        if enabled is None:
            _live.clear()
        recording = enabled is not None


def _frames() -> list[dict]:
    stack = traceback.extract_stack()
    return [{"filename": f.filename, "line": f.lineno, "name": f.name}
            for f in reversed(stack) if not f.filename.startswith(_INTERNAL)]


def _record(action: str, block: dict, with_frames: bool) -> None:
    if _settings["enabled"] != "all":
        return
    _trace.append({"action": action, "addr": block["address"], "size": block["size"],
                   "stream": 0, "time_us": time.time_ns() // 1000, "device": block["device"],
                   "frames": block["frames"] if with_frames else []})


def track(storage: torch.UntypedStorage) -> None:
    """Record ``storage`` (just made, with its final address) as an allocation."""
    context = _settings["context"]
    frames = _frames() if context is not None else []
    block = {"address": storage.data_ptr(), "size": storage.nbytes(), "frames": frames,
             "device": storage.device.index or 0}
    key = id(storage)
    with _lock:
        if not recording:
            return
        _live[key] = block
        _record("segment_alloc", block, context in ("alloc", "all"))
        _record("alloc", block, context in ("alloc", "all"))
    weakref.finalize(storage, _free, key, block)


def retrack(storage: torch.UntypedStorage) -> None:
    """``storage`` was given a new address range and size in place (a resize)."""
    with _lock:
        old = _live.get(id(storage))
    if old is not None:
        _free(id(storage), old)
    track(storage)


def _free(key: int, block: dict) -> None:
    with _lock:
        if _live.get(key) is not block:
            return  # recording restarted, or the storage was retracked since
        del _live[key]
        with_frames = _settings["context"] == "all"
        for action in ("free_requested", "free_completed", "segment_free"):
            _record(action, block, with_frames)


def snapshot(device: Any = None) -> dict:
    """The live allocations as segments, and the recorded history, in CUDA's snapshot format."""
    from torchtpu.runtime import platform

    count = platform.device_count()
    with _lock:
        live = list(_live.values())
        trace = list(_trace)
    with_frames = _settings["context"] is not None
    segments = [{
        "device": b["device"], "address": b["address"], "total_size": b["size"], "stream": 0,
        "segment_type": "large" if b["size"] > _LARGE else "small", "segment_pool_id": (0, 0),
        "allocated_size": b["size"], "active_size": b["size"], "requested_size": b["size"],
        "is_expandable": False, "frames": b["frames"] if with_frames else [],
        "blocks": [{"address": b["address"], "size": b["size"], "requested_size": b["size"],
                    "state": "active_allocated",
                    "frames": b["frames"] if with_frames else []}],
    } for b in sorted(live, key=lambda b: b["address"])]
    traces: list[list[dict]] = [[] for _ in range(count)]
    for entry in trace:
        traces[min(entry["device"], count - 1)].append(
            {k: v for k, v in entry.items() if k != "device"})
    return {"segments": segments, "device_traces": traces,
            "allocator_settings": {"PYTORCH_TPU_ALLOC_CONF": "xla: one buffer per allocation"}}


def dump_snapshot(filename: str = "dump_snapshot.pickle") -> None:
    """Write :func:`snapshot` as a pickle, the file ``torch.cuda._memory_viz`` and
    pytorch.org/memory_viz open."""
    with open(filename, "wb") as f:
        pickle.dump(snapshot(), f)


def largest(n: int = 5) -> list[dict]:
    """The ``n`` largest live recorded allocations (empty when recording is off)."""
    with _lock:
        live = list(_live.values())
    return sorted(live, key=lambda b: -b["size"])[:n]
