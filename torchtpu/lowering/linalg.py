"""Matrix products and linear algebra: mm, bmm, addbmm, ``_grouped_mm`` and the ``_linalg_*``
factorizations.

``addmm``, ``mv``, ``dot``, ``vdot`` and ``baddbmm`` run PyTorch's decompositions into
the products here. Products use JAX's default matmul precision, which ``torch.tpu.precision``
sets (HIGHEST unless changed, so float32 matches the CPU). On a TPU a linear layer's weight
gradient contracts its tokens in blocks (``_rows_in_blocks``), as JAX's autodiff does, and a
vocabulary head reads its rows from behind a barrier (``wide``), computed once.

LU results follow LAPACK: pivots are 1-based int32 row swaps, and ``info`` is the 1-based index of
the first zero pivot (0 when the factorization succeeded), because PyTorch's backward formulas and
error checks read them.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import jax.scipy.linalg as jsl
import torch
from jax import lax

from torchtpu.device import dtypes
from torchtpu.lowering import padding
from torchtpu.lowering.registry import lowers, meta_kernel, padding_rule

aten = torch.ops.aten


HALF = (jnp.bfloat16, jnp.float16)


@lowers(aten.mm.default, aten.bmm.default, promote="result")
def matmul(x: jax.Array, y: jax.Array) -> jax.Array:
    # Half-precision products accumulate in float32 and round once, as PyTorch's kernels do.
    # Asked for a bf16 result instead, the TPU compiler lays a projection's product out
    # column-major and copies it twice on its way into attention (six more copies in an
    # attention block's forward and backward; bench/RESULTS.md, whole3).
    if x.dtype == y.dtype and x.dtype in HALF:
        if weight_gradient(x, y):
            return lax.platform_dependent(x, y, tpu=_rows_in_blocks, default=half_product)
        if wide(x, y):
            x = lax.optimization_barrier(x)
        return half_product(x, y)
    return jnp.matmul(x, y)


def wide(x: jax.Array, y: jax.Array) -> bool:
    # A product whose columns outnumber its contraction many times over: a vocabulary head
    # (8192 x 1024 x 32768). The TPU compiler fuses the computation of its rows (the final
    # norm, the cast to bf16) into the product, which then recomputes them for every block
    # of columns it writes: cheap while the float32 residual stream it reads sits in VMEM,
    # twice the product's own cycles when it does not (10.2 M estimated cycles against 4.7
    # on v5e at 4 x 2048 tokens; bench/RESULTS.md, whole11). Behind a barrier the rows are
    # computed once, as their own fusion, and the product reads them as bf16.
    if not x.ndim == y.ndim == 2 or not all(isinstance(d, int) for d in (*x.shape, *y.shape)):
        return False
    return y.shape[1] >= _WIDE * x.shape[1]


_WIDE = 16


def half_product(x: jax.Array, y: jax.Array) -> jax.Array:
    """x @ y accumulated in float32 and rounded once to x's (half) precision."""
    return jnp.matmul(x, y, preferred_element_type=jnp.float32).astype(x.dtype)


_ROWS = 1024  # a block of the contraction: a sequence's tokens in the chip row's Llama


def weight_gradient(x: jax.Array, y: jax.Array) -> bool:
    # A contraction longer than both of the product's dims: a linear layer's weight gradient
    # mm(g.t(), x) over every token, or a head's input gradient over its vocab. Not the head's
    # weight gradient (vocab x tokens x width): split, the TPU compiler relaid the logits'
    # gradient (bench/RESULTS.md, whole6).
    if not x.ndim == y.ndim == 2 or not all(isinstance(d, int) for d in (*x.shape, *y.shape)):
        return False  # (symbolic sizes: an exported program's)
    (m, k), n = x.shape, y.shape[1]
    return k > max(m, n) and k > _ROWS and k % _ROWS == 0


