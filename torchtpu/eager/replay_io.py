"""What a captured program's replay reads and writes, at one identity compare per storage.

A ``Captured`` program (``eager/capture.py``) reads storages (parameters, gradients, optimizer
state, static inputs) and rebinds the storages it writes. Checking each storage's array against
the captured shape and dtype costs two Python properties per storage (~0.8 µs each; an
80-parameter AdamW step reads 321 storages), so ``ReplayIO`` remembers, for each storage it
reads, the array the storage held when the last replay left it: the array it read there, or the
array that replay wrote into it when that output has the storage's captured shape and dtype. A
storage still holding that very array (``is``: the array is kept alive by this record, so its
identity cannot be another array's) needs no check; any other array (written by eager code since,
a ``copy_`` into a static input, a DeferAndFuse value still pending) is checked as before by
``storage_input``, alone, and remembered again.

Writing: each written storage is rebound to its output. A program that hands an input back, or
one array as two outputs, would leave two storages sharing one buffer that a later donation
deletes; whether it does is a property of the program, so the first replay checks every result
(as every replay did before) and later ones repeat its answer.
"""

from __future__ import annotations

import collections
import itertools
import operator

import numpy as np

from torchtpu.device import ownership, tensors
from torchtpu.device.views import _bitcast_flat

STORAGE = "storage"   # the array a storage holds at replay
KEY = "key"           # key data drawn from a generator at replay
FED = "fed"           # the value a function returns at replay
CONST = "const"       # the value seen at capture

_ARRAY = operator.attrgetter("_tpu_array")


class CaptureError(RuntimeError):
    """Something inside a capture that a replay could not repeat (``eager/capture.py``)."""


def storage_input(st, sig: tuple):
    """The array storage st gives a program that captured it as sig = (shape, dtype)."""
    a = st._tpu_array
    if isinstance(a, ownership.Deferred):
        a = st._tpu_array = a.materialize()  # written by DeferAndFuse since: run it now
    if a is None or a.shape != sig[0] or a.dtype != sig[1]:
        if a is not None and a.nbytes == np.prod(sig[0], dtype=int) * np.dtype(sig[1]).itemsize:
            # The same bytes, last written through another shape or dtype (a storage read
            # through a view at capture holds its raw bytes).
            return _bitcast_flat(a.reshape(-1), np.dtype(sig[1])).reshape(sig[0])
        raise CaptureError(
            "torchtpu.capture: a storage the captured program reads no longer holds a value of the "
            f"captured shape and dtype ({sig[0]}, {sig[1]}; it holds "
            f"{None if a is None else (a.shape, a.dtype)}); capture again")
    return a


class ReplayIO:
    """A captured program's sources and targets, read and written with the checks it needs."""

    def __init__(self, sources: list, targets: list, avals: list) -> None:
        self.sources = sources
        reads = [(i, st, sig) for i, (kind, st, sig) in enumerate(sources) if kind is STORAGE]
        self._storages = [st for _, st, _ in reads]
        self._sigs = [sig for _, _, sig in reads]
        # Where the storage arrays go in the argument list: the storage inputs in order, with
        # the other sources (keys, fed values, constants: a few) put in at their positions.
        self._storage_first = len(reads) == len(sources)
        self._others = [(i, kind, x) for i, (kind, x, _) in enumerate(sources)
                        if kind is not STORAGE]
        # host values the program's call transfers (a packed feed's values are one)
        self.fed = sum(kind is FED for kind, _, _ in sources)
        # What each storage held when the last replay left it (None: check it next time).
        self._known: list = [None] * len(reads)
        self._flat_targets = [st for sts in targets for st in sts]
        self._flat_outputs = [k for k, sts in enumerate(targets) for _ in sts]
        self._pick = operator.itemgetter(*self._flat_outputs) if self._flat_targets else None
        # For each storage read: the output written to it when that output has its captured
        # shape and dtype, so that what the replay leaves there is known to be right.
        writer = {id(st): k for k, sts in enumerate(targets) for st in sts}
        self._refresh = []
        for j, (_, st, sig) in enumerate(reads):
            k = writer.get(id(st))
            if k is not None and avals[k] == (tuple(sig[0]), np.dtype(sig[1])):
                self._refresh.append((j, k))
        self._refresh_reads = [j for j, _ in self._refresh]
        self._refresh_outputs = [k for _, k in self._refresh]
        # Storages read and written with another shape or dtype: what they held is gone.
        self._forget = [j for j, (_, st, _) in enumerate(reads)
                        if id(st) in writer and j not in set(self._refresh_reads)]
        self._shares = None  # whether results may share buffers with arguments: first replay

    def arguments(self, bind: dict | None = None) -> list:
        """The program's arguments now: each storage's array (checked unless it is the one the
        last replay left there), a key drawn, a fed value, a constant."""
        if bind:
            return self._checked_arguments(bind)
        arrays = list(map(_ARRAY, self._storages))
        known = self._known
        if not all(map(operator.is_, arrays, known)):
            sigs, storages = self._sigs, self._storages
            for j in itertools.compress(range(len(arrays)),
                                        map(operator.is_not, arrays, known)):
                a = storage_input(storages[j], sigs[j])
                arrays[j] = a
                # A converted array (bitcast from raw bytes) is not what the storage holds.
                known[j] = a if a is storages[j]._tpu_array else None
        if self._storage_first:
            return arrays
        for i, kind, x in self._others:
            arrays.insert(i, x.next_key_data() if kind is KEY else x() if kind is FED else x)
        return arrays

    def _checked_arguments(self, bind: dict) -> list:
        args = []
        for kind, x, sig in self.sources:
            if kind is STORAGE:
                a = bind.get(id(x))
                args.append(storage_input(x, sig) if a is None else a)
            elif kind is KEY:
                args.append(x.next_key_data())
            elif kind is FED:
                args.append(x())
            else:
                args.append(x)
        self._known = [None] * len(self._storages)  # bound arrays are not the storages'
        return args

    def store(self, args: list, results) -> None:
        """Rebind each written storage to its result; remember what the storages now hold."""
        if not self._flat_targets:
            return
        picked = self._pick(results)
        values = list(picked) if len(self._flat_targets) > 1 else [picked]
        if self._shares is not False:
            self._shares = self._separate(args, values)
        collections.deque(map(setattr, self._flat_targets, itertools.repeat("_tpu_array"),
                              values), maxlen=0)
        known = self._known
        for j in self._forget:
            known[j] = None
        if self._refresh:
            for j, k in zip(self._refresh_reads, self._refresh_outputs):
                known[j] = results[k]
            if self._shares:
                # (a result copied for a second storage is not results[k])
                for j in self._refresh_reads:
                    known[j] = None

    @staticmethod
    def _separate(args: list, values: list) -> bool:
        """Copy each value that is an argument or an earlier value (a storage never shares its
        buffer); whether any was."""
        seen = {id(a) for a in args}
        shared = False
        for n, r in enumerate(values):
            if id(r) in seen:
                values[n] = r = tensors.copy_buffer(r)
                shared = True
            seen.add(id(r))
        return shared
