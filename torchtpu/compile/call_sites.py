"""Where an eager call's sizes vary: families of call sites (``eager_buckets`` pads their calls).

A call's *structure* (the op, its static spec, its tensors' dtypes and ranks) at its call site
(the innermost Python frame outside PyTorch and torchtpu's machinery) is a *family*, which
remembers a few of the values each size (a tensor dim, an integer argument) took there; a size
that took ``VARYING_VALUES`` distinct values is *varying*.

Families are keyed by call site and by the object of the method the call is in, or of the
nearest method calling it (a generator expression in ``forward``, a helper it calls): another
model built from the same class starts families of its own, so the sizes one model took at a
shared line do not make another's fixed sizes look varying. An object is known by its identity
while it lives: one built later at a dead one's address starts afresh, and a dead object's
families are dropped (a test suite or a sweep builds model after model in one process: their
sizes made a later model's sites look varying, and DeferAndFuse then cut each of its calls).
The blocks of one model are such objects too, and ``eager_buckets`` looks at a call only at
sizes it did not run before: the first block to run a length runs it for all, and the other
blocks' families would not see the lengths before the first block's varied (a program per length
for each of them until their own did). So a site first seen while another site of the same
structure varies, at that site's latest sizes (the same step of the same loop), varies from its
first call; ``grows`` tells ``eager_buckets`` to look again at calls of such a structure.
"""

from __future__ import annotations

import itertools
import os
import sys
import weakref

import torch

from torchtpu.device.hooks import HOOKS
from torchtpu.eager import meta

VARYING_VALUES = 4
SITE_FRAMES = 1
OWNER_FRAMES = 8  # how far out from a site its method's object is looked for
_families: dict = {}  # (call structure, call site) -> Family
_growing: dict = {}   # call structure -> the live family of it that last noted varying sizes
_grown: dict = {}     # call structures that varied at some site, live or dead
_owners: dict = {}    # id of a live owner -> (weak reference to it, its token)
_tokens = itertools.count(1)
_dead: list = []      # tokens of owners that died since the last call looked
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# errors.py wraps the host reads' kernels (copy_, _to_copy, item): as a site, its one line would
# gather every conversion of the process into one family, whose sizes and views soon "vary".
_MACHINERY = tuple(os.path.join(_PACKAGE, d) + os.sep
                   for d in ("eager", "device", "compile", "lowering", "runtime")) + (
    os.path.join(_PACKAGE, "errors.py"), os.path.dirname(torch.__file__) + os.sep)


class Family:
    """One call structure at one call site: the values each size took there (a few), and the
    view geometries it was called with. A size is *varying* once it took ``VARYING_VALUES``
    distinct values: a growing length takes a new one at every step, where the sizes of a
    site that serves several fixed shapes (an ``nn.Sequential``'s layers, on one line) repeat."""

    __slots__ = ("seen", "varying", "last", "geometries", "views")

    def __init__(self, sizes: tuple, geometries: tuple) -> None:
        self.seen = [{n} for n in sizes]
        self.varying = (False,) * len(sizes)
        self.last = sizes
        self.geometries = {geometries}
        self.views = False  # whether its views' geometries vary

    def in_step(self, sizes: tuple) -> bool:
        """Whether sizes (of a call of the same structure) are where this varying family's
        last call was, in every size that varies here: the same step of the same loop."""
        return all(n == m for n, m, v in zip(sizes, self.last, self.varying) if v)

    def seeded(self, sizes: tuple, geometries: tuple) -> Family:
        """A new site's family that varies where this one does (its other sizes its own)."""
        family = Family(sizes, geometries)
        family.seen = [set(seen) if v else {n}
                       for seen, v, n in zip(self.seen, self.varying, sizes)]
        family.varying = self.varying
        return family

    def note(self, sizes: tuple, geometries: tuple) -> None:
        self.last = sizes
        for seen, n in zip(self.seen, sizes):
            if len(seen) < VARYING_VALUES:
                seen.add(n)
        self.varying = tuple(len(seen) >= VARYING_VALUES for seen in self.seen)
        if not self.views and geometries not in self.geometries:
            self.geometries.add(geometries)
            self.views = len(self.geometries) >= VARYING_VALUES


