"""A captured program that holds collectives: one SPMD program over their group's mesh.

Inside a capture (``torch.tpu.graph``, a whole-step ``torch.compile``) the XLA transport's
collectives run nothing either: the process group records each one as a call over the mesh
axis (``distributed/xla.py``, through ``Capture.record_spanning``), because its inputs are
values no rank has yet. Every rank records its own step, so the replay is one program per rank
of a single SPMD computation: ``Spanning`` runs it as a ``shard_map`` over the group's mesh
(the ``Spmd`` the group hands in, ``eager/spmd.py``), each rank's storages
the shards of the global arguments and each rank keeping its shard of every result, exactly as
a compiled graph holding collectives runs.

A capture may span two groups that are the dims of one DeviceMesh (HSDP's replicate x shard,
FSDP x TP): ``join`` keeps them, outer dim first, and at the first run ``mesh_of`` builds the
2-D mesh (each row the inner group of one rank of the outer group, gathered in one header
exchange), each group's collectives running along its axis (``eager/spmd.axis_of``).

Collectives are merged as ``compile/spmd.combine`` merges a compiled graph's: recorded calls
that carry the same ``merge_key`` (the process group gives one to all-reduces, reduce-scatters
and all-gathers of one dtype and reduction) and whose inputs are all ready before any of their
results is used run as one collective over their concatenated values (the group's ``merge``),
up to ``BUCKET_BYTES`` each, placed just before the first use: a simple_fsdp step's one
all-gather per parameter becomes one, as do its reduce-scatters. A use by another mergeable
collective is looked through (HSDP's gradients go through two each), and so are buffer copies
(``_without_copies``), as long as the plan still runs every call after its inputs. An input
computed only from the step's arguments and earlier collectives counts as ready once those
are: the replay computes it early (FSDP2 copies each group's shards into its all-gather's
input right before that all-gather, after the previous group's result is used, so its 3
forward and 2 backward all-gathers of a 2-block model become one, as simple_fsdp's). The
program is pure, so only the order of tracing changes; XLA schedules by the data, and what a
merged all-gather holds lives from the first use to the last (up to ``BUCKET_BYTES`` a bucket:
within one bucket ``reshard_after_forward`` saves no memory). Each cross-process collective
costs a fixed latency (~2-3 ms on XLA:CPU), where one over the same bytes costs about one.

Before its first run every rank compares the program's collective signature (each recorded
collective's op, parameters, shape and dtype, in order) through ``Spmd.check``: ranks that
recorded different steps raise ``CollectiveMismatchError`` on every rank instead of deadlocking
inside XLA. Such a program is neither written to the persistent cache nor found by a warm key:
an executable spanning processes cannot be read back (``cache/compile_cache.spans_processes``).
"""

from __future__ import annotations

import dataclasses
import hashlib
from collections.abc import Callable

import jax
import numpy as np
from jax.sharding import Mesh

from torchtpu import metrics
from torchtpu.device import tensors
from torchtpu.eager.spmd import AXIS, BUCKET_BYTES, Spmd

# Set while a capture finishes: its program runs local stand-ins for its collectives
# (``distributed/xla._standin``), the same program otherwise; ``bench/sharded.py`` measures a
# sharded step against it, which tells what the collectives cost and whether XLA overlaps them.
LOCAL_COLLECTIVES = False


def _offsets(spmd: Spmd) -> tuple:
    return tuple(r - min(spmd.ranks) for r in spmd.ranks)


@dataclasses.dataclass(frozen=True)
class Joined:
    """A capture's collectives on two groups, each one dim of a 2-D mesh (HSDP's replicate x
    shard, FSDP x TP), outer dim first: the group whose ranks lie farther apart (HSDP's
    replicate group). Every rank orders them so: each group along a mesh dim has the same
    offsets between its ranks. The mesh itself is built at the first run (``mesh_of``)."""

    groups: tuple[Spmd, Spmd]

    def check(self, sig: bytes) -> None:
        """Within the outer group, then within the inner one: across the whole mesh."""
        for g in self.groups:
            g.check(sig)


def join(current, spmd: Spmd):
    """Where a capture whose collectives so far run where ``current`` says (None: none yet)
    runs once it holds one on spmd's group: spmd, ``current``, a ``Joined`` of two groups, or
    None when no 2-D mesh holds them (a third group; two that share more than this rank, or
    whose ranks lie alike)."""
    if current is None:
        return spmd
    known = current.groups if isinstance(current, Joined) else (current,)
    if any(g.mesh == spmd.mesh for g in known):
        return current
    if len(known) > 1 or len(set(current.ranks) & set(spmd.ranks)) != 1 \
            or _offsets(current) == _offsets(spmd):
        return None
    return Joined(tuple(sorted((current, spmd), key=_offsets, reverse=True)))


