"""Facts about calls kept across processes for warm starts: the result shapes of recorded
calls, and the meta results of eager op calls.

Recording a call (DeferAndFuse, a capture) needs its result shapes and dtypes before anything
runs; a call's first recording in a process finds them with ``jax.eval_shape``, which traces the
lowering: tens of milliseconds per op, most of a warm capture. An eager op call's first
signature in a process runs PyTorch's meta kernel (``meta.infer``) and asks CPU whether it takes
the dtypes (``refusals``): ~0.5 ms each, ~300 of them in a warm GRPO step's first step. Both are
facts about a stable key (``cache/warm.py``: an op's name and spec, a view geometry, an op and
its call key), so a process keeps them in a record of the cache directory per kind, read once,
when the first call misses, and written back when a capture finishes, at exit, and on the way:
with each new program's index entry (``warm.on_program_written``) and every ``FLUSH_FACTS`` new
facts. A process killed after its first step (the chip's first GRPO try, past its time limit)
left its programs by key but not the ~400 result shapes of its recordings, written at exit
only: the next process traced each recorded call again (513 traces at its step 1). The writes
run on the cache's writer thread (``cache/cache_writer.py``), which the compiling thread only
hands them to; a steady step, which learns nothing and builds nothing, writes nothing.
"""

from __future__ import annotations

import atexit
import hashlib
import os
import threading

import jax
import torch

from torchtpu import errors
from torchtpu.cache import warm, warm_keys
from torchtpu.cache.cache_writer import WRITES

MAX_FACTS = 20000  # ~200 bytes each in a record
# New facts written without waiting for a program (each write rewrites the whole record)
FLUSH_FACTS = 256


class Facts:
    """One record of facts, keyed by the hash of a stable text."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._lock = threading.Lock()
        self._known: dict | None = None  # text hash -> fact, read from the record
        self._new: dict = {}  # facts learned here, not yet written
        self._exit_pid: int | None = None
        self._queued_pid: int | None = None  # a write handed to the writer, not yet begun

    def get(self, text: str):
        with self._lock:
            if self._known is None:
                key = warm_keys.key_of(self.name)
                self._known = (warm.read_record("shapes", key) if key is not None else None) or {}
            return self._known.get(text) or self._new.get(text)

    def learned(self, text: str, fact, at_exit: bool = False) -> None:
        """Keep fact; at_exit: write it when the process ends, if no save comes first."""
        with self._lock:
            if len(self._new) >= MAX_FACTS:  # (calls keyed by changing numbers: the record's bound)
                return
            self._new[text] = fact
            if at_exit and self._exit_pid != os.getpid():  # (a forked child: its own hook)
                self._exit_pid = os.getpid()
                atexit.register(self._save_here, self._exit_pid)
            bound = len(self._new) >= FLUSH_FACTS
        if bound:
            self.save_soon()

    def save_soon(self) -> None:
        """Hand a ``save`` of the facts learned so far to the cache's writer thread (one at a
        time: those learned before it begins go with it)."""
        with self._lock:
            if not self._new or self._queued_pid == os.getpid():
                return  # (a forked child's flag is its parent's: it queues its own)
            if not WRITES.begin():
                return  # exiting: the exit hook saves
            self._queued_pid = os.getpid()
        WRITES.submit(f"facts {self.name}", 0, self._save_queued)

    def _save_queued(self) -> None:
        with self._lock:
            self._queued_pid = None
        self.save()

    def _save_here(self, pid: int) -> None:
        if os.getpid() == pid:
            self.save()

    def save(self) -> None:
        """Write the facts learned since the last save into the record (merged with what
        another process may have written meanwhile; a lost race only costs a trace next time)."""
        with self._lock:
            if not self._new:
                return
            new = dict(self._new)
            self._new.clear()
        key = warm_keys.key_of(self.name)
        if key is None:
            return
        merged = warm.read_record("shapes", key) or {}
        merged.update(new)
        if len(merged) > MAX_FACTS:  # the oldest go first (many shapes of DeferAndFuse recordings)
            merged = dict(list(merged.items())[-MAX_FACTS:])
        warm.write_record("shapes", key, merged)
        with self._lock:
            if self._known is not None:
                self._known.update(new)


SHAPES = Facts("result shapes")
META = Facts("meta results")


def _program_written() -> None:
    SHAPES.save_soon()
    META.save_soon()


warm.on_program_written(_program_written)


def text_of(*parts) -> str | None:
    """The hash of parts' stable text, or None if some part has none."""
    try:
        text = warm_keys.canonical(parts)
    except warm_keys.Unstable:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def shapes(fn, tree, sig: tuple, call_args) -> tuple:
    """(avals, out tree, whether the result is one array) of fn applied to call_args, which
    have the signature sig."""
    text = text_of(fn, tree, sig) if warm.cache_on() else None
    if text is not None:
        fact = SHAPES.get(text)
        if fact is not None:
            try:
                return _unpack(fact)
            except (KeyError, TypeError, ValueError):
                pass  # a damaged fact: traced below and written again
    avals, out_tree = jax.tree_util.tree_flatten(jax.eval_shape(fn, *call_args))
    if text is not None:
        try:
            fact = [[warm.encode_aval(a) for a in avals], warm.encode_tree(out_tree)]
        except warm_keys.Unstable:
            fact = None
        if fact is not None:
            # (at exit too: a DeferAndFuse run finishes no capture, and its next process would
            # trace every recorded call's lowering again to learn its shapes)
            SHAPES.learned(text, fact, at_exit=True)
    return avals, out_tree, out_tree == jax.tree_util.tree_structure(0)


