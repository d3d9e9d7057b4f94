"""A captured program that holds collectives: one SPMD program over their group's mesh.

Inside a capture (``torch.tpu.graph``, a whole-step ``torch.compile``) the XLA transport's
collectives run nothing either: the process group records each one as a call over the mesh
axis (``distributed/xla.py``, through ``Capture.record_spanning``), because its inputs are
values no rank has yet. Every rank records its own step, so the replay is one program per rank
of a single SPMD computation: ``Spanning`` runs it as a ``shard_map`` over the group's mesh
(the ``Spmd`` the group hands in; ``compile/spmd.py`` builds its pieces), each rank's storages
the shards of the global arguments and each rank keeping its shard of every result, exactly as
a compiled graph holding collectives runs.

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


def signature(collectives: list[str]) -> bytes:
    """What the ranks must agree on: the recorded collectives' descriptions, in order."""
    return hashlib.sha256("\n".join(collectives).encode()).digest()


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
