"""Turning one lowering call into a cached, jitted program, shared by every executor.

An op call is split into a static spec (constants, the structure of the arguments, dtypes) and
its dynamic values (arrays, traced scalars, PRNG key data). The spec and the lowering pick one
jitted function; JAX then caches one executable per input shape and dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import jax
import jax.numpy as jnp
import torch

from torchtpu.cache import warm_dispatch, warm_keys
from torchtpu.device import dtypes
from torchtpu.device.views import Geometry
from torchtpu.eager import meta
from torchtpu.eager.lazy_casts import Cast, check_read, read_input
from torchtpu.lowering.registry import TABLE, Lowering

# Spec entries, one per bound argument.
TENSOR = "t"       # one array; payload: None, or how to read it: a view Geometry or a
                   # lazy cast's ``Cast``
TENSORS = "l"      # a list of arrays/None: payload, per element: True (None), False (an
                   # array) or how to read the array (a Geometry or a ``Cast``)
SCALAR = "s"       # a traced Python number
KEY = "k"          # PRNG key data -> a JAX key
CONST = "c"        # baked-in constant: payload is the value

class Spec:
    """The static part of one op call: argument entries, compute and result dtypes.

    Specs are hashed on every op call (to find the program), so the hash is computed once.
    """

    __slots__ = ("entries", "compute", "final", "promote", "order", "_key", "_hash", "_program",
                 "_simple", "_scalars", "keeps", "_pointwise", "shape")

    def __init__(self, entries: tuple, compute: Any, final: Any, promote: Any = None,
                 order: tuple | None = None) -> None:
        self.entries = entries    # (kind, payload) per argument
        self.compute = compute    # dtype(s) the math runs in (result of PyTorch promotion)
        self.final = final        # dtype(s) the outputs are cast to
        self.promote = promote    # input dtype under promote="common"
        # Its one result's dims in memory order, where CPU lays the result out in another order
        # than row-major (``in_order``); None: row-major.
        self.order = order
        # A constant by its exact key: a spec equal to another's picks that one's program, and
        # 2 and 2.0 (or 0.0 and -0.0) are equal numbers (nan_to_num(nan=-0.0) ran as nan=0.0).
        exact = tuple((kind, meta.exact_key(p) if kind == CONST else p) for kind, p in entries)
        self._key = (exact, compute, final, promote, order)
        self._hash = hash(self._key)
        self._program = None  # ``held``'s (lowering, jitted, dispatched): a hit without a hash
        self._simple = None   # whether ``seen_calls`` may repeat its calls (found at first use)
        self._scalars = None  # where its traced numbers are (``numbers.scalar_slots``)
        # Its kept lazy casts (``kept_positions``): its program returns their conversions too.
        self.keeps = ()
        self._pointwise = None  # (lowering, ``one_pointwise_input``'s answer)
        # Its one result's shape (in memory order, with ``order``), where the plan that made it
        # knew it (a held call's value's: ``lazy_casts.lazy_op``); None otherwise.
        self.shape = None

    def __hash__(self) -> int:
        return self._hash

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Spec) and self._key == other._key


def prng_key(data):
    """A JAX key from (seed lo, seed hi, offset lo, offset hi) uint32 words."""
    key = jax.random.wrap_key_data(data[:2], impl="threefry2x32")
    return jax.random.fold_in(jax.random.fold_in(key, data[2]), data[3])


def cast_outputs(x, dtype):
    # dtype None: the result dtypes are not known ahead (data-dependent shapes); keep them.
    if x is None or dtype is None:
        return x
    if isinstance(x, (tuple, list)):
        if isinstance(dtype, tuple):
            return type(x)(cast_outputs(v, d) for v, d in zip(x, dtype))
        return type(x)(cast_outputs(v, dtype) for v in x)
    return x if x.dtype == dtype else dtypes.cast(x, dtype)


def finished(x, spec: Spec):
    """A lowering's outputs x as spec's program returns them: cast to its result dtypes, and
    its one result transposed to memory order (``Spec.order``). A pointwise op over a transposed
    or channels-last input so computes over the input's storage in its own order: XLA cancels
    the read's transpose against this one, and the result is stored as it comes, no copy."""
    x = cast_outputs(x, spec.final)
    return x if spec.order is None else x.transpose(spec.order)