def _unpack(fact) -> tuple:
    out_tree = warm.decode_tree(fact[1])
    return ([warm.decode_aval(a) for a in fact[0]], out_tree,
            out_tree == jax.tree_util.tree_structure(0))


def save() -> None:
    """Write both records' new facts (a capture has finished)."""
    SHAPES.save()
    META.save()


# ----------------------------------------------------------------------------- meta results

MISSING = object()


def meta_result(text: str | None):
    """A meta result (``meta.describe``'s form) another process found for text, or MISSING."""
    fact = META.get(text) if text is not None else None
    if fact is None:
        return MISSING
    try:
        return _decode_meta(fact)
    except (KeyError, TypeError, ValueError, AttributeError):
        return MISSING  # a damaged fact: inferred again and written again


def keep_meta_result(text: str | None, result) -> None:
    if text is not None:
        try:
            fact = _encode_meta(result)
        except TypeError:
            return
        META.learned(text, fact, at_exit=True)


def _encode_meta(r):
    if r is None:
        return None
    if type(r) is int:
        return {"i": r}
    if type(r) is tuple and len(r) in (2, 3) and isinstance(r[1], torch.dtype):
        extra = r[2] if len(r) == 3 else None
        if isinstance(extra, torch.memory_format):
            extra = {"f": str(extra).removeprefix("torch.")}
        elif extra is not None:
            extra = list(extra)
        return {"d": [list(r[0]), str(r[1]).removeprefix("torch."), extra]}
    if type(r) is tuple:
        return [_encode_meta(x) for x in r]
    raise TypeError(errors.message("cache", f"a meta result of type {type(r).__name__}"))


def _decode_meta(e):
    if e is None:
        return None
    if isinstance(e, list):
        return tuple(_decode_meta(x) for x in e)
    if "i" in e:
        return int(e["i"])
    shape, dtype, extra = e["d"]
    dtype = getattr(torch, dtype)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(errors.message("cache", f"not a dtype: {dtype}"))
    out = (tuple(shape), dtype)
    if isinstance(extra, dict):
        fmt = getattr(torch, extra["f"])
        if not isinstance(fmt, torch.memory_format):
            raise ValueError(errors.message("cache", f"not a memory format: {fmt}"))
        return (*out, fmt)
    return out if extra is None else (*out, tuple(extra))
