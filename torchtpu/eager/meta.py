"""Result shapes and dtypes of ATen calls on tpu tensors, from PyTorch's own meta kernels.

Running an op on meta tensors gives exactly PyTorch's type promotion, broadcasting and shape
errors, so lowerings never re-derive them. Results are cached per call signature (``call_key``):
shapes, dtypes, Python scalar values (a traced one's type and sign) and the default dtype, never
data.
"""

from __future__ import annotations

import math

import torch
from torch._library import custom_ops

from torchtpu.cache import warm
from torchtpu.device import dtypes
from torchtpu.eager import facts, refusals, schema
from torchtpu.lowering.registry import channels_last_of
from torchtpu.runtime import platform

OpOverload = torch._ops.OpOverload


def device_error(t: torch.Tensor) -> RuntimeError:
    return RuntimeError(
        "torchtpu.placement: Expected all tensors to be on the same device, but found at least "
        "two devices, "
        f"tpu:0 and {t.device}! (move the tensor with .to('tpu') first; torchtpu never copies "
        "between devices silently)"
    )


def is_device(t: torch.Tensor) -> bool:
    return t.device.type == "tpu"


# ----------------------------------------------------------------------------- meta inference

def to_meta(v):
    if isinstance(v, torch.Tensor):
        # CPU 0-dim tensors (scalars) become meta too: PyTorch's out= references refuse to
        # "copy" a CPU input into a meta output.
        if is_device(v) or v.dim() == 0:
            return torch.empty_strided(v.shape, v.stride(), dtype=v.dtype, device="meta")
        return v
    if isinstance(v, (list, tuple)):
        return type(v)(to_meta(x) for x in v)
    if isinstance(v, torch.Generator):
        return None
    if isinstance(v, torch.device) and v.type == "tpu":
        # A factory's device argument (its index checked by ``leaf_key``): inferring on "tpu"
        # would call this kernel again.
        return torch.device("meta")
    return v


def leaf_key(v):
    if isinstance(v, torch.Tensor):
        if not v.is_cpu:
            if not v.is_contiguous():
                # An operand's layout decides its results' (channels-last, or a pointwise op's
                # in its operands' order: see ``describe``).
                return (v.shape, v.dtype, v.stride())
            return (v.shape, v.dtype)  # torch.Size is a tuple: it hashes and compares as one
        if v.dim() != 0:
            raise device_error(v)
        return ("cpu", v.dtype)
    if type(v) is torch.device and v.type == "tpu":
        # Checked here, before any cache: which indexes name this process's device is the
        # process's own (tpu:1 is rank 1's), where a kept result is shared by every process.
        if v.index is not None:
            platform.check_index(v.index)
        return "tpu"
    return exact_key(v)


def exact_key(v):
    """v as a key that tells apart what ``==`` takes for one value: 1, 1.0 and True (they
    promote differently) and 0.0 and -0.0 (a zero's sign survives a fill or a multiply).
    Every NaN is one key (``float.hex``), where ``==`` would take none for another."""
    t = type(v)
    if t is float:
        return (t, v.hex())
    if t is complex:
        return (t, v.real.hex(), v.imag.hex())
    if t is tuple:
        return tuple(exact_key(x) for x in v)
    return (t, v)


def is_default_number(v, default) -> bool:
    """v is its argument's schema default (so ``calls.entries_of`` bakes it in)."""
    return type(v) is type(default) and v == default


# Numbers a program is specialized on even where numbers are traced, because XLA (or the
# lowering) computes with them differently from any other value: ``x ** 2`` is ``x * x`` and
# ``x ** 0.5`` a square root, not exp(y * log(x)); a multiply by 1 or 0, a clamp at 0, ``where``
# with a 0 branch simplify. Each adds at most one program per op; a value that changes every
# step (a learning rate, a bias correction) is almost never one of them.
SPECIAL_NUMBERS = frozenset({0, 1, -1, 2, -2, 3, 4, 0.5, -0.5})


def is_special_number(v) -> bool:
    # -0.0 == 0 but computes differently (its sign survives a multiply): it stays traced.
    return (type(v) in (int, float) and v in SPECIAL_NUMBERS
            and not (v == 0 and math.copysign(1.0, v) < 0))


def is_baked_number(v, default) -> bool:
    """A traced argument's number that ``calls.entries_of`` bakes in all the same."""
    return is_default_number(v, default) or is_special_number(v)


