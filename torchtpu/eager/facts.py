"""The result shapes of recorded calls, kept across processes for warm starts.

Recording a call (DeferAndFuse, a capture) needs its result shapes and dtypes before anything
runs; a call's first recording in a process finds them with ``jax.eval_shape``, which traces the
lowering: tens of milliseconds per op, most of a warm capture. They are facts about the call's
function and argument signature, so a process keeps the ones whose function has a stable key
(``runtime/warm.py``: an op's name and spec, a view geometry) in one record of the cache
directory, read once, when the first call misses, and written back when a capture finishes.
"""

from __future__ import annotations

import hashlib
import threading

import jax

from torchtpu.runtime import warm

MAX_FACTS = 20000  # ~200 bytes each in the record

_lock = threading.Lock()
_known: dict | None = None   # text hash -> [avals, out tree], read from the record
_new: dict = {}              # facts learned here, not yet written


def _record_key() -> str | None:
    return warm.key_of("result shapes")


def _text(fn, tree, sig) -> str | None:
    try:
        text = warm.canonical((fn, tree, sig))
    except warm.Unstable:
        return None
    return hashlib.sha256(text.encode()).hexdigest()


def _load() -> dict:
    global _known
    if _known is None:
        key = _record_key()
        _known = (warm.read_record("shapes", key) if key is not None else None) or {}
    return _known


def shapes(fn, tree, sig: tuple, call_args) -> tuple:
    """(avals, out tree, whether the result is one array) of fn applied to call_args, which
    have the signature sig."""
    text = _text(fn, tree, sig) if warm.cache_on() else None
    if text is not None:
        with _lock:
            fact = _load().get(text) or _new.get(text)
        if fact is not None:
            try:
                return _unpack(fact)
            except (KeyError, TypeError, ValueError):
                pass  # a damaged fact: traced below and written again
    avals, out_tree = jax.tree_util.tree_flatten(jax.eval_shape(fn, *call_args))
    if text is not None:
        try:
            fact = [[warm.encode_aval(a) for a in avals], warm.encode_tree(out_tree)]
        except warm.Unstable:
            fact = None
        if fact is not None:
            with _lock:
                _new[text] = fact
    return avals, out_tree, out_tree == jax.tree_util.tree_structure(0)


def _unpack(fact) -> tuple:
    out_tree = warm.decode_tree(fact[1])
    return ([warm.decode_aval(a) for a in fact[0]], out_tree,
            out_tree == jax.tree_util.tree_structure(0))


def save() -> None:
    """Write the facts learned since the last save into the record (merged with what another
    process may have written meanwhile; a lost race only costs a trace next time)."""
    with _lock:
        if not _new:
            return
        new = dict(_new)
        _new.clear()
    key = _record_key()
    if key is None:
        return
    merged = warm.read_record("shapes", key) or {}
    merged.update(new)
    if len(merged) > MAX_FACTS:  # the oldest go first (many shapes of DeferAndFuse recordings)
        merged = dict(list(merged.items())[-MAX_FACTS:])
    warm.write_record("shapes", key, merged)
    with _lock:
        _load().update(new)