def _first(dtype):
    while isinstance(dtype, tuple):
        dtype = dtype[0]
    return dtype


def rebuild(spec: Spec, lowering: Lowering, dyn: tuple, kept: list | None = None) -> list:
    """The lowering's arguments, from the spec and the dynamic values (inside a trace); kept
    lazy casts' conversions are appended to ``kept`` (when given)."""
    promote_to = None
    if lowering.promote == "result":
        promote_to = _first(spec.compute)
    elif lowering.promote == "common":
        promote_to = spec.promote
    args, it = [], iter(dyn)
    for kind, payload in spec.entries:
        if kind == TENSOR:
            v = next(it)
            if payload is not None:
                v = read_input(applied(v, payload, kept), payload, kept)
            if promote_to is not None and v.dtype != promote_to:
                v = v.astype(promote_to)
            args.append(v)
        elif kind == TENSORS:
            items = []
            for element in payload:
                if element is True:
                    items.append(None)
                else:
                    v = next(it)
                    items.append(v if element is False
                                 else read_input(applied(v, element, kept), element, kept))
            args.append(items)
        elif kind == SCALAR:
            args.append(next(it))
        elif kind == KEY:
            args.append(prng_key(next(it)))
        else:
            args.append(payload)
    return args


def applied(array, how, kept: list | None = None):
    """array with a lazy pointwise call's op applied (``how`` a ``Cast`` whose ``op`` is set),
    inside the reading program; else array. Kept values the call reads (nested) are appended
    to ``kept``, as ``kept_positions`` lists them."""
    if type(how) is not Cast or how.op is None:
        return array
    lowering, spec = how.op
    # A call of several tensors or holding traced numbers takes its arguments as one input
    # (``Converted.spread``).
    value = rounded(finished(lowering.fn(*rebuild(
        spec, lowering, array if _spread(spec) else (array,), kept)), spec))
    if how.held and kept is not None:
        kept.append(value)
    return value


def _spread(spec: Spec) -> bool:
    # (A held cat's one entry is a list of several arrays.)
    return sum(kind != CONST for kind, _ in spec.entries) > 1 or any(
        kind == TENSORS and sum(element is not True for element in payload) > 1
        for kind, payload in spec.entries)


def rounded(x):
    """x, a held call's value inside its reader's program, rounded to its dtype as its own
    program's result would be: XLA computes a bfloat16 or float16 value in float32 and, inside
    one program, may skip its rounding between ops (``xla_allow_excess_precision``), which an
    explicit ``reduce_precision`` keeps (a Llama step's loss moved 1.5e-5 without it)."""
    if x.dtype not in _NARROW:
        return x
    info = jnp.finfo(x.dtype)
    return jax.lax.reduce_precision(x.astype(jnp.float32), info.nexp, info.nmant).astype(x.dtype)


_NARROW = (jnp.bfloat16, jnp.float16)


_NOT = (False, 0)
# The most held pointwise calls one program applies: a longer chain (a loop of ``x = x * 2``)
# launches, so that no program grows with a loop's length.
CHAIN = 8


def chained(how) -> int:
    """How many held pointwise calls reading through ``how`` (a spec payload) applies, over all
    of their tensors (a held call of two held values applies both)."""
    if type(how) is not Cast or how.op is None:
        return 0
    return 1 + sum(chained(p) for p in _reads(how.op[1].entries))


def _reads(entries) -> list:
    """How a spec reads each of its tensors: a TENSOR entry's payload, each array's of a
    TENSORS entry."""
    return [p for kind, payload in entries if kind in (TENSOR, TENSORS)
            for p in ((payload,) if kind == TENSOR else payload) if p is not True]