def _rows_in_blocks(x: jax.Array, y: jax.Array) -> jax.Array:
    # The TPU compiler contracts one long token dim with the gradient token-minor: it lays the
    # residual stream's gradient out column-major and copies into it, and the head's input
    # gradient, written column-major, computes the logits' gradient it reads twice (11.8 M
    # estimated cycles on v5e against 6.1 row-major; bench/RESULTS.md, whole7). Contracted as
    # (blocks, rows), as JAX's autodiff contracts a 3-D activation's (batch, sequence), they
    # stay row-major (the head's input gradient contracts its vocab so too). TPU only: XLA:CPU
    # has no half-precision product over two contracted dims.
    (m, k), n = x.shape, y.shape[-1]
    out = lax.dot_general(x.reshape(m, k // _ROWS, _ROWS), y.reshape(k // _ROWS, _ROWS, n),
                          (((1, 2), (0, 1)), ((), ())), preferred_element_type=jnp.float32)
    return out.astype(x.dtype)


# Dynamic shapes: padding along the contracted dim zeroed on both operands (``padding.py``).
padding_rule(aten.mm.default)(padding.contraction(0, 1, 1, 0))
padding_rule(aten.bmm.default)(padding.contraction(0, 2, 1, 1))


def _group_sizes(offs: jax.Array, total: int) -> jax.Array:
    # offs holds each group's end (int32, cumulative); rows past the last end belong to none
    ends = jnp.clip(offs.astype(jnp.int32), 0, total)
    return jnp.diff(ends, prepend=jnp.zeros((1,), jnp.int32))


@lowers(aten._grouped_mm.default)
def grouped_mm(a: jax.Array, b: jax.Array, offs: jax.Array | None = None, bias=None,
               out_dtype: torch.dtype | None = None) -> jax.Array:
    """One product per group, the groups' extents read from ``offs`` on the device (the MoE
    experts of TorchTitan): no host read, one program whatever the token counts. PyTorch's own
    kernel (CompositeExplicitAutograd) reads ``offs`` on the host and runs one mm per group.
    Meta rejects a bias and a non-bfloat16 out_dtype before this runs. Rows (2D x 3D) or
    columns (3D x 2D) past the last offset are zeros (CPU leaves them uninitialized)."""
    if a.ndim == 3 and b.ndim == 3:  # a batch of products, no offsets
        out = jnp.matmul(a, b)
    elif a.ndim == 2 and b.ndim == 3:  # rows of a grouped, group g times b[g]
        out = lax.ragged_dot(a, b, _group_sizes(offs, a.shape[0]))
    elif a.ndim == 3:  # columns of b grouped, a[g] times them: the transposed 2D x 3D case
        out = lax.ragged_dot(b.T, jnp.swapaxes(a, 1, 2), _group_sizes(offs, b.shape[1])).T
    else:  # the contraction grouped (a weight gradient): one (M, N) product per group
        numbers = lax.RaggedDotDimensionNumbers((([1], [0]), ([], [])),
                                                lhs_ragged_dimensions=[1], rhs_group_dimensions=[])
        out = lax.ragged_dot_general(a, b, _group_sizes(offs, a.shape[1]), numbers)
    return out.astype(a.dtype if out_dtype is None else dtypes.to_jax(out_dtype))


def _scaled_sum(x, product, beta, alpha):
    # beta == 0 means self is ignored, NaNs included.
    return jnp.where(beta == 0, jnp.zeros_like(x), beta * x) + alpha * product


@lowers(aten.addmv.default, promote="result")
def addmv(x, mat, vec, beta=1, alpha=1):
    # Lowered although PyTorch has a decomposition: it calls mv, whose kernel calls addmv.out.
    return _scaled_sum(x, jnp.matmul(mat, vec), beta, alpha)


@lowers(aten.addbmm.default, promote="result")
def addbmm(x, batch1, batch2, beta=1, alpha=1):
    total = jnp.einsum("bij,bjk->ik", batch1, batch2)
    return _scaled_sum(x, total, beta, alpha)


def _mT(a):
    return jnp.swapaxes(a, -1, -2)


def _mH(a):
    return jnp.conj(_mT(a))


def _broadcast_batch(a, b):
    """a and b with their leading (batch) dims broadcast together; last two kept."""
    batch = jnp.broadcast_shapes(a.shape[:-2], b.shape[:-2])
    return (jnp.broadcast_to(a, batch + a.shape[-2:]), jnp.broadcast_to(b, batch + b.shape[-2:]))


def _first_zero(diag):
    """LAPACK-style info: 1-based position of the first zero (or NaN) on diag, else 0."""
    bad = (diag == 0) | jnp.isnan(diag)
    if diag.shape[-1] == 0:  # 0x0 matrices factor fine (argmax has no empty reduction)
        return jnp.zeros(diag.shape[:-1], jnp.int32)
    return jnp.where(bad.any(-1), jnp.argmax(bad, -1) + 1, 0).astype(jnp.int32)


def _lu(a):
    lu, piv, _ = lax.linalg.lu(a)
    return lu, piv + 1


def _lu_as_pytorch_saves(a):
    """The LU PyTorch saves for det/slogdet backward: of A^T for real A, since its backward
    decides by A's contiguity (device tensors reach lowerings contiguous) and then solves with
    adjoint=True. Returns (lu, pivots)."""
    return _lu(a if jnp.iscomplexobj(a) else _mT(a))


def _diag(a):
    return jnp.diagonal(a, axis1=-2, axis2=-1)


@lowers(aten.linalg_lu_factor_ex.default)
def lu_factor_ex(a, pivot=True, check_errors=False):
    # pivot=False has no XLA counterpart; PyTorch only offers it on CUDA.
    lu, piv = _lu(a)
    return lu, piv, _first_zero(_diag(lu))


def _lu_solve(lu, piv, b, left: bool, adjoint: bool):
    """Solve with an LU factorization from _lu: op(A) X = B (left) or X op(A) = B."""
    if not left:
        # X A = B  <=>  A^H X^H = B^H
        return _mH(_lu_solve(lu, piv, _mH(b), True, not adjoint))
    lu, b = _broadcast_batch(lu, b)
    piv = jnp.broadcast_to(piv, lu.shape[:-2] + piv.shape[-1:])
    return jsl.lu_solve((lu, piv - 1), b, trans=2 if adjoint else 0)


@lowers(aten.lu_unpack.default)
def lu_unpack(lu, pivots, unpack_data=True, unpack_pivots=True):
    m, n = lu.shape[-2:]
    k = min(m, n)
    empty = jnp.zeros((0,), lu.dtype)
    perm = lax.linalg.lu_pivots_to_permutation(pivots - 1, m)
    # A = P L U with rows of A permuted by perm in L U: P[perm[i], i] = 1.
    p = jnp.swapaxes(jax.nn.one_hot(perm, m, dtype=lu.dtype), -1, -2) if unpack_pivots else empty
    if not unpack_data:
        return p, empty, empty
    lower = jnp.tril(lu[..., :, :k], -1) + jnp.eye(m, k, dtype=lu.dtype)
    return p, lower, jnp.triu(lu[..., :k, :])


@lowers(aten.linalg_lu.default)
def lu(a, pivot=True):
    return lu_unpack(*_lu(a))


@lowers(aten.linalg_lu_solve.default)
def lu_solve(lu, pivots, b, left=True, adjoint=False):
    return _lu_solve(lu, pivots, b, left, adjoint)


@lowers(aten._linalg_solve_ex.default)
def solve_ex(a, b, left=True, check_errors=False):
    # Unlike det, PyTorch saves the LU of A itself here, and its backward solves with adjoint.
    lu, piv = _lu(a)
    vector = b.ndim == 1 or (b.ndim == a.ndim - 1 and b.shape == a.shape[:-1])
    rhs = jnp.expand_dims(b, -1 if left else -2) if vector else b
    x = _lu_solve(lu, piv, rhs, left, False)
    if vector:
        x = jnp.squeeze(x, -1 if left else -2)
    return x, lu, piv, _first_zero(_diag(lu))


@lowers(aten.linalg_inv_ex.default)
def inv_ex(a, check_errors=False):
    lu, piv = _lu(a)
    eye = jnp.broadcast_to(jnp.eye(a.shape[-1], dtype=a.dtype), a.shape)
    return _lu_solve(lu, piv, eye, True, False), _first_zero(_diag(lu))


def _permutation_sign(piv):
    swaps = (piv != jnp.arange(1, piv.shape[-1] + 1, dtype=piv.dtype)).sum(-1)
    return 1 - 2 * (swaps % 2)


@lowers(aten._linalg_det.default)
def det(a):
    lu, piv = _lu_as_pytorch_saves(a)  # det(A^T) = det(A)
    d = jnp.prod(_diag(lu), -1) * _permutation_sign(piv).astype(lu.dtype)
    return d, lu, piv


@lowers(aten._linalg_slogdet.default)
def slogdet(a):
    lu, piv = _lu_as_pytorch_saves(a)
    diag = _diag(lu)
    absdiag = jnp.abs(diag)
    unit = jnp.where(absdiag == 0, 0, diag / jnp.where(absdiag == 0, 1, absdiag))
    sign = jnp.prod(unit, -1) * _permutation_sign(piv).astype(lu.dtype)
    return sign, jnp.sum(jnp.log(absdiag), -1), lu, piv


def _cholesky(a, upper: bool):
    # LAPACK reads only the named triangle; so does XLA without symmetrize_input.
    lower = lax.linalg.cholesky(_mH(a) if upper else a, symmetrize_input=False)
    return _mH(lower) if upper else lower


@lowers(aten.linalg_cholesky_ex.default)
def cholesky_ex(a, upper=False, check_errors=False):
    factor = _cholesky(a, upper)
    # XLA marks a non positive-definite input with NaNs from the failing column on.
    return factor, _first_zero(jnp.where(jnp.isnan(_diag(factor)), 0, 1))


if hasattr(aten, "cholesky"):  # torch 2.14 dropped aten::cholesky (torch.cholesky decomposes)
    @lowers(aten.cholesky.default)
    def cholesky(a, upper=False):
        return _cholesky(a, upper)


@lowers(aten.linalg_qr.default)
def qr(a, mode="reduced"):
    if mode == "r":
        return jnp.zeros((0,), a.dtype), jnp.linalg.qr(a, mode="r")
    return tuple(jnp.linalg.qr(a, mode=mode))


@lowers(aten._linalg_svd.default)
def svd(a, full_matrices=False, compute_uv=True, driver=None):
    if not compute_uv:
        empty = jnp.zeros((0,), a.dtype)
        return empty, jnp.linalg.svd(a, compute_uv=False), empty
    return tuple(jnp.linalg.svd(a, full_matrices=full_matrices))


@lowers(aten._linalg_eigh.default)
def eigh(a, uplo="L", compute_v=True):
    w, v = jnp.linalg.eigh(a, UPLO=uplo, symmetrize_input=False)
    return w, (v if compute_v else jnp.zeros((0,), a.dtype))


def _triangular_solve(a, b, *, upper: bool, left: bool, transpose: bool, unit: bool):
    a, b = _broadcast_batch(a, b)
    return lax.linalg.triangular_solve(a, b, left_side=left, lower=not upper,
                                       transpose_a=transpose, unit_diagonal=unit)


@lowers(aten.triangular_solve.default)
def triangular_solve(b, a, upper=True, transpose=False, unitriangular=False):
    x = _triangular_solve(a, b, upper=upper, left=True, transpose=transpose, unit=unitriangular)
    return x, jnp.broadcast_to(a, x.shape[:-2] + a.shape[-2:])


@lowers(aten.linalg_solve_triangular.default)
def solve_triangular(a, b, upper, left=True, unitriangular=False):
    return _triangular_solve(a, b, upper=upper, left=left, transpose=False, unit=unitriangular)


def _cholesky_lower(factor, upper: bool):
    return _mH(factor) if upper else factor


@lowers(aten._cholesky_solve_helper.default)
def cholesky_solve_helper(b, factor, upper):
    # A = L L^H: solve L Y = B, then L^H X = Y.
    lower = _cholesky_lower(factor, upper)
    y = _triangular_solve(lower, b, upper=False, left=True, transpose=False, unit=False)
    lower, y = _broadcast_batch(lower, y)
    return lax.linalg.triangular_solve(lower, y, left_side=True, lower=True, transpose_a=True,
                                       conjugate_a=True)


@lowers(aten.cholesky_inverse.default)
def cholesky_inverse(factor, upper=False):
    eye = jnp.broadcast_to(jnp.eye(factor.shape[-1], dtype=factor.dtype), factor.shape)
    return cholesky_solve_helper(eye, factor, upper)


@lowers(aten.geqrf.default)
def geqrf(a):
    # LAPACK's Householder form; XLA has it, but only under jax._src.
    from jax._src.lax.linalg import geqrf as xla_geqrf

    return tuple(xla_geqrf(a))


# PyTorch has no meta kernel for geqrf, and result shapes come from meta kernels.
@meta_kernel(aten.geqrf.default)
def _geqrf_meta(a):
    tau = a.new_empty(a.shape[:-2] + (min(a.shape[-2:]),))
    return a.new_empty(a.shape), tau


@lowers(aten.linalg_householder_product.default)
def householder_product(a, tau):
    return lax.linalg.householder_product(a, tau)


@lowers(aten.ormqr.default)
def ormqr(a, tau, c, left=True, transpose=False):
    return lax.linalg.ormqr(a, tau, c, left=left, transpose=transpose)


# XLA computes a nonsymmetric eig only on CPU (LAPACK geev, so vectors are normalized as
# PyTorch's are); JAX has no TPU or GPU rule ("MLIR translation rule for primitive 'eig' not
# found for platform tpu" on a v5e chip), so there they take the counted CPU fallback.
@lowers(aten.linalg_eig.default, platforms=("cpu",))
def eig(a):
    w, v = lax.linalg.eig(a, compute_left_eigenvectors=False)
    return w, v


@lowers(aten._linalg_eigvals.default, platforms=("cpu",))
def eigvals(a):
    return lax.linalg.eig(a, compute_left_eigenvectors=False, compute_right_eigenvectors=False)[0]


@lowers(aten.linalg_matrix_exp.default)
def matrix_exp(a):
    return jsl.expm(a)


# ----------------------------------------------------------------------------- least squares
# Which results LAPACK's drivers fill, as PyTorch returns them: rank for all but gels, singular
# values for gelsd/gelss, and residuals (squared column norms of A X - B) when m > n for gels, and
# for gelsd/gelss only if every matrix has full rank -- a shape that depends on values, so such
# calls run on concrete arrays. gelsy (the default) never returns residuals. The solution is the
# minimum-norm one every driver computes for the rank it finds, here from the SVD. The backward
# is PyTorch's formula (through pinv), which reads none of these results.

def _lstsq_parts(driver: str | None) -> tuple[bool, bool]:
    """(rank returned, singular values returned) for driver."""
    driver = driver or "gelsy"
    return driver != "gels", driver in ("gelsd", "gelss")


def _lstsq_residuals_depend_on_rank(a, b, rcond=None, driver=None) -> bool:
    return driver in ("gelsd", "gelss") and a.shape[-2] > a.shape[-1]


@lowers(aten.linalg_lstsq.default, data_dependent_shape=_lstsq_residuals_depend_on_rank)
def lstsq(a, b, rcond=None, driver=None):
    m, n = a.shape[-2:]
    vector = b.ndim == a.ndim - 1
    rhs = b[..., None] if vector else b
    a, rhs = _broadcast_batch(a, rhs)
    u, s, vh = jnp.linalg.svd(a, full_matrices=False)
    if rcond is None or rcond < 0:
        rcond = jnp.finfo(a.dtype).eps * max(m, n)
    keep = s > rcond * s[..., :1]
    inv_s = jnp.where(keep, 1 / jnp.where(keep, s, 1), 0).astype(a.dtype)
    x = _mH(vh) @ (inv_s[..., None] * (_mH(u) @ rhs))
    rank = keep.sum(-1).astype(jnp.int64)
    with_rank, with_sv = _lstsq_parts(driver)
    real = s.dtype
    residuals = jnp.zeros((0,), real)
    # Under data_dependent_shape the gelsd/gelss call runs concretely, so rank is concrete here.
    if m > n and (driver == "gels" or (with_sv and bool(jnp.all(rank == n)))):
        residuals = jnp.sum(jnp.abs(a @ x - rhs) ** 2, -2)
    if vector:  # residuals keep their column of one
        x = x[..., 0]
    return (x, residuals, rank if with_rank else jnp.zeros((0,), jnp.int64),
            s if with_sv else jnp.zeros((0,), real))


@meta_kernel(aten.linalg_lstsq.default)
def _lstsq_meta(a, b, rcond=None, *, driver=None):
    m, n = a.shape[-2:]
    vector = b.ndim == a.ndim - 1
    batch = torch.broadcast_shapes(a.shape[:-2], b.shape[:-1] if vector else b.shape[:-2])
    k = () if vector else b.shape[-1:]
    with_rank, with_sv = _lstsq_parts(driver)
    real = a.real.dtype if a.is_complex() else a.dtype
    if m > n and driver in ("gelsd", "gelss"):
        raise NotImplementedError(
            f"torchtpu.unsupported: linalg_lstsq with driver={driver!r} and m > n: whether "
            "residuals are returned "
            "depends on the rank, so the result shapes cannot be known without values")
    res = batch + (k or (1,)) if m > n and driver == "gels" else (0,)
    return (a.new_empty(batch + (n,) + k), a.new_empty(res, dtype=real),
            a.new_empty(batch if with_rank else (0,), dtype=torch.int64),
            a.new_empty(batch + (min(m, n),) if with_sv else (0,), dtype=real))