def _sign(v):
    # What CPU's dtype checks may tell apart among a traced number's values (``refusals``):
    # an integer tensor to a negative integer power is refused, to a positive one not.
    if type(v) is bool:
        return v
    if type(v) is complex:
        return v.real < 0
    return v is not None and v < 0


def _traced_number_key(v, default):
    # A traced number's value never changes result shapes or programs; its type does, so does
    # whether it is baked in (the schema default, or a special number: then its value), and its
    # sign decides whether CPU refuses the call (``refusals.signature``), which a cached result
    # skips.
    if isinstance(v, (list, tuple)):
        return tuple((type(x), _sign(x)) for x in v)
    return (type(v), is_default_number(v, default), v if is_special_number(v) else None,
            _sign(v))


def call_key(oi: schema.OpInfo, values: list, traced: frozenset = frozenset()) -> tuple:
    """What determines an op call's result shapes, dtypes and program: everything but data,
    and the default dtype (a Python float's, a factory's, an integer's true division's).

    ``traced`` are the arguments whose Python numbers the program takes as inputs: only their
    types and signs count, so a learning rate or bias correction that changes every step reuses
    one plan.
    """
    parts = [torch.get_default_dtype()]
    for i, v in enumerate(values):
        if i in traced and not _holds_tensor(v):
            parts.append(_traced_number_key(v, oi.defaults[i]))
        elif isinstance(v, (list, tuple)):
            parts.append(tuple(leaf_key(x) for x in v))
        elif i == oi.generator_index:
            parts.append("gen")
        else:
            parts.append(leaf_key(v))
    return tuple(parts)


def _dense(m: torch.Tensor) -> bool:
    """Whether m's elements fill its storage span exactly, in some order of its dims."""
    expected = 1
    for size, stride in sorted(zip(m.shape, m.stride()), key=lambda d: d[1]):
        if size != 1 and stride != expected:
            return False
        expected *= size
    return True


def describe(m, strides: bool = False):
    """m's description (``results``); with strides, a dense result laid out in another order
    than row-major keeps its strides (``lowers(layout=META_STRIDES)``)."""
    if isinstance(m, torch.Tensor):
        # A result keeps a channels-last layout, as PyTorch's kernels give it (a channels-last
        # input, or a convolution's channels-last weight); any other layout is contiguous: a
        # computed array is row-major.
        fmt = channels_last_of(m)
        if fmt is not None:
            return (tuple(m.shape), m.dtype, fmt)
        if strides and not m.is_contiguous() and _dense(m):
            return (tuple(m.shape), m.dtype, tuple(m.stride()))
        return (tuple(m.shape), m.dtype)
    if isinstance(m, (list, tuple)):
        return tuple(describe(x, strides) for x in m)
    # An int result (a SymInt return, e.g. SDPA's max_q) is its value, known from the meta call.
    return m if type(m) is int else None


CACHE_LIMIT = 50_000
_meta_cache: dict = {}


def bounded_put(cache: dict, key, value) -> None:
    # Keys include Python scalar values (a learning rate that changes every step), so the
    # caches are bounded; dropping everything is simplest and rare.
    if len(cache) >= CACHE_LIMIT:
        cache.clear()
    cache[key] = value


def _holds_tensor(v) -> bool:
    if isinstance(v, (list, tuple)):
        return any(isinstance(x, torch.Tensor) for x in v)
    return isinstance(v, torch.Tensor) or v is None


_MISSING = object()
# The attribute naming a fake kernel derived from the op's own function (``jax_op``'s
# ``jax.eval_shape``): it describes the op as the function does, whatever is registered later.
DERIVED_FAKE = "_torchtpu_derived_fake"


def _registered_fake(op: OpOverload):
    """A custom op's fake kernel, where its user registered one (``register_fake``): they may
    register another, which describes the op's results anew, so it is part of the kept
    descriptions' key (here, and the facts another process reads). None for PyTorch's own ops
    and for a fake derived from the op's function, keyed by the op alone."""
    if op.namespace == "aten":
        return None
    opdef = custom_ops.OPDEFS.get(op._schema.name)
    fake = None if opdef is None else opdef._abstract_fn
    return None if fake is None or getattr(fake, DERIVED_FAKE, False) else fake