def one_pointwise_input(lowering: Lowering, spec: Spec) -> tuple:
    """(how the call reads its first tensor: None, a view Geometry or a lazy value's ``Cast``;
    its tensors' count) for a call of a pointwise op (PyTorch's tag), or of one its lowering
    record says is ``held`` (a function of one tensor alone: a slice's gradient), whose traced
    values are its tensors, then any traced numbers (``x + eps``), and whose result is one
    array; else (False, 0). A ``Cast`` read is a chain: the call applies after the lazy value's
    own (``applied`` nests), held up to ``CHAIN`` calls in all; over a kept one, kept too where
    smaller than the source, that one computed with it if it still lives (``lazy_op``: a
    narrowing cast's wide source must not outlive its first reader). Asked at every Strict
    call: kept on the spec."""
    held = spec._pointwise
    if held is not None and held[0] is lowering:
        return held[1]
    answer = _NOT
    traced = [(kind, payload) for kind, payload in spec.entries if kind != CONST]
    if len(traced) == 1 and traced[0][0] == TENSORS:
        answer = _list_held(lowering, spec, traced[0][1])
        spec._pointwise = (lowering, answer)
        return answer
    count = sum(kind == TENSOR for kind, _ in traced)
    if (count and all(kind == TENSOR for kind, _ in traced[:count])
            and all(kind == SCALAR for kind, _ in traced[count:])
            and (count == 1 or not lowering.held)
            and not lowering.random
            and not lowering.donates and not lowering.data_dependent_shape
            and (lowering.held or torch.Tag.pointwise in lowering.op.tags)
            and spec.final is not None and not isinstance(spec.final, tuple)
            and all(_holdable(p) for _, p in traced[:count])
            and sum(chained(p) for _, p in traced[:count]) < CHAIN):
        answer = (traced[0][1], count)
    spec._pointwise = (lowering, answer)
    return answer


def _list_held(lowering: Lowering, spec: Spec, reads: tuple) -> tuple:
    """``one_pointwise_input``'s answer for a call whose one traced value is a tensor list:
    held where its lowering record says ``held`` (a cat: the rotary halves' of every attention
    layer, whose reader then computes it), as a pointwise call of those tensors is; its first
    tensor's read is None where it is its array whole."""
    arrays = [how for how in reads if how is not True]
    if (not lowering.held or not arrays or len(arrays) != len(reads) or lowering.random
            or lowering.donates or lowering.data_dependent_shape or spec.final is None
            or isinstance(spec.final, tuple) or not all(
                how is False or _holdable(how) for how in arrays)
            or sum(chained(how) for how in arrays) >= CHAIN):
        return _NOT
    return (None if arrays[0] is False else arrays[0], len(arrays))


def _holdable(how) -> bool:
    return how is None or type(how) is Geometry or type(how) is Cast


_with_views: dict = {}


def with_views(spec: Spec, views: tuple) -> Spec:
    """spec with tensor arguments read through a view Geometry (or a lazy cast's ``Cast``)
    inside the program: ``views`` holds ``(entry index, list position or None, how)`` for each."""
    # (Equal specs may differ in their result's shape: a derived spec keeps its own.)
    key = (spec, views, spec.shape)
    derived = _with_views.get(key)
    if derived is None:
        entries = [list(e) for e in spec.entries]
        for i, j, g in views:
            check_read(g)
            if j is None:
                entries[i][1] = g
            else:
                payload = list(entries[i][1])
                payload[j] = g
                entries[i][1] = tuple(payload)
        derived = Spec(tuple(tuple(e) for e in entries), spec.compute, spec.final, spec.promote,
                       spec.order)
        derived.keeps = kept_positions(derived.entries)
        derived.shape = spec.shape
        meta.bounded_put(_with_views, key, derived)  # geometries include offsets: keep it bounded
    return derived


def kept_positions(entries: tuple, path: tuple = (), spread: bool = True) -> tuple:
    """(path to its source among the dynamic values, dtype, shape, op, view) of each kept
    ``Cast`` spec entries read, nested in the held calls they read too (a held product of a
    kept cast settles it), in the order a program returns their conversions
    (``program.rebuild``'s). A path indexes the dynamic values, then a held call's arguments
    where it takes several (``Converted.spread``); ``spread`` False: these entries' one tensor
    is the value at ``path`` itself."""
    found, at = [], 0
    for kind, payload in entries:
        if kind == CONST:
            continue
        hows = payload if kind == TENSORS else (payload,)
        for how in hows:
            if how is True:
                continue
            here = path + (at,) if spread else path
            if type(how) is Cast:
                if how.op is not None:
                    found += kept_positions(how.op[1].entries, here, _spread(how.op[1]))
                if how.held:  # the kept held call a cast of it reads
                    found.append((here, how.op[1].final, how.shape, how.op, None))
                if how.keep:
                    found.append((here, how.dtype, how.shape, how.op, how.view))
            at += 1
    return tuple(found)


