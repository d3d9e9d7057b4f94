"""The one lowering table: ATen op overload -> pure JAX function.

Every executor (Strict, Debug, DeferAndFuse) and the compiled path look ops up here and nowhere
else. A lowering takes the op's arguments in schema order, with JAX arrays where the schema has
tensors and plain Python values elsewhere, and returns arrays. It never touches torch tensors.

Policy that many ops share is declared here instead of repeated in each lowering:
- ``promote="result"``: tensor inputs are cast to the op's result dtype first (PyTorch computes
  elementwise math in the result dtype); ``promote="common"``: to the inputs' common dtype
  (comparisons, whose result is bool). Results are always cast to PyTorch's result dtype.
- ``Scalar`` arguments are traced rather than baked into the program, so a value that changes
  every step does not recompile; ``static_scalars=True`` bakes them in instead (for lowerings
  that need the value in Python). ``traced`` names other (e.g. ``float``) arguments to trace,
  such as the learning rate of the fused optimizers.
- ``data_dependent_shape``: the output shape depends on values (``nonzero``); the executor runs
  such a call on concrete arrays instead of compiling it whole (and DeferAndFuse flushes first).
  A predicate instead of ``True`` limits that to the calls it accepts: it gets the bound
  arguments in schema order, torch tensors (real, fake or meta) where the schema has tensors,
  so ``x[idx]`` with integer indices stays an ordinary, recordable op and only masks are run
  concretely.
- ``random``: the lowering takes a PRNG key as its first argument, drawn from the device
  generator by the executor. A predicate instead of ``True`` draws the key only for the calls it
  accepts (SDPA draws one only with dropout); it gets the bound arguments like
  ``data_dependent_shape``, may look only at arguments that are not traced (a plan is cached per
  call signature; DeferAndFuse's replay repeats a call that drew no key where the signature is
  the same), and for the other calls the lowering gets None as its key.
- ``layout``: a function of the bound arguments (like ``data_dependent_shape``'s predicate)
  giving the memory format of the call's 4-d / 5-d results where PyTorch's CPU kernel picks
  one that its meta kernel does not (a convolution is channels-last when its input or weight
  is; ``torch.contiguous_format``: all contiguous); None: the meta kernel's channels-last or
  contiguous; ``META_STRIDES`` (every pointwise op's, PyTorch's tag, unless it declares
  another): the meta kernel's strides whatever dense order they have (SDPA's
  output is laid out as its query, its gradients as q, k and v: a DTensor's strides come from
  the meta kernel, and a local tensor laid out otherwise broke the ``.transpose(1, 2)
  .contiguous().view(...)`` after attention, issue 37).
- ``held``: a call whose one traced value is one tensor (or one list of tensors) computes a
  function of that tensor (those tensors) alone, as a pointwise op (PyTorch's tag) does, so
  Strict may hold it and let the program that reads its result compute it
  (``eager/lazy_casts.py``): a slice's gradient, a pad of it, a cat.
- ``shape_only``: the names of tensor arguments whose lowering reads only their shape and
  dtype, never their values (``x.uniform_()``, ``x.zero_()``: the result overwrites x). The
  executor passes a ``jax.ShapeDtypeStruct`` there instead of the storage's array, so
  ``torch.empty(...)`` then ``nn.init.kaiming_uniform_`` or ``zero_`` reads no never-written
  storage (which would make a zeros program per shape) and waits on no pending value.
- ``constant``: the call's one result holds one number everywhere, ``constant(*bound
  arguments)`` (``zero_``'s 0, ``fill_``'s value, ``torch.ones``' 1): a small one, of a value
  its dtype holds exactly, is sent from the host rather than computed by a program compiled
  per shape (``device/constants.py::host_constant``; a call that reads a tensor computes).

An op PyTorch has no meta kernel for gets one declared beside its lowering with
``@meta_kernel(op)`` (result shapes come from meta kernels); ``registration.py`` registers them
all when the device loads, so importing a lowering module registers nothing with PyTorch. An op
eager serves with a device kernel (a view, a copy, an allocation) has no lowering; its value form
in a compiled graph is declared with ``@graph_form(op)`` (``graph_forms.py``), and what an op
needs to stay exact on inputs padded to a size bucket (dynamic shapes) with ``@padding_rule(op)``
(``padding.py``); what CPU's kernel refuses in argument values with ``@check(op)``
(``checks.py`` holds what checks share); another form of its lowering for a result a recorded
program reads through a view with ``@read_form(op)`` (``eager/read_forms.py``), for arguments
it reads through views with ``@view_form(op)`` (the same module), and for an
argument a recorded call of another op produced with ``@producer_form(op)``
(``eager/producer_forms.py``). Each decorator sits beside the op's lowering, in its family module.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Callable

import torch

from torchtpu.runtime import platform

OpOverload = torch._ops.OpOverload
# ``lowers(layout=META_STRIDES)``: results keep the strides PyTorch's meta kernel gives them.
META_STRIDES = "meta strides"


# eq=False: a lowering is hashed on every op call, so identity hashing keeps that cheap.
@dataclasses.dataclass(frozen=True, eq=False)
class Lowering:
    op: OpOverload
    fn: Callable
    promote: str | None = None
    static_scalars: bool = False
    data_dependent_shape: bool | Callable = False
    random: bool | Callable = False
    traced: tuple = ()
    donates: tuple = ()
    family: str = ""  # the lowering module that registered it ("elementwise", "linalg", ...)
    layout: Callable | str | None = None
    platforms: tuple = ()  # the JAX platforms it lowers on; () for every one
    held: bool = False  # a call of one tensor a reader's program may compute (see the doc)
    shape_only: tuple = ()  # tensor arguments (schema names) read for shape and dtype alone
    constant: Callable | None = None  # the number a call's result holds everywhere

    def shape_depends_on_values(self, values) -> bool:
        """Whether this call's result shape depends on tensor values (see the module doc)."""
        rule = self.data_dependent_shape
        return bool(rule(*values)) if callable(rule) else rule

    def draws_key(self, values) -> bool:
        """Whether this call draws a PRNG key from the device generator (see the module doc)."""
        rule = self.random
        return bool(rule(*values)) if callable(rule) else rule


