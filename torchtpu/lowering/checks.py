"""What PyTorch's CPU kernels refuse and its meta kernels do not, per op, in one small registry.

Meta kernels check shapes and dtypes; CPU kernels also check argument values (``uniform_`` with
from > to, ``kthvalue``'s k) and, for a few ops, data: index bounds (a device gathers with an
out-of-range index without complaint: XLA clamps it) and ``multinomial``'s probabilities. The
dispatcher looks each op up here and calls its check before running it, in every eager mode,
with the op's bound arguments in schema order: Python values as given, tensors as :class:`Arg`
(shape, ndim and torch dtype; ``arg.values()`` reads the values to the host, so only checks of
data do that). A check returns an exception or None; the dispatcher then raises what CPU
raises for the same call, in PyTorch's words (see ``eager/fallback.cpu_error``), else this one.

Where the values cannot be read without stalling the device (``values()`` gives None), a check
of data hands the device a jittable ``find(values) -> int array [bad, value]`` instead
(``arg.check_on_device``), and its error is raised at the next host read (``device/asserts.py``).
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable

import jax.numpy as jnp
import numpy as np
import torch

from torchtpu.lowering.registry import CHECKS, OpOverload, check, lowers

aten = torch.ops.aten

class Arg:
    """What a check sees of a tensor argument: its shape, ndim and torch dtype, and its values
    through :meth:`values`."""

    __slots__ = ("shape", "ndim", "dtype", "_read", "_on_device")

    def __init__(self, shape: tuple, dtype: torch.dtype,
                 read: Callable[[], np.ndarray | None],
                 on_device: Callable[[Callable, Callable], None] | None = None):
        self.shape, self.ndim, self.dtype, self._read = tuple(shape), len(shape), dtype, read
        self._on_device = on_device

    def values(self) -> np.ndarray | None:
        """The values, read to the host; None where that would stall the device or run a
        DeferAndFuse recording early: then check them with :meth:`check_on_device`."""
        return self._read()

    def check_on_device(self, find: Callable, error: Callable[[int], Exception]) -> None:
        """Check the values on the device: ``find`` (jittable, the same function object for the
        same check, so that its program is reused) maps them to an int array ``[bad, value]``;
        when bad, ``error(value)`` is raised at the next host read."""
        if self._on_device is not None:
            self._on_device(find, error)


def find(op: OpOverload) -> Callable | None:
    return CHECKS.get(op)


def out_of_bounds(index, size: int, dim: int, negative: bool,
                  kind: type[Exception] = IndexError) -> Exception | None:
    """An error of CPU's kind for that op (IndexError; RuntimeError for gather, scatter and
    index_add) for the first value of index outside dimension dim of the given size."""
    if index is None:
        return None
    if index.dtype in (torch.bool, torch.uint8) or 0 in index.shape:
        return None  # masks are checked by shape, which PyTorch's meta kernels already do
    low = -size if negative else 0
    values = index.values()
    if values is None:
        index.check_on_device(_outside(low, size),
                              functools.partial(_out_of_bounds, dim=dim, size=size, kind=kind))
        return None
    bad = (values < low) | (values >= size)
    if not bad.any():
        return None
    return _out_of_bounds(int(values[bad].flat[0]), dim, size, kind)


def _out_of_bounds(value: int, dim: int, size: int, kind: type[Exception]) -> Exception:
    return kind(f"index {value} is out of bounds for dimension {dim} with size {size}")


@functools.lru_cache(maxsize=512)
def _outside(low: int, size: int) -> Callable:
    def find(values):
        bad = ((values < low) | (values >= size)).ravel()
        return jnp.stack([bad.any(), values.ravel()[jnp.argmax(bad)]]).astype(jnp.int64)

    return find


def _dim(x, dim: int) -> int:
    return dim + x.ndim if dim < 0 else dim


def _size(x, dim: int) -> int:
    return x.shape[dim] if x.ndim else 1


@check(aten.gather.default)
def _gather(self, dim, index, *rest):
    d = _dim(self, dim)
    return out_of_bounds(index, _size(self, d), d, negative=False, kind=RuntimeError)


@check(aten.scatter, aten.scatter_add.default, aten.scatter_reduce.two)
def _scatter(self, dim, index, *rest):
    d = _dim(self, dim)
    return out_of_bounds(index, _size(self, d), d, negative=False, kind=RuntimeError)


@check(aten.index_select.default)
def _index_select(self, dim, index):
    d = _dim(self, dim)
    return out_of_bounds(index, _size(self, d), d, negative=False)


@check(aten.embedding.default)
def _embedding(weight, indices, *rest):
    return out_of_bounds(indices, weight.shape[0], 0, negative=False)


def _mask_mismatch(self, d: int, mask) -> IndexError | None:
    indexed = tuple(self.shape[d:d + mask.ndim])
    if indexed != mask.shape:
        return IndexError(f"The shape of the mask {list(mask.shape)} at index {d} does not match "
                          f"the shape of the indexed tensor {list(self.shape)} at index {d}")
    return None


@check(aten.index.Tensor, aten.index_put.default, aten._index_put_impl.default)
def _index(self, indices, values=None, *rest):
    d = 0  # the dimension the next index applies to (a mask covers one per dimension of its own)
    for index in indices:
        if index is not None and index.dtype == torch.uint8:
            # What CPU warns, once per byte mask of each call.
            warnings.warn("torchtpu.check: indexing with dtype torch.uint8 is now deprecated, "
                          "please use a dtype torch.bool instead.", UserWarning, stacklevel=2)
        if index is not None and index.dtype in (torch.bool, torch.uint8):
            err = _mask_mismatch(self, d, index)
            if err is not None:
                return err
            if values is not None and len(indices) == 1:
                err = _masked_values_mismatch(self, index, values)
                if err is not None:
                    return err
            d += index.ndim
            continue
        err = out_of_bounds(index, self.shape[d], d, negative=True) if d < self.ndim else None
        if err is not None:
            return err
        d += 1
    return None


def _masked_values_mismatch(self, mask, values) -> RuntimeError | None:
    ones = mask.values()
    if ones is None:
        return None
    selected = (int(ones.sum()), *self.shape[mask.ndim:])
    try:
        fits = np.broadcast_shapes(values.shape, selected) == selected
    except ValueError:
        fits = False
    if fits:
        return None
    return RuntimeError(f"shape mismatch: value tensor of shape {list(values.shape)} cannot be "
                        f"broadcast to indexing result of shape {list(selected)}")


@check(aten.uniform.default)
def _uniform(self, low=0.0, high=1.0, generator=None):
    if low > high:
        return RuntimeError(f"uniform_ expects to return a [from, to) range, but found "
                            f"from={low} > to={high}")
    return None


# torch._assert_async (TorchTitan's RoPE bounds check): the op itself lowers to nothing (below);
# the assertion is this check, which reads the one value back, as CPU's kernel does.
@check(aten._assert_async.default, aten._assert_async.msg)
def _assert_async(self, assert_msg="Expected Tensor with single nonzero value, but got zero"):
    values = self.values()
    if values is None:
        return None
    if values.size != 1:
        return RuntimeError("Boolean value of Tensor with more than one value is ambiguous")
    return None if values.reshape(()).item() else RuntimeError(assert_msg)


@check(aten.kthvalue.default)
def _kthvalue(self, k, dim=-1, keepdim=False):
    size = _size(self, _dim(self, dim))
    if not 1 <= k <= size:
        return IndexError(f"kthvalue(): selected number k out of range for dimension {dim}")
    return None


@check(aten.aminmax.default)
def _aminmax(self, dim=None, keepdim=False):
    if dim is not None and self.ndim and self.shape[_dim(self, dim)] == 0:
        return IndexError(f"aminmax(): Expected reduction dim {dim} to have non-zero size.")
    return None


@check(aten.masked_scatter.default)
def _masked_scatter(self, mask, source):
    if mask.dtype != torch.bool:
        return RuntimeError(f"masked_scatter_ only supports boolean masks, but got mask with "
                            f"dtype {mask.dtype}")
    available = int(np.prod(source.shape))
    # the mask counts as broadcast with self: a (5, 1, 5) mask over a (5, 0, 5) self has no ones
    shape = tuple(np.broadcast_shapes(self.shape, mask.shape))
    ones = mask.values()
    if ones is None:
        mask.check_on_device(_more_ones_than(available, shape),
                             functools.partial(_source_too_small, available=available))
    elif int(np.broadcast_to(ones, shape).sum()) > available:
        return _source_too_small(int(np.broadcast_to(ones, shape).sum()), available)
    return None


@check(aten.masked_select.default)
def _masked_select(self, mask):
    if mask.dtype != torch.bool:
        return RuntimeError("masked_select: expected BoolTensor for mask")
    return None


def _source_too_small(needed: int, available: int) -> RuntimeError:
    return RuntimeError("masked_scatter: expected source to have at least as many elements as "
                        f"ones in mask ({needed}), got {available}")


@functools.lru_cache(maxsize=512)
def _more_ones_than(available: int, shape: tuple) -> Callable:
    def find(mask):
        ones = jnp.broadcast_to(mask, shape).sum(dtype=jnp.int64)
        return jnp.stack([ones > available, ones]).astype(jnp.int64)

    return find


@check(aten.index_add.default)
def _index_add(self, dim, index, source, alpha=1):
    d = _dim(self, dim)
    expected = [n for i, n in enumerate(self.shape) if i != d]
    got = [n for i, n in enumerate(source.shape) if i != _dim(source, dim)]
    if source.ndim and self.ndim and expected != got:
        return RuntimeError("index_add_(): source tensor shape must match self tensor shape, "
                            "excluding the specified dimension")
    return out_of_bounds(index, _size(self, d), d, negative=False, kind=RuntimeError)


@check(aten.take.default)
def _take(self, index):
    return out_of_bounds(index, int(np.prod(self.shape)), 0, negative=True)


@check(aten.put.default)
def _put(self, index, source, accumulate=False):
    if not accumulate:
        # CPU's put_ alerts in deterministic mode (which of a repeated index's writes lands is
        # not defined): it raises, or warns under warn_only.
        torch._prims_common.alert_not_deterministic("put_")
    return out_of_bounds(index, int(np.prod(self.shape)), 0, negative=True)


@check(aten.multinomial.default)
def _multinomial(self, num_samples, replacement=False, generator=None):
    if not self.dtype.is_floating_point:
        return RuntimeError(f"multinomial only supports floating-point dtypes for input, got: "
                            f"{self.dtype}")
    if num_samples <= 0:
        return RuntimeError("cannot sample n_sample <= 0 samples")
    categories = self.shape[-1] if self.ndim else 1
    if categories > 2**24:
        return RuntimeError("number of categories cannot exceed 2^24")
    if not replacement and num_samples > categories:
        return RuntimeError("cannot sample n_sample > prob_dist.size(-1) samples without "
                            "replacement")
    p = self.values()
    if p is None:
        self.check_on_device(_bad_distribution, _distribution_error)
        return None
    return _distribution_error(int(_bad_distribution(p)[1]))


# What is wrong with multinomial's probabilities, by code (0: nothing), in CPU's words.
_DISTRIBUTION_ERRORS = {1: "probability tensor contains either `inf`, `nan` or element < 0",
                        2: "invalid multinomial distribution (sum of probabilities <= 0)"}


def _bad_distribution(p):
    xp = np if isinstance(p, np.ndarray) else jnp
    code = xp.where(~(xp.isfinite(p) & (p >= 0)).all(), 1, xp.where((p.sum(-1) <= 0).any(), 2, 0))
    return xp.stack([code > 0, code]).astype(xp.int64)


def _distribution_error(code: int) -> RuntimeError | None:
    return RuntimeError(_DISTRIBUTION_ERRORS[code]) if code else None


@check(aten._histogramdd_bin_edges.default, aten._histogramdd_from_bin_cts.default,
       aten._histogramdd_from_bin_tensors.default)
def _histogramdd(self, bins, *rest):
    if self.ndim and len(bins) != self.shape[-1]:
        return RuntimeError("histogramdd: The size of bins must be equal to the innermost "
                            "dimension of the input.")
    return None


@check(aten.multinomial.out)
def _multinomial_out(self, num_samples, replacement=False, generator=None, out=None):
    if out.dtype != torch.int64:
        return RuntimeError(f"multinomial expects Long tensor out, got: {out.dtype}")
    return _multinomial(self, num_samples, replacement, generator)


@check(aten.aminmax.out)
def _aminmax_out(self, dim=None, keepdim=False, min=None, max=None):
    for out in (min, max):
        if out.dtype != self.dtype:
            return RuntimeError(f"Expected out tensor to have dtype {self.dtype}, but got "
                                f"{out.dtype} instead")
    return _aminmax(self, dim, keepdim)


def _same_dtype(expected: torch.dtype, out) -> RuntimeError | None:
    if out.dtype != expected:
        return RuntimeError(f"expected scalar_type {expected} but found {out.dtype}")
    return None


@check(aten.nll_loss_forward.default, aten.nll_loss2d_forward.default)
def _nll_loss(self, target, weight, reduction=1, ignore_index=-100):
    # CPU's kernel wants the class weights in the input's dtype; the meta kernel does not check.
    if weight is not None and weight.dtype != self.dtype:
        return RuntimeError(f"expected scalar type {self.dtype} but found {weight.dtype}")
    # Its class indices must name a class (but ignore_index); a device would gather a clamped or
    # undefined value (cross_entropy would return nan).
    classes = self.shape[0] if self.ndim == 1 else self.shape[1]
    if 0 in target.shape:
        return None
    values = target.values()
    if values is None:
        target.check_on_device(_target_outside(classes, ignore_index), _target_out_of_bounds)
        return None
    bad = ((values < 0) | (values >= classes)) & (values != ignore_index)
    return _target_out_of_bounds(int(values[bad].flat[0])) if bad.any() else None


def _target_out_of_bounds(value: int) -> IndexError:
    return IndexError(f"Target {value} is out of bounds.")


@functools.lru_cache(maxsize=512)
def _target_outside(classes: int, ignore_index: int) -> Callable:
    def find(values):
        bad = (((values < 0) | (values >= classes)) & (values != ignore_index)).ravel()
        return jnp.stack([bad.any(), values.ravel()[jnp.argmax(bad)]]).astype(jnp.int64)

    return find


# These out= kernels want their outputs' dtypes exactly (CPU's
# check_scalar_type_device_layout_equal); their meta kernels cast.
@check(aten.logcumsumexp.out)
def _logcumsumexp_out(self, dim, out=None):
    return _same_dtype(self.dtype, out)


@check(aten.cummax.out, aten.cummin.out)
def _cumulative_extreme_out(self, dim, values=None, indices=None):
    return _same_dtype(self.dtype, values) or _same_dtype(torch.int64, indices)


_COMPLEX = {torch.float16: torch.complex32, torch.float32: torch.complex64,
            torch.float64: torch.complex128}


@check(aten.complex.out)
def _complex_out(real, imag, out=None):
    expected = _COMPLEX.get(real.dtype) if real.dtype == imag.dtype else None
    if expected is not None and out.dtype != expected:
        return RuntimeError(f"Expected object of scalar type {expected} but got scalar type "
                            f"{out.dtype} for argument 'out'")
    return None


# CPU's upsampling kernels take floating inputs, and uint8 but in linear 1-d and trilinear 3-d;
# the meta kernels and the decompositions take any dtype.
_UPSAMPLE_UINT8 = (aten.upsample_nearest1d, aten.upsample_nearest2d, aten.upsample_nearest3d,
                   aten._upsample_nearest_exact1d, aten._upsample_nearest_exact2d,
                   aten._upsample_nearest_exact3d, aten.upsample_bilinear2d,
                   aten.upsample_bicubic2d, aten._upsample_bilinear2d_aa,
                   aten._upsample_bicubic2d_aa)


def _upsample_refused(x, uint8: bool) -> NotImplementedError | None:
    if x.dtype.is_floating_point or x.dtype.is_complex or (uint8 and x.dtype == torch.uint8):
        return None
    return NotImplementedError(f"torchtpu.lowering: upsampling is not implemented for {x.dtype} "
                               f"inputs (as on CPU): use a floating dtype")


@check(*_UPSAMPLE_UINT8)
def _upsample(x, *rest):
    return _upsample_refused(x, uint8=True)


@check(aten.upsample_linear1d, aten.upsample_trilinear3d)
def _upsample_no_uint8(x, *rest):
    return _upsample_refused(x, uint8=False)


@lowers(aten._assert_async.default, aten._assert_async.msg)
def _assert_async_lowering(self, assert_msg=None):
    return ()