def donated_inputs(lowering: Lowering, spec: Spec) -> tuple:
    """Positions among the dynamic values of the arrays of the lowering's donated arguments."""
    if not lowering.donates:
        return ()
    offset = 1 if lowering.random else 0  # the leading key entry
    donated, at = [], 0
    for i, (kind, payload) in enumerate(spec.entries):
        if kind == TENSOR and i - offset in lowering.donates:
            donated.append(at)
        if kind in (TENSOR, SCALAR, KEY):
            at += 1
        elif kind == TENSORS:
            at += sum(element is not True for element in payload)
    return tuple(donated)


def program(lowering: Lowering, spec: Spec):
    """The jitted function for one lowering and spec; call it with the dynamic values."""
    return held(lowering, spec)[1]


def held(lowering: Lowering, spec: Spec) -> tuple:
    """(lowering, its jitted function, the same called as Strict calls it: loaded by key in a
    new process, ``warm_dispatch.dispatched``), kept on the spec."""
    found = spec._program
    if found is None or found[0] is not lowering:
        found = spec._program = (lowering, *_program(lowering, spec))
    return found


@functools.cache
def _program(lowering: Lowering, spec: Spec) -> tuple:
    def run(*dyn):
        kept = [] if spec.keeps else None
        out = finished(lowering.fn(*rebuild(spec, lowering, dyn, kept)), spec)
        return out if kept is None else (out, tuple(kept))

    run.__name__ = str(lowering.op).replace(".", "_")
    jitted = warm_keys.named(jax.jit(run, donate_argnums=donated_inputs(lowering, spec)),
                        *_parts(lowering, spec))
    jitted._ttpu_call = (lowering, spec)
    # Recorders (captures, DeferAndFuse) trace the jitted function inside their programs;
    # only a call of its own loads by key.
    return jitted, warm_dispatch.dispatched(jitted)


def call_of(fn) -> tuple | None:
    """The (lowering, spec) whose program fn is (a recording's node), else None (a device
    kernel's program: a view read, a copy)."""
    return getattr(fn, "_ttpu_call", None)


def op_of(fn):
    """The op whose result fn, a recording's node, returns: its call's, or a producer form's
    (``producer_forms``), else None."""
    call = call_of(fn)
    return call[0].op if call is not None else getattr(fn, "_ttpu_op", None)


def _parts(lowering: Lowering, spec: Spec) -> tuple:
    """What names the program of lowering and spec in a key: a lazy pointwise call it reads
    (a ``Cast``'s ``op``) by the same parts as its own program, not by its objects."""
    entries = tuple((kind, _stable(payload)) for kind, payload in spec.entries)
    parts = "op", _identity(lowering), entries, spec.compute, spec.final, spec.promote
    return parts if spec.order is None else (*parts, spec.order)


def _stable(payload):
    if type(payload) is Cast and payload.op is not None:
        return payload._replace(op=_parts(*payload.op))
    if type(payload) is tuple:  # a TENSORS entry's reads
        return tuple(_stable(p) for p in payload)
    return payload


def _identity(lowering: Lowering):
    """What names a lowering across processes: its op, for torchtpu's own table (whose source
    the key's fingerprint covers); else its function, which a key accepts only if it is a
    module-level one (a user's kernel in a closure keeps its programs out of warm starts)."""
    if (TABLE.get(lowering.op) is lowering
            and getattr(lowering.fn, "__module__", "").startswith("torchtpu.lowering")):
        return lowering.op
    return lowering.fn


def jax_dtypes(struct):
    """Torch dtype structure -> numpy dtype structure (tuples stay tuples)."""
    if isinstance(struct, (tuple, list)):
        return tuple(jax_dtypes(s) for s in struct)
    return None if struct is None else dtypes.to_jax(struct)
