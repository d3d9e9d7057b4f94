"""What the executors need to know about an ATen op's schema, computed once per op.

Binding arguments to schema order, which arguments an in-place or ``out=`` overload writes, and
which functional overload computes its result (``add_.Tensor`` and ``add.out`` -> ``add.Tensor``).
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import torch

OpOverload = torch._ops.OpOverload

# In-place random ops whose functional twin is not simply the name without "_".
_FUNCTIONAL_NAMES = {"normal_": "normal_functional"}


class OpInfo(NamedTuple):
    op: OpOverload
    names: tuple          # non-out argument names, schema order
    defaults: tuple       # their defaults (a sentinel where required)
    kwarg_only: frozenset
    written: tuple        # indices (into names) of arguments written in place
    out_names: tuple      # out= argument names
    generator_index: int  # index of the Generator argument, -1 if none
    scalar_indices: frozenset  # Scalar or Tensor arguments: a Python number there is traced
    tensor_typed: tuple        # per argument: whether the schema says Tensor
    optional_from: int = 0     # the names from this index on all have defaults


_REQUIRED = object()


@functools.cache
def info(op: OpOverload) -> OpInfo:
    names, defaults, kwonly, written, outs, scalars = [], [], set(), [], [], set()
    tensor_typed = []
    gen = -1
    for a in op._schema.arguments:
        is_write = a.alias_info is not None and a.alias_info.is_write
        if a.kwarg_only and is_write:
            outs.append(a.name)
            continue
        i = len(names)
        names.append(a.name)
        defaults.append(a.default_value if a.has_default_value() else _REQUIRED)
        if a.kwarg_only:
            kwonly.add(a.name)
        if is_write:
            written.append(i)
        t = str(a.type)
        tensor_typed.append(t.removeprefix("Optional[").startswith("Tensor") and "[]" not in t)
        if t in ("Generator", "Optional[Generator]"):
            gen = i
        # A Python number where the schema says Tensor (``div.Tensor(t, 0.03)`` from optimizers)
        # is a scalar too: tracing it keeps a changing value from recompiling the program.
        # Lists of numbers (``Scalar[]``: the foreach ops' per-tensor scalars) are traced too.
        if t.removeprefix("Optional[").startswith(
                ("Scalar", "number", "Tensor", "List[number]", "List[Scalar]")):
            scalars.add(i)
    optional_from = len(defaults)
    while optional_from and defaults[optional_from - 1] is not _REQUIRED:
        optional_from -= 1
    return OpInfo(op, tuple(names), tuple(defaults), frozenset(kwonly), tuple(written),
                  tuple(outs), gen, frozenset(scalars), tuple(tensor_typed), optional_from)


def bind(oi: OpInfo, args: tuple, kwargs: dict) -> tuple[list, list]:
    """(non-out arguments in schema order with defaults filled, out arguments)."""
    if not kwargs and not oi.out_names and len(args) >= oi.optional_from:
        return [*args, *oi.defaults[len(args):]], []  # every op call: the common case first
    values = list(args) + [_REQUIRED] * (len(oi.names) - len(args))
    for i in range(len(args), len(oi.names)):
        name = oi.names[i]
        if name in kwargs:
            values[i] = kwargs[name]
        else:
            d = oi.defaults[i]
            if d is _REQUIRED:
                raise TypeError(f"torchtpu.argument: {oi.op}: missing required argument {name!r}")
            values[i] = d
    outs = [kwargs[n] for n in oi.out_names] if oi.out_names else []
    return values, outs


def _signature(op: OpOverload, skip_out: bool) -> tuple:
    return tuple(
        (a.name, str(a.type))
        for a in op._schema.arguments
        if not (skip_out and a.kwarg_only and a.alias_info is not None and a.alias_info.is_write)
    )


@functools.cache
def functional_of(op: OpOverload) -> OpOverload | None:
    """The non-mutating overload that computes what op writes, or None if there is none."""
    schema = op._schema
    if not schema.is_mutable:
        return op
    ns, name = schema.name.split("::")
    packet_name = name
    if info(op).written and not info(op).out_names and name.endswith("_"):
        packet_name = _FUNCTIONAL_NAMES.get(name, name[:-1])
    packet = getattr(getattr(torch.ops, ns), packet_name, None)
    if packet is None:
        return None
    want = _signature(op, skip_out=True)
    for overload in packet.overloads():
        cand = getattr(packet, overload)
        if not cand._schema.is_mutable and _signature(cand, skip_out=False) == want:
            return cand
    return None


def unbind(oi: OpInfo, values: list) -> tuple[list, dict]:
    """Bound values back to positional and keyword arguments."""
    args, kwargs = [], {}
    for n, v in zip(oi.names, values):
        if n in oi.kwarg_only:
            kwargs[n] = v
        else:
            args.append(v)
    return args, kwargs


def returns(op: OpOverload, targets: list):
    """What a mutating overload returns: None, its one target, or a tuple of them."""
    rets = op._schema.returns
    if not rets:
        return None
    if len(rets) == 1:
        return targets[0]
    return tuple(targets)


def flatten(out) -> list:
    """The leaves of nested lists and tuples (a single value is one leaf)."""
    if isinstance(out, (tuple, list)):
        flat = []
        for o in out:  # a foreach call's lists: a leaf is appended without a call of its own
            if isinstance(o, (tuple, list)):
                flat.extend(flatten(o))
            else:
                flat.append(o)
        return flat
    return [out]


def read(oi: OpInfo, values: list, skip: str | None = None) -> list:
    """The tensors a call reads: its arguments but those written in place (``ind.index_add_(0,
    ind, src)`` reads ind as its index, and overlaps itself) and the one named skip."""
    return flatten([v for i, v in enumerate(values)
                    if i not in oi.written and oi.names[i] != skip])