TABLE: dict[OpOverload, Lowering] = {}
# Meta kernels the lowering modules declare for ops PyTorch has none for (``meta_kernel``).
META_KERNELS: dict[OpOverload, Callable] = {}
# The compiled path's forms of the ops eager serves with device kernels (``graph_form``).
GRAPH_FORMS: dict = {}
# How an op stays exact on inputs padded to a size bucket (``padding_rule``, ``padding.py``);
# the (op, argument index) pairs of arguments that only set a size (``size_arguments``); the
# means and the argument index of their dims (``padded_mean``).
PADDING_RULES: dict = {}
SIZE_ARGUMENTS: set = set()
PADDED_MEANS: dict = {}
# What CPU's kernel refuses and the meta kernel does not (``check``; ``checks.py``).
CHECKS: dict[OpOverload, Callable] = {}
# Ops whose result is a pointwise function of their arguments and of small reductions of them
# (``row_parts``): (the reductions, the result from the arguments and them). A split recording
# (``eager/defer_split.py``) writes the reductions and recomputes the result where it is read.
ROW_PARTS: dict = {}
# Forms of a lowering for a result that is read through a view (``read_form``).
READ_FORMS: dict[OpOverload, Callable] = {}
# Forms of a lowering for arguments a recorded program reads through views (``view_form``).
VIEW_FORMS: dict[OpOverload, Callable] = {}
# Forms of a lowering given the call that produced one of its arguments (``producer_form``):
# op -> (argument position, producer ops, form).
PRODUCER_FORMS: dict[OpOverload, tuple] = {}
# Ops whose float32 transcendentals may take the TPU's fast forms where a recorded program rounds
# their result to half precision right after (``rounded_fast``).
ROUNDED_FAST: set = set()
# The arguments of ops that take a forward's saved statistics (a norm's mean and rstd), which
# PyTorch's meta kernel (and so every executor here) makes float32 for a half input, where CPU's
# kernel keeps the input's dtype and refuses float32 ones (``saved_statistics``):
# op -> argument indices.
SAVED_STATISTICS: dict[OpOverload, tuple] = {}


def channels_last_of(v) -> torch.memory_format | None:
    """v's channels-last format, if it is a 4-d / 5-d tensor laid out so (metadata only)."""
    if isinstance(v, torch.Tensor) and v.dim() in (4, 5):
        fmt = torch.channels_last if v.dim() == 4 else torch.channels_last_3d
        if not v.is_contiguous() and v.is_contiguous(memory_format=fmt):
            return fmt
    return None


