"""The CPU step counts of a default (``capturable=False``) optimizer that a whole step advances.

Such an optimizer keeps one 0-dim CPU tensor ``state["step"]`` per parameter. A whole step
(``compile/whole_step.py``) runs it on device twins of those counts, which its program advances,
and must advance the CPU counts too (eager code, ``state_dict()`` and the user read them), and
notice when they moved outside the compiled step (an eager ``opt.step()``, a load) to refill the
twins. One ``item()`` and one element of ``_foreach_add_`` per count cost ~1.7 µs each on the
CPU (140 µs a call for an 80-parameter AdamW, half the JAX twin's whole step).

So ``StepCounts`` makes the counts views of one CPU buffer per (step() calls per replay, dtype):
each count stays the same tensor object (``Tensor.set_`` re-points its storage; the optimizer's
guards compare identities), with its value, and reading all of them is one ``tolist()``,
advancing them one ``add_``. Writes to a single count (an eager step's ``step += 1``) land in
its element of the buffer, where the next call reads them. Another captured step of the same
optimizer (another signature) re-points the counts to its own buffer: each call first checks
that its counts still view its buffer (one C-level pass over their storages) and else takes
them back, with the values the other step left.
"""

from __future__ import annotations

import itertools
import operator

import torch

_STORAGE = torch.Tensor.untyped_storage


class StepCounts:
    """CPU counts and their device twins: read, refilled and advanced once per call."""

    def __init__(self, counts: list) -> None:
        """counts: (CPU count, its device twin, ``step()`` calls per replay) for each count."""
        by_kind: dict = {}
        for cpu, dev, n in counts:
            by_kind.setdefault((n, cpu.dtype), []).append((cpu, dev))
        self._groups = [(n, dtype, [cpu for cpu, _ in pairs])
                        for (n, dtype), pairs in by_kind.items()]
        self._twins = [dev for pairs in by_kind.values() for _, dev in pairs]  # buffer order
        self._buffers: list = []   # (buffer, its storage, step() calls per replay)
        self._adopt()
        self._expected = self._read()  # what the twins hold

    def _adopt(self) -> None:
        """Make the counts views of buffers of this object's own, keeping their values."""
        self._buffers = []
        with torch.no_grad():
            for n, dtype, cpus in self._groups:
                buffer = torch.tensor([cpu.item() for cpu in cpus], dtype=dtype)
                storage = buffer.untyped_storage()
                for k, cpu in enumerate(cpus):
                    cpu.set_(storage, k, (), ())
                self._buffers.append((buffer, storage, n))

    def _owned(self) -> bool:
        return all(all(map(operator.is_, map(_STORAGE, cpus), itertools.repeat(storage)))
                   for (_, _, cpus), (_, storage, _) in zip(self._groups, self._buffers))

    def _read(self) -> list:
        return [v for buffer, _, _ in self._buffers for v in buffer.tolist()]

    def before_replay(self) -> None:
        """Refill each twin whose CPU count moved outside the compiled step."""
        if not self._buffers:
            return
        if not self._owned():  # another step of this optimizer took them
            self._adopt()
        now = self._read()
        if now != self._expected:
            for dev, v, e in zip(self._twins, now, self._expected, strict=True):
                if v != e:
                    dev.fill_(v)

    def after_replay(self) -> None:
        """Advance the CPU counts as the replay advanced the twins."""
        if not self._buffers:
            return
        for buffer, _, n in self._buffers:
            if n:
                buffer.add_(n)
        self._expected = self._read()