def infer(op: OpOverload, values: list, outs: list = (), traced: frozenset = frozenset(),
          strides: bool = False, known_key: tuple | None = None):
    """Shapes and dtypes of op's results: (shape, dtype[, memory format or strides]) or a tuple
    of them (strides: see ``describe``; the same for every call of op, as the cache assumes).
    ``known_key``: ``call_key(info(op), values, traced)``, where the caller has it."""
    oi = schema.info(op)
    try:
        if known_key is None:
            known_key = call_key(oi, values, traced)
        key = (op, known_key, tuple(leaf_key(o) for o in outs))
        fake = _registered_fake(op)
        if fake is not None:
            key += (fake,)
        hit = _meta_cache.get(key, _MISSING)
    except TypeError:  # something unhashable: do not cache
        key, hit = None, _MISSING
    # None is a real result (in-place foreach ops return nothing), hence the sentinel.
    if hit is not _MISSING:
        return hit
    # Another process's result for this key (the key holds the default dtype). Its shapes are
    # facts; whether CPU takes the dtypes is asked here all the same (once per signature): a
    # record another process wrote is no proof that the refusals' check ran there (a mm of
    # bools, kept by some earlier run, was taken in the suite where CPU refuses it).
    text = (facts.text_of("meta", key, strides)
            if key is not None and warm.cache_on() else None)
    hit = facts.meta_result(text)
    if hit is not facts.MISSING:
        refusals.check(op, values, outs, traced)
        bounded_put(_meta_cache, key, hit)
        return hit
    args = [to_meta(v) for v in values]
    for i in oi.scalar_indices:
        if isinstance(args[i], (bool, int, float, complex)) and oi.tensor_typed[i]:
            # A wrapped-number operand (``x * 2.5``; ``remainder_(3)`` calls
            # ``remainder.Tensor_out`` with one) arrives as a plain number; meta kernels want a
            # tensor (``_wrapped``).
            args[i] = _wrapped(args[i], args)
    kwargs = {n: args[i] for i, n in enumerate(oi.names) if n in oi.kwarg_only}
    pos = [a for i, a in enumerate(args) if oi.names[i] not in oi.kwarg_only]
    for n, o in zip(oi.out_names, outs):
        kwargs[n] = to_meta(o)
    result = describe(_run_meta(op, pos, kwargs), strides)
    # What the meta kernel does not check: the dtypes CPU's kernel implements.
    refusals.check(op, values, outs, traced)
    if key is not None:
        bounded_put(_meta_cache, key, result)
        facts.keep_meta_result(text, result)
    return result


_KINDS = {bool: 0, int: 1, float: 2, complex: 3}


def _kind(dtype: torch.dtype) -> int:
    return 0 if dtype is torch.bool else 3 if dtype.is_complex else 2 \
        if dtype.is_floating_point else 1


def _wrapped(number, args: list) -> torch.Tensor:
    """A 0-dim meta tensor promoting with args as PyTorch's wrapped number does: only by its
    kind. Of a tensor argument's dtype where one is of the number's kind (a 0-dim tensor of the
    default dtype would promote ``loss * 2.5`` of a float32 0-dim loss to float64 under a float64
    default: CPU keeps float32), else of the default dtype of its kind, which a wrapped number
    of a higher kind than every tensor's promotes to."""
    kind = _KINDS.get(type(number), 2)
    for a in args:
        if isinstance(a, torch.Tensor) and _kind(a.dtype) == kind:
            return torch.empty((), dtype=a.dtype, device="meta")
    return torch.tensor(number, device="meta")


def _run_meta(op: OpOverload, pos: list, kwargs: dict):
    if not torch.are_deterministic_algorithms_enabled():
        return op(*pos, **kwargs)
    # PyTorch's Python meta kernels take a meta tensor for a CUDA one (``device_hint``) and
    # raise CUDA's deterministic-mode alerts (``median(dim)``, float ``histc``), which CPU does
    # not: shape inference runs with the mode off (device kernels make CPU's own alerts).
    warn_only = torch.is_deterministic_algorithms_warn_only_enabled()
    torch.use_deterministic_algorithms(False)
    try:
        return op(*pos, **kwargs)
    finally:
        torch.use_deterministic_algorithms(True, warn_only=warn_only)


def common_dtype(values):
    operands = [v for v in values if isinstance(v, (torch.Tensor, int, float, complex, bool))]
    if len(operands) < 2:
        return None
    a, b = (to_meta(x) for x in operands[:2])
    return dtypes.to_jax(torch.result_type(a, b))