def _overloads(target) -> list[OpOverload]:
    if isinstance(target, OpOverload):
        return [target]
    # An OpOverloadPacket means every overload of it that has no out= argument.
    return [
        getattr(target, name)
        for name in target.overloads()
        if not getattr(target, name)._schema.is_mutable
    ]


def lowers(*targets, promote: str | None = None, static_scalars: bool = False,
           data_dependent_shape: bool | Callable = False, random: bool | Callable = False,
           traced: tuple = (), donates: tuple = (), layout: Callable | str | None = None,
           platforms: tuple = (), held: bool = False, shape_only: tuple = (),
           constant: Callable | None = None) -> Callable:
    """Register the decorated pure JAX function as the lowering of each target op; with
    platforms, only there (elsewhere the op runs as if it had none: decomposed or on CPU,
    counted)."""
    if promote not in (None, "result", "common"):
        raise ValueError(f"torchtpu.argument: promote must be None, 'result' or 'common', not "
                         f"{promote!r}")

    def register(fn: Callable) -> Callable:
        family = _registering_module()
        for target in targets:
            for op in _overloads(target):
                if op in TABLE:
                    raise RuntimeError(f"torchtpu.argument: {op} has two lowerings: "
                                       f"{TABLE[op].fn} and {fn}")
                unknown = set(shape_only) - {a.name for a in op._schema.arguments
                                             if a.type.isSubtypeOf(torch._C.TensorType.get())}
                if unknown:
                    raise ValueError(f"torchtpu.argument: shape_only names {sorted(unknown)}, "
                                     f"no tensor argument of {op}")
                TABLE[op] = Lowering(op, fn, promote, static_scalars, data_dependent_shape, random,
                                     tuple(traced), tuple(donates), family,
                                     _pointwise_layout(op, layout), tuple(platforms), held,
                                     tuple(shape_only), constant)
        return fn

    return register


def _pointwise_layout(op: OpOverload, layout: Callable | str | None) -> Callable | str | None:
    # A pointwise op's result is laid out as CPU's TensorIterator lays it out: in its operands'
    # dense order (a transposed, permuted or channels-last input gives a result so strided;
    # broadcast dims do not vote; expanded inputs give row-major), which PyTorch's meta kernels
    # compute by the same rule. User code branches on it (``.view`` of a transposed result
    # raises on CPU; ``is_contiguous`` picks kernels), so it must not come back row-major.
    if layout is None and torch.Tag.pointwise in op.tags:
        return META_STRIDES
    return layout


def _registering_module() -> str:
    # The first caller outside this module: the lowering module whose decorator or lowers_each
    # registered the function (the function's own __module__ may be jax.numpy).
    frame = sys._getframe(1)
    while frame is not None and frame.f_globals.get("__name__") == __name__:
        frame = frame.f_back
    name = frame.f_globals.get("__name__", "") if frame is not None else ""
    return name.rsplit(".", 1)[-1]


def row_parts(*ops, combine: Callable) -> Callable:
    """Declare the decorated function (an op's lowering arguments -> small reductions of them,
    a tuple) and ``combine`` (the arguments, then those reductions -> the op's result) for each
    op in ``ROW_PARTS``."""
    return _declare_once(ROW_PARTS, "row parts", ops, entry=lambda fn: (fn, combine))


def lowers_each(table: dict, **policy) -> None:
    """Register many one-line lowerings at once: {op: fn}, all with the same policy."""
    for op, fn in table.items():
        lowers(op, **policy)(fn)


def _declare_once(table: dict, what: str, ops: tuple, entry: Callable | None = None
                  ) -> Callable:
    """A decorator putting its function (or ``entry(fn)``, what the table holds for it) in
    ``table`` for each op, refusing an op's second."""
    def declare(fn: Callable) -> Callable:
        for op in ops:
            if op in table:
                raise RuntimeError(f"torchtpu.argument: {op} has two {what}: {table[op]} "
                                   f"and {fn}")
            table[op] = fn if entry is None else entry(fn)
        return fn

    return declare


def meta_kernel(*ops: OpOverload) -> Callable:
    """Declare the decorated function as the Meta kernel of each op (registered with PyTorch by
    ``registration.py`` when the device loads, not here)."""
    return _declare_once(META_KERNELS, "meta kernels", ops)