def mesh_of(joined: Joined) -> Spmd:
    """joined's 2-D Spmd, the same on every rank: row i is the inner group of the outer
    group's rank i, gathered over the outer group (one header exchange)."""

    outer, inner = joined.groups
    ids = [d.id for d in inner.mesh.devices.flat]
    column = [d.id for d in outer.mesh.devices.flat]
    (mine,) = set(ids) & set(column)
    rows = outer.gather(np.array(ids, np.int64))
    if rows[:, ids.index(mine)].tolist() != column or len(set(rows.flat)) != rows.size:
        raise ValueError(
            "torchtpu.capture: a captured program's collectives run on two groups that are not "
            f"the dims of one mesh (the rows {rows.tolist()} gathered over the group of "
            f"devices {column}): use the groups of one DeviceMesh")
    by_id = {d.id: d for d in jax.devices()}
    names = (f"{AXIS}0", f"{AXIS}1")
    mesh = Mesh(np.vectorize(by_id.get, otypes=[object])(rows), names)
    return Spmd(mesh=mesh, check=joined.check,
                axes=((outer.axes[0][0], names[0]), (inner.axes[0][0], names[1])))


def signature(collectives: list[str]) -> bytes:
    """What the ranks must agree on: the recorded collectives' descriptions, in order."""
    return hashlib.sha256("\n".join(collectives).encode()).digest()


def _collective(fn) -> bool:
    """Whether a recorded call is a collective (the process group's ``_Recorded``)."""
    return hasattr(fn, "merge_key")


def _timing(nodes: tuple, wanted: tuple, through: bool, hoist: bool) -> tuple[dict, dict]:
    """({collective's position: when its result is first needed}, {...: when its inputs are
    ready}). ``through``: a use by another mergeable collective does not count, that one's
    uses do, and an input from one counts as that one's inputs. HSDP's gradients go through
    two collectives each (across slices, then within one): without looking through, each
    one's result is used at once, so none would merge. ``hoist``: an input computed by calls
    that are no collectives is ready when the last collective it depends on is (the replay
    runs those calls early, when a merged collective needs them): FSDP2 copies each group's
    parameters into its all-gather's input right before that all-gather, after the previous
    group's result is used, though the copy reads only the sharded parameters."""
    chained = {i for i, (fn, _, _) in enumerate(nodes)
               if through and getattr(fn, "merge_key", None) is not None}
    first: dict = {n: len(nodes) for n, _ in wanted}
    for i in range(len(nodes) - 1, -1, -1):  # a node's uses come after it
        at = first.get(i, len(nodes) + 1) if i in chained else i
        for r in nodes[i][2]:
            if r.__class__ is not int:
                first[r[0]] = min(first.get(r[0], len(nodes) + 1), at)
    moved = chained | ({i for i, (fn, _, _) in enumerate(nodes) if not _collective(fn)}
                       if hoist else set())
    ready: dict = {}
    for i, (_, _, refs) in enumerate(nodes):
        ready[i] = max((ready[r[0]] if r[0] in moved else r[0] for r in refs
                        if r.__class__ is not int), default=-1)
    return {i: f for i, f in first.items() if f <= len(nodes)}, ready


def _buckets(nodes: tuple, wanted: tuple) -> dict:
    """{node position: the mergeable calls (lists of node positions, 2 or more) to run as one
    just before it, in an order that runs each before the calls that read its results};
    position len(nodes) is the end of the program. Plans are tried from the one that merges
    most (looking through chained collectives, hoisting inputs) to the one that merges least,
    which always has an order."""
    for through, hoist in ((True, True), (False, True), (True, False), (False, False)):
        due = _plan(nodes, wanted, through, hoist)
        if due is not None:
            return due
    raise AssertionError("spanning: no order for the collectives' buckets")


def _plan(nodes: tuple, wanted: tuple, through: bool, hoist: bool) -> dict | None:
    """One plan of ``_buckets``; None when it gives no order that runs each call after its
    inputs."""
    first_use, ready_at = _timing(nodes, wanted, through, hoist)
    open_: dict = {}   # merge key -> [members, bytes, position of the first use of any result]
    done = []
    for i, (fn, _, _) in enumerate(nodes):
        key = getattr(fn, "merge_key", None)
        if key is None or i not in first_use:
            continue
        bucket = open_.get(key)
        if bucket is None or ready_at[i] >= bucket[2] or bucket[1] + fn.nbytes > BUCKET_BYTES:
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
    return _ordered(nodes, due)


def _early(nodes: tuple, refs, have, blocked) -> list | None:
    """The calls to run now, in order, so that every ref in refs has a value: those not run yet
    (``have(j)`` false), each no collective (``blocked(j)`` false); None where a value needs
    a blocked one. Iterative: a chain of thousands of calls is common."""
    order: list = []
    added: set = set()
    stack = [r[0] for r in refs if r.__class__ is not int and not have(r[0])]
    while stack:
        j = stack[-1]
        if j in added or have(j):
            stack.pop()
            continue
        if blocked(j):
            return None
        missing = [r[0] for r in nodes[j][2] if r.__class__ is not int
                   and not have(r[0]) and r[0] not in added]
        if missing:
            stack.extend(missing)
        else:
            stack.pop()
            order.append(j)
            added.add(j)
    return order