def family(structure: tuple, sizes: tuple, geometries: tuple) -> Family | None:
    """The family of a call of structure at sizes from the calling site, with the call noted;
    None for a site's first call (it runs as usual) unless it grows with another site."""
    if _dead:
        _forget_dead()
    key = (structure, site())
    found = _families.get(key)
    if found is None:
        lead = _growing.get(structure)
        if lead is None or not lead.in_step(sizes):
            meta.bounded_put(_families, key, Family(sizes, geometries))
            return None
        found = lead.seeded(sizes, geometries)
        meta.bounded_put(_families, key, found)
    else:
        found.note(sizes, geometries)
    if any(found.varying):
        meta.bounded_put(_growing, structure, found)
        meta.bounded_put(_grown, structure, True)
    return found


def grows(structure: tuple) -> bool:
    """Whether calls of structure varied at some site, also one of a dead object: a new
    model's sites must see their own calls to find that they grow too, also at specs an
    earlier model ran exact."""
    # Asked at every eager call: a nested tuple's hash is computed anew each time.
    return bool(_grown) and structure in _grown


def clear() -> None:
    """Forget every family."""
    _families.clear()
    _growing.clear()
    _grown.clear()
    HOOKS.growing_epoch += 1  # what a steady answer was given from is gone


def site() -> tuple:
    """The innermost ``SITE_FRAMES`` frames outside PyTorch and torchtpu's machinery, as (code,
    line, owner) triples: sizes vary *at a call site* in a growing loop, where a fixed-shape
    model's differ between sites (its layers' lines). A module's line is shared by every model
    built from its class, whose sizes need not be related: each instance has its own families
    (the owner: the token of the nearest method's ``self``, 0 outside any method). Built only for
    calls at sizes not run before."""
    found, frame = [], sys._getframe(1)
    while frame is not None and len(found) < SITE_FRAMES:
        code = frame.f_code
        if not code.co_filename.startswith(_MACHINERY):
            found.append((code, frame.f_lineno, _owner(frame)))
        frame = frame.f_back
    return tuple(found)


def _owner(frame) -> int:
    """The token of the object of the method frame is in, or of the nearest user method calling
    it within ``OWNER_FRAMES`` frames; 0 when there is none."""
    for _ in range(OWNER_FRAMES):
        if frame is None:
            break
        code = frame.f_code
        if code.co_argcount and code.co_varnames[0] == "self" \
                and not code.co_filename.startswith(_MACHINERY):
            return _token(_self_of(frame))
        frame = frame.f_back
    return 0


def _token(owner) -> int:
    """A number for owner while it lives, never given to another object (ids are reused)."""
    key = id(owner)
    known = _owners.get(key)
    if known is not None and known[0]() is owner:
        return known[1]
    token = next(_tokens)
    try:
        ref = weakref.ref(owner, lambda _, key=key, token=token: _died(key, token))
    except TypeError:  # no weak references (``__slots__``): known by its id, as it lives
        return key
    _owners[key] = (ref, token)
    return token


def _died(key: int, token: int) -> None:
    # Run by the collector, maybe inside ``family``: only noted here.
    known = _owners.get(key)
    if known is not None and known[1] == token:
        del _owners[key]
    _dead.append(token)


def _forget_dead() -> None:
    """Drop the families of owners that died (a dead one leads no new site's growth)."""
    dead = set(_dead)
    _dead.clear()
    gone = {id(_families.pop(k)) for k in [k for k in _families
                                           if any(owner in dead for _, _, owner in k[1])]}
    for structure in [k for k, f in _growing.items() if id(f) in gone]:
        del _growing[structure]


def _self_of(frame):
    """A method frame's ``self``. Reading ``f_locals`` (CPython before 3.13) copies every
    local of the frame into a dict the frame keeps until it returns: the method's tensors would
    then outlive their names (a DeferAndFuse flush keeps an output its caller dropped, so the
    first step at new sizes, the one that looks here, records another program than the steps
    after it: TRL's rollout compiled one more at its second step). The copy is emptied again
    when only the frame holds it (a caller's own ``locals()`` is left as it is); any later read
    fills it anew."""
    names = frame.f_locals
    owner = names.get("self")
    if type(names) is dict and sys.getrefcount(names) <= 3:  # the frame, names, the argument
        names.clear()
    return owner