def graph_form(*ops) -> Callable:
    """Declare the decorated JAX function as the compiled-graph form of each op (an ATen op
    eager serves with a device kernel, or a Python operator of size arithmetic)."""
    def declare(fn: Callable) -> Callable:
        for op in ops:
            GRAPH_FORMS[op] = fn
        return fn

    return declare


def check(*targets) -> Callable:
    """Declare the decorated function as the value check of each target op (or op packet):
    ``check(*bound_arguments) -> Exception | None`` (``checks.py`` says what it gets)."""
    def declare(fn: Callable) -> Callable:
        for target in targets:
            for op in _overloads(target):
                CHECKS[op] = fn
        return fn

    return declare


def padding_rule(*ops) -> Callable:
    """Declare the decorated function as the dynamic-shape padding rule of each op:
    ``rule(node, layouts) -> masks`` (``padding.py`` says what it decides)."""
    return _declare_once(PADDING_RULES, "padding rules", ops)


def read_form(*ops: OpOverload) -> Callable:
    """Declare the decorated function as each op's rule for a result read through a view:
    ``rule(geometry) -> fn | None``, given the view Geometry through which a recorded program
    reads the call's one result, gives a lowering function with the op's signature and values
    that lays that result out for the reader (a product written in attention's heads), or None.
    A recorded program (``eager/read_forms.py``) knows its readers; a lowering alone does not."""
    return _declare_once(READ_FORMS, "read forms", ops)


def view_form(*ops: OpOverload) -> Callable:
    """Declare the decorated function as each op's rule for arguments read through views:
    ``rule(reads) -> fn | None``, given how a recorded call reads each of its tensor arguments
    (its spec's entry: a view Geometry, or another read), gives a lowering function with the op's
    signature and values that lets the compiler lay those arguments' arrays out for the call (a
    product contracting attention's heads at their tokens' rank), or None. Applied where a
    recorded program's calls take their read forms (``eager/read_forms.py``), to calls no read
    form replaced."""
    return _declare_once(VIEW_FORMS, "view forms", ops)


def producer_form(*ops: OpOverload, position: int, producers: tuple) -> Callable:
    """Declare the decorated function as each op's form for a call whose argument at
    ``position`` is, in a recorded program, the first result of a call of one of ``producers``,
    read whole: ``form(args, producer_args) -> result``, given the call's arguments and the
    producer's (each as their lowerings get them), computes the op's result from both (an NLL's
    pick from the log-softmax's input, not from its [rows, classes] result). Where the arrays
    do not have the facts the form depends on (shapes, the class dim), it computes the op's own
    lowering. A recorded program (``eager/producer_forms.py``) knows each argument's producer;
    a lowering alone does not."""
    return _declare_once(PRODUCER_FORMS, "producer forms", ops,
                         lambda fn: (position, frozenset(producers), fn))


def rounded_fast(*ops: OpOverload) -> None:
    """Declare ops whose lowerings pass ``tpu_accuracy.rounded()`` as their float32
    transcendentals' accuracy: a recorded program whose reader casts such a call's result to half
    precision right after traces the call for it with the fast forms (``eager/rounded_reads.py``:
    their error, a few float32 ulps, is far below a half-precision ulp of the result)."""
    ROUNDED_FAST.update(ops)


def size_arguments(op: OpOverload, *indices: int) -> None:
    """Declare the arguments of op at indices as ones that only set a size (a slice's end,
    arange's end): a symbolic size there is given its bucket under padding (``padding.py``)."""
    SIZE_ARGUMENTS.update((op, i) for i in indices)


def saved_statistics(op: OpOverload, *indices: int) -> None:
    """Declare the arguments of op at indices a forward's saved statistics: float32 for a half
    input under PyTorch's meta kernel (CUDA's convention, which the forward's lowering follows),
    the input's dtype under CPU's kernel, which refuses float32 ones. What CPU refuses by dtype
    (``eager/refusals.py``) is asked with them in the input's dtype too: the backward of a
    bfloat16 ``layer_norm`` is no error."""
    SAVED_STATISTICS[op] = indices


def padded_mean(op: OpOverload, dims: int | None) -> None:
    """Declare op a mean over the dims its argument ``dims`` holds (None: every dim): on inputs
    padded to a size bucket it runs as the sum of the masked input over the real count."""
    PADDED_MEANS[op] = dims


def lookup(op: OpOverload) -> Lowering | None:
    low = TABLE.get(op)
    if low is not None and low.platforms and platform.platform() not in low.platforms:
        return None
    return low
