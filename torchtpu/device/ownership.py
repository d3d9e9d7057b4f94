"""Who holds a device storage's buffer, and whether it may be given away.

A storage normally holds its own computed JAX array (``tensors``). Here is everything else it may
hold, and the rules for donating its buffer: ``Deferred``, a value a deferring executor recorded
but may not have computed yet; ``Consumed``, what is left once the buffer was donated
(``consume``); lending (``lend``), which keeps a buffer another thread reads in place from being
donated; and ``donation_refusal``, why a call may not take a tensor's buffer.
"""

from __future__ import annotations

import collections
import functools

import torch

from torchtpu import errors
from torchtpu.device.hooks import HOOKS


class Deferred:
    """A value a deferring executor (``eager/defer.py``) recorded but may not have computed yet.

    A storage may hold one in place of its array; reading the storage swaps in the computed
    array once there is one.
    """

    __slots__ = ()
    # Whether a program reads a tensor that is all of this value (its shape and dtype, from
    # the storage's start) as the value itself: a recorded result knows its ``shape`` and
    # ``dtype`` and is what the recording takes; a padded or lazily converted one is not.
    whole_is_itself = False

    def resolve(self):
        """The computed array, or self while still pending."""
        raise NotImplementedError


class Consumed(Deferred):
    """What a storage holds once its buffer was donated (``consume``): reading it is an error
    naming who took the buffer; writing the tensor whole gives it a value again."""

    __slots__ = ("by",)

    def __init__(self, by: str) -> None:
        self.by = by

    def resolve(self):
        raise RuntimeError(errors.message(
            "argument", f"this tpu tensor was donated to {self.by} and its buffer reused, so it "
            "holds no value; use that call's results, or write the tensor whole (t.copy_(...)) "
            "before reading it again"))


def is_materialized(t: torch.Tensor) -> bool:
    """Whether device tensor t's value exists on the device rather than pending in a recording."""
    array = t.untyped_storage()._tpu_array
    return not (isinstance(array, Deferred) and array.resolve() is array)


def consume(t: torch.Tensor, by: str) -> None:
    """Give up t's storage buffer (donated to ``by``): every tensor on the storage reads as an
    error (``Consumed``) until the storage is written whole."""
    t.untyped_storage()._tpu_array = Consumed(by)


# ids of arrays read later, with how many readers do: by a collective in place on another
# thread (``distributed/host.py``), or by Strict's held values (``eager/lazy_casts.py``), which
# read them when they are computed. A view write (``tensors.write``) and a captured replay copy
# such a storage instead of donating its buffer, which the reader would otherwise see reused
# under it; a donating op computes the held values first (``still_lent``). (DeferAndFuse and
# compiled graphs donate only arrays nothing else references, and the reader holds a reference.)
lent: dict[int, int] = {}


def lend(array) -> None:
    """Keep array's buffer from being donated until ``unlend``; array must stay referenced."""
    lent[id(array)] = lent.get(id(array), 0) + 1


def unlend(array) -> None:
    n = lent.pop(id(array)) - 1
    if n:
        lent[id(array)] = n


# ``lend`` of each array whose id is given (``lend_ids(map(id, arrays))``: a held value's
# sources, ~2,900 a 12-layer Llama step): C's counting loop adds 1 to each, under the GIL, with
# no Python frame (a call each was 4 Python calls an array; a loop here, a frame a held value).
lend_ids = functools.partial(collections._count_elements, lent)


def unlend_all(arrays: list) -> None:
    """``unlend`` of each of arrays."""
    pop = lent.pop
    for k in map(id, arrays):
        n = pop(k) - 1
        if n:
            lent[k] = n


def still_lent(array) -> bool:
    """Whether array is lent to a reader that must be waited for. Strict's held values reading
    it (``HOOKS.settle_readers``) are computed first, which gives their loans back: each would
    be computed at its first reader anyway, and the call donating the buffer cannot wait for
    that. A collective's loan stays until its ``wait()``."""
    if id(array) not in lent:
        return False
    settle = HOOKS.settle_readers
    if settle is not None:
        settle(array)
    return id(array) in lent


def donation_refusal(t: torch.Tensor, param: str, call_tensors: list) -> str | None:
    """Why t's buffer cannot be given away by a call taking call_tensors, or None if it can:
    nothing else may be able to see it (``kernels/donation.py``)."""
    held = t.untyped_storage()._tpu_array
    # The buffer is the array a computed deferred value holds (DeferAndFuse's, which the
    # storage may still hold), the one its readers borrowed: not the value object.
    array = held.resolve() if isinstance(held, Deferred) and type(held) is not Consumed \
        else held
    if still_lent(array):
        return ("a collective still reads it (async_op=True); wait() for its Work before "
                "donating the tensor")
    if t.requires_grad:
        return ("it requires grad, and autograd may need its value in backward; donate a "
                "tensor that does not require grad (or drop donate_argnums)")
    st = t.untyped_storage()
    # PyTorch's count includes the storage's own Python object, which holds one.
    others = torch._C._storage_Use_Count(st._cdata) - 2
    if others > 0:
        return (f"{others} other live tensor(s) share its storage (views, detach(), .data), "
                "and they would lose their value; delete them first, or donate a copy "
                f"({param}.clone()) if they must live")
    if sum(a.untyped_storage().data_ptr() == st.data_ptr() for a in call_tensors) > 1:
        return "the same storage is passed in another argument of this call too"
    if HOOKS.capture is not None:
        return ("it is used inside a graph capture, whose replays could not repeat the "
                "donation; drop donate_argnums for captured code")
    return None
