"""Where an eager call's sizes vary: families of call sites (``eager_buckets`` pads their calls).

A call's *structure* (the op, its static spec, its tensors' dtypes and ranks) at its call site
(the innermost Python frame outside PyTorch and torchtpu's machinery) is a *family*, which
remembers a few of the values each size (a tensor dim, an integer argument) took there; a size
that took ``VARYING_VALUES`` distinct values is *varying*.

Families are keyed by call site and, at a method's line, by the method's object: another model
built from the same class starts families of its own, so the sizes one model took at a shared
line do not make another's fixed sizes look varying. The blocks of one model are such objects
too, and ``eager_buckets`` looks at a call only at sizes it did not run before: the first block
to run a length runs it for all, and the other blocks' families would not see the lengths before
the first block's varied (a program per length for each of them until their own did). So a site
first seen while another site of the same structure varies, at that site's latest sizes (the
same step of the same loop), varies from its first call; ``grows`` tells ``eager_buckets`` to
look again at calls of such a structure.
"""

from __future__ import annotations

import os
import sys

import torch

from torchtpu.eager import meta

VARYING_VALUES = 4
SITE_FRAMES = 1
_families: dict = {}  # (call structure, call site) -> Family
_growing: dict = {}   # call structure -> the family of it that last noted varying sizes
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
    return found


def grows(structure: tuple) -> bool:
    """Whether calls of structure vary at some site."""
    # Asked at every eager call: a nested tuple's hash is computed anew each time.
    return bool(_growing) and structure in _growing


def clear() -> None:
    """Forget every family (sites are keyed by objects' ids, which a new model may reuse)."""
    _families.clear()
    _growing.clear()


def site() -> tuple:
    """The innermost ``SITE_FRAMES`` frames outside PyTorch and torchtpu's machinery, as (code,
    line, the id of the method's ``self``) triples: sizes vary *at a call site* in a growing
    loop, where a fixed-shape model's differ between sites (its layers' lines). A module's line
    is shared by every model built from its class, whose sizes need not be related: each
    instance has its own families. Built only for calls at sizes not run before."""
    found, frame = [], sys._getframe(1)
    while frame is not None and len(found) < SITE_FRAMES:
        code = frame.f_code
        if not code.co_filename.startswith(_MACHINERY):
            owner = frame.f_locals.get("self") if code.co_argcount and \
                code.co_varnames[0] == "self" else None
            found.append((code, frame.f_lineno, id(owner)))
        frame = frame.f_back
    return tuple(found)
