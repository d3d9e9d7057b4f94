"""A captured program that holds collectives: one SPMD program over their group's mesh.

Inside a capture (``torch.tpu.graph``, a whole-step ``torch.compile``) the XLA transport's
collectives run nothing either: the process group records each one as a call over the mesh
axis (``distributed/xla.py``, through ``Capture.record_spanning``), because its inputs are
values no rank has yet. Every rank records its own step, so the replay is one program per rank
of a single SPMD computation: ``Spanning`` runs it as a ``shard_map`` over the group's mesh
(the ``Spmd`` the group hands in; ``compile/spmd.py`` builds its pieces), each rank's storages
the shards of the global arguments and each rank keeping its shard of every result, exactly as
a compiled graph holding collectives runs.

Collectives are merged as ``compile/spmd.combine`` merges a compiled graph's: recorded calls
that carry the same ``merge_key`` (the process group gives one to all-reduces, reduce-scatters
and all-gathers of one dtype and reduction) and whose inputs are all ready before any of their
results is used run as one collective over their concatenated values (the group's ``merge``),
up to ``BUCKET_BYTES`` each, placed just before the first use: a simple_fsdp step's one
all-gather per parameter becomes one, as do its reduce-scatters. Each cross-process collective
costs a fixed latency (~2-3 ms on XLA:CPU), where one over the same bytes costs about one.

Before its first run every rank compares the program's collective signature (each recorded
collective's op, parameters, shape and dtype, in order) through ``Spmd.check``: ranks that
recorded different steps raise ``CollectiveMismatchError`` on every rank instead of deadlocking
inside XLA. Such a program is neither written to the persistent cache nor found by a warm key:
an executable spanning processes cannot be read back (``runtime/compile_cache.spans_processes``).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable

import jax

from torchtpu import metrics

# The most bytes one merged collective moves (the figure compile/spmd.py uses).
BUCKET_BYTES = 64 << 20


def signature(collectives: list[str]) -> bytes:
    """What the ranks must agree on: the recorded collectives' descriptions, in order."""
    return hashlib.sha256("\n".join(collectives).encode()).digest()


def _buckets(nodes: tuple, wanted: tuple) -> dict:
    """{node position: the mergeable calls (lists of node positions, 2 or more) to run as one
    just before it}; position len(nodes) is the end of the program."""
    first_use: dict = {}
    for i, (_, _, refs) in enumerate(nodes):
        for r in refs:
            if r.__class__ is not int:
                first_use.setdefault(r[0], i)
    for n, _ in wanted:
        first_use.setdefault(n, len(nodes))
    open_: dict = {}   # merge key -> [members, bytes, position of the first use of any result]
    done = []
    for i, (fn, _, refs) in enumerate(nodes):
        key = getattr(fn, "merge_key", None)
        if key is None or i not in first_use:
            continue
        ready = max((r[0] for r in refs if r.__class__ is not int), default=-1)
        bucket = open_.get(key)
        if bucket is None or ready >= bucket[2] or bucket[1] + fn.nbytes > BUCKET_BYTES:
            if bucket is not None:
                done.append(bucket[0])
            bucket = open_[key] = [[], 0, first_use[i]]
        bucket[0].append(i)
        bucket[1] += fn.nbytes
        bucket[2] = min(bucket[2], first_use[i])
    done.extend(b[0] for b in open_.values())
    due: dict = {}
    for members in done:
        if len(members) > 1:
            due.setdefault(min(first_use[m] for m in members), []).append(members)
    return due


def replay(nodes: tuple, wanted: tuple) -> Callable:
    """The captured step's function (every recorded call in order, returning the wanted
    outputs, as ``eager/defer.py``'s replay), with mergeable collectives merged."""
    due = _buckets(nodes, wanted)
    merged = {m for buckets in due.values() for members in buckets for m in members}

    def captured_step(*inputs):
        values: list = [None] * len(nodes)

        def arg(r):
            return inputs[r] if r.__class__ is int else values[r[0]][r[1]]

        def run_due(i: int) -> None:
            for members in due.get(i, ()):
                calls = [nodes[m][0] for m in members]
                outs = calls[0].merge(calls, [arg(nodes[m][2][0]) for m in members])
                for m, out in zip(members, outs, strict=True):
                    values[m] = [out]

        for i, (fn, tree, refs) in enumerate(nodes):
            run_due(i)
            if i in merged:
                continue
            args = [arg(r) for r in refs]
            if tree is not None:
                args = tree.unflatten(args)
            values[i] = jax.tree_util.tree_leaves(fn(*args))
        run_due(len(nodes))
        return [values[n][leaf] for n, leaf in wanted]

    return captured_step


class Spanning:
    """The replay of a capture that holds collectives (see the module doc); called as the
    single-process program would be, with this rank's arrays, returning this rank's results."""

    def __init__(self, spmd, replay: Callable, donate: tuple, collectives: list[str]) -> None:
        self.spmd = spmd
        self._replay = replay
        self._donate = donate
        self.collectives = len(collectives)
        self._signature: bytes | None = signature(collectives)
        self._compiled = None
        self._scalars: list = []
        self._jitted = None

    def _jit(self, args: tuple):
        if self._jitted is None:
            body, self._scalars = self.spmd.body(self._replay, args)
            self._jitted = jax.jit(body, donate_argnums=self._donate)
        return self._jitted

    def __call__(self, *args) -> list:
        if self._signature is not None:
            # Before anything runs: a rank with other collectives raises here, on every rank.
            self.spmd.check(self._signature)
            self._signature = None
        if self._compiled is None:
            self._compiled = self.spmd.compile(self._jit(args).lower(*self.spmd.to_global(args)))
        metrics.count("collective_programs")
        return self.spmd.to_local(list(self._compiled(*self.spmd.to_global(args))),
                                  self._scalars)

    def hlo(self, args: tuple) -> str:
        """The program as StableHLO text (the whole SPMD computation)."""
        return self._jit(args).lower(*self.spmd.to_global(args)).as_text()