def _ordered(nodes: tuple, due: dict) -> dict | None:
    """due with each position's buckets in an order that runs after its inputs, checked by
    walking the program as ``replay`` runs it (a merged call's inputs computed early where
    they are no collectives); None where some call would run before them."""
    merged = {m for buckets in due.values() for members in buckets for m in members}
    have: set = set()

    def blocked(j: int) -> bool:
        return j in merged or _collective(nodes[j][0])

    def runnable(members: list) -> bool:
        early = _early(nodes, [r for m in members for r in nodes[m][2]], have.__contains__,
                       blocked)
        if early is None:
            return False
        have.update(early)
        return True

    out: dict = {}
    for i in range(len(nodes) + 1):
        waiting = list(due.get(i, ()))
        while waiting:
            ready = [b for b in waiting if runnable(b)]
            if not ready:
                return None
            for b in ready:
                out.setdefault(i, []).append(b)
                have.update(b)
                waiting.remove(b)
        if i < len(nodes) and i not in merged and i not in have:
            if not all(r.__class__ is int or r[0] in have for r in nodes[i][2]):
                return None
            have.add(i)
    return out


def _without_copies(nodes: tuple, wanted: tuple) -> tuple[tuple, tuple, set]:
    """nodes and wanted with every read of a recorded buffer copy reading what was copied, and
    the copies' positions (not run: a copy of an immutable array is that array). A DTensor
    redistribution copies each collective's result before the next collective reads it, which
    would otherwise stand between the two and keep them apart."""
    copies: dict = {}
    out = []
    for i, (fn, tree, refs) in enumerate(nodes):
        refs = tuple(r if r.__class__ is int else copies.get(r, r) for r in refs)
        if fn is tensors.copy_buffer and tree is None and len(refs) == 1:
            copies[(i, 0)] = refs[0]
            refs = ()  # read by no one now, and not run
        out.append((fn, tree, refs))
    wanted = tuple(copies.get(w, w) for w in wanted)
    return tuple(out), wanted, {i for i, _ in copies}


def replay(nodes: tuple, wanted: tuple) -> Callable:
    """The captured step's function (every recorded call in order, returning the wanted
    outputs, as ``eager/defer.py``'s replay), with mergeable collectives merged. A merged
    collective's input computed by later calls runs those calls first (the program is pure:
    only the order of tracing changes; XLA schedules by the data)."""
    nodes, wanted, copies = _without_copies(nodes, wanted)
    due = _buckets(nodes, wanted)
    merged = {m for buckets in due.values() for members in buckets for m in members}
    skipped = merged | copies

    def captured_step(*inputs):
        values: list = [None] * len(nodes)

        def arg(r):
            return inputs[r] if r.__class__ is int else values[r[0]][r[1]]

        def run(i: int) -> None:
            fn, tree, refs = nodes[i]
            args = [arg(r) for r in refs]
            if tree is not None:
                args = tree.unflatten(args)
            values[i] = jax.tree_util.tree_leaves(fn(*args))

        def run_due(i: int) -> None:
            for members in due.get(i, ()):
                early = _early(nodes, [r for m in members for r in nodes[m][2]],
                               lambda j: values[j] is not None, merged.__contains__)
                for j in early:  # _ordered checked that these are no collectives
                    run(j)
                calls = [nodes[m][0] for m in members]
                outs = calls[0].merge(calls, [arg(nodes[m][2][0]) for m in members])
                for m, out in zip(members, outs, strict=True):
                    values[m] = [out]

        for i in range(len(nodes)):
            run_due(i)
            if i not in skipped and values[i] is None:
                run(i)
        run_due(len(nodes))
        return [arg(w) for w in wanted]

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
        self._run = None
        self._scalars: list = []
        self._jitted = None
        self._local = LOCAL_COLLECTIVES

    def _jit(self, args: tuple):
        if isinstance(self.spmd, Joined):
            self.spmd = mesh_of(self.spmd)
        if self._local and not self.spmd.local:
            self.spmd = dataclasses.replace(self.spmd, local=True)
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
            lowered = self._jit(args).lower(*self.spmd.to_global(args))
            self._compiled = self.spmd.compile(lowered)
            self._run = self.spmd.runner(self._compiled)
        metrics.count("collective_programs")
        return self._run(args, self._scalars)

    def hlo(self, args: tuple) -> str:
        """The program as StableHLO text (the whole SPMD computation)."""
        return self._jit(args).lower(*self.spmd.to_global(args)).as_text()
