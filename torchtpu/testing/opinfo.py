"""OpInfo conformance: PyTorch's own op database run on device "tpu" against CPU.

``python -m torchtpu.testing.opinfo [--mode forward|grad] [--ops REGEX] [--max-samples N]``
takes every OpInfo in ``torch.testing._internal.common_methods_invocations.op_db``, generates its
sample inputs on CPU, runs each sample on CPU and on a tpu copy, and compares the results (forward
mode) or the gradients of the outputs against a random cotangent (grad mode). The CPU fallback is
switched to an error, so a sample that needs an op without a lowering fails and the missing aten
op is reported; the most common ones are listed at the end.

What is not counted: what the OpInfo itself skips or expects to fail on CPU for the tests that
compare devices, samples that raise on CPU too, samples whose results are random (they differ
between two CPU runs with different seeds, or the OpInfo reseeds and the tpu result differs,
since tpu and CPU draw different streams), and samples with sparse, quantized, nested or
subclass tensors. ``failed`` in the last line counts both wrong results and errors.
"""

from __future__ import annotations

import sys
from collections.abc import Iterator
from typing import Any, TextIO

import torch
from torch.utils._pytree import tree_flatten

import torchtpu  # noqa: F401  (registers the device)
from torchtpu.testing import conformance, errors, op_samples
from torchtpu.testing.compare import assert_same
from torchtpu.testing.conformance import Report, Result, same

# The OpInfo tests whose skips, expected failures and tolerances describe a comparison of one
# device against CPU; decorations of other tests (jit, vmap, numpy references...) do not apply.
_TESTS = {
    "forward": ("test_compare_cpu", "test_variant_consistency_eager"),
    "grad": ("test_compare_cpu", "test_variant_consistency_eager", "test_fn_grad"),
}

# errors: the OpInfos' error_inputs, which must raise on tpu as on CPU (testing/errors.py).
MODES = (*_TESTS, "errors")

_DEFAULT_TOL = {torch.float32: (1e-5, 1.3e-6), torch.float64: (1e-7, 1e-7)}

# float32 (atol, rtol) where XLA legitimately differs from PyTorch's CPU kernels: different but
# equally valid polynomial approximations of transcendental functions (a few ulps), and sums or
# dot products accumulated in another order.
LOOSER: dict[str, tuple[float, float]] = {
    name: (1e-5, 1e-5)
    for name in (
        "exp", "exp2", "expm1", "log", "log2", "log10", "log1p", "pow", "float_power",
        "sin", "cos", "tan", "asin", "acos", "atan", "atan2", "sinh", "cosh", "tanh",
        "asinh", "acosh", "atanh", "sigmoid", "logit", "erf", "erfc", "erfinv", "lgamma",
        "digamma", "rsqrt", "sqrt", "special.erfcx", "nn.functional.gelu",
        "nn.functional.silu", "nn.functional.mish", "nn.functional.softplus",
        "nn.functional.elu", "nn.functional.selu", "nn.functional.celu",
        "softmax", "log_softmax", "nn.functional.softmin", "logsumexp", "logaddexp",
        "sum", "mean", "var", "std", "var_mean", "std_mean", "cumsum", "prod", "cumprod",
        "matmul", "mm", "bmm", "addmm", "addmv", "mv", "baddbmm", "addbmm", "einsum",
        "nn.functional.linear", "nn.functional.conv1d", "nn.functional.conv2d",
        "nn.functional.layer_norm", "nn.functional.group_norm", "nn.functional.batch_norm",
        "nn.functional.normalize", "norm", "linalg.vector_norm", "dist", "cdist",
    )
}
# The CTC gradient is exp(log_alpha + log_beta + nll - log_prob), a difference of log-space sums
# of ~100 in magnitude over every alignment: in float32 both CPU and tpu land ~1e-4 from the
# float64 result (measured on the OpInfo samples) and ~2e-5 from each other.
LOOSER["nn.functional.ctc_loss"] = (5e-5, 1e-5)

# OpInfos whose samples pass a tensor that PyTorch requires on CPU (split points, sizes): their
# positional args stay on CPU in the device copy.
CPU_ARGS = {"tensor_split"}


def _eig_order(w: torch.Tensor) -> torch.Tensor:
    """Eigenvalues sorted by real part, then imaginary part; the real part rounded to 1e-3 so
    that a conjugate pair whose real parts differ in the last bit sorts alike on both devices."""
    w = w.detach().cpu()
    by_imag = w.imag.argsort(dim=-1, stable=True)
    real = (w.real * 1e3).round().gather(-1, by_imag)
    return by_imag.gather(-1, real.argsort(dim=-1, stable=True))


def _canonical_eig(out: Any) -> Any:
    w, v = (out, None) if isinstance(out, torch.Tensor) else out
    order = _eig_order(w).to(w.device)
    if v is None:
        return w.gather(-1, order)
    return w.gather(-1, order), v.gather(-1, order.unsqueeze(-2).expand_as(v))


def _canonical_qr(out: Any) -> Any:
    q, r = out
    k = min(r.shape[-2:])
    phase = torch.sgn(r.diagonal(dim1=-2, dim2=-1))
    phase = torch.where(phase == 0, torch.ones_like(phase), phase)
    r = torch.cat([r[..., :k, :] * phase.conj().unsqueeze(-1), r[..., k:, :]], -2)
    if q.numel():
        q = torch.cat([q[..., :k] * phase.unsqueeze(-2), q[..., k:]], -1)
    return q, r


# Results defined only up to order, sign or phase (eigenvalue order and QR's column signs are
# each implementation's choice) are brought to one form on each device before comparing. The
# OpInfos themselves already compare eigenvector and singular vector magnitudes only.
CANONICAL = {"linalg.eig": _canonical_eig, "linalg.eigvals": _canonical_eig,
             "linalg.qr": _canonical_qr}


# ----------------------------------------------------------------------------- OpInfo metadata

def _decorations(op, dtype: torch.dtype, mode: str) -> Iterator[Any]:
    """The decorators the OpInfo applies to its device-comparison tests on CPU for dtype."""
    from torch.testing._internal.opinfo.core import DecorateInfo

    for info in op.decorators:
        if not isinstance(info, DecorateInfo):
            yield info
            continue
        if info.test_name is not None and info.test_name not in _TESTS[mode]:
            continue
        if info.dtypes is not None and dtype not in info.dtypes:
            continue
        if info.active_if is False or (callable(info.active_if) and not info.active_if({})):
            continue
        for decorator in info.decorators:
            yield info.device_type, decorator


def _skip_reason(op, dtype: torch.dtype, mode: str) -> str | None:
    if dtype not in op.supported_dtypes("cpu"):
        return f"{dtype} not supported on CPU"
    if mode == "grad" and (not op.supports_autograd
                           or dtype not in op.supported_backward_dtypes("cpu")):
        return "no autograd"
    for item in _decorations(op, dtype, mode):
        if not isinstance(item, tuple) or item[0] not in (None, "cpu"):
            continue
        name = getattr(item[1], "__qualname__", "")
        if name == "expectedFailure" or name == "skip" or name.startswith("skip."):
            return "skipped by its OpInfo"
    return None


def _tolerance(op, dtype: torch.dtype, mode: str) -> tuple[float, float]:
    """The loosest of the defaults, the OpInfo's own overrides (any device) and LOOSER."""
    atol, rtol = _DEFAULT_TOL.get(dtype, (1e-5, 1.3e-6))
    if dtype == torch.float32 and op.name in LOOSER:
        atol, rtol = (max(atol, LOOSER[op.name][0]), max(rtol, LOOSER[op.name][1]))
    for item in _decorations(op, dtype, mode):
        decorator = item[1] if isinstance(item, tuple) else item
        if type(decorator).__name__ == "toleranceOverride" and dtype in decorator.d:
            tol = decorator.d[dtype]
            atol, rtol = max(atol, tol.atol), max(rtol, tol.rtol)
        elif type(decorator).__name__ == "precisionOverride" and dtype in decorator.d:
            atol = max(atol, decorator.d[dtype])
    return atol, rtol


def _call(op, sample, seed: int):
    torch.manual_seed(seed)
    out = sample.output_process_fn_grad(op(sample.input, *sample.args, **sample.kwargs))
    canonical = CANONICAL.get(op.name)
    return out if canonical is None else canonical(out)


def _run_grad(op, sample, seed: int):
    """Gradients of the sample's float outputs against a fixed random cotangent, or None."""
    inputs = [t for t in op_samples.tensors(sample) if t.requires_grad]
    outs = [t for t in tree_flatten(_call(op, sample, seed))[0]
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not inputs or not outs:
        return None
    # The cotangent is the same on both devices and in both CPU runs, whatever the seed.
    gen = torch.Generator().manual_seed(1234)
    cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs]
    return torch.autograd.grad(outs, inputs, cotangents, allow_unused=True)


def _seeds_itself(op) -> bool:
    """Random OpInfos reseed CPU inside the call, so two CPU runs agree but tpu may not."""
    code = getattr(op.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


def _check_sample(op, sample, mode: str, tol: tuple[float, float], result: Result) -> None:
    compute = _run_grad if mode == "grad" else _call
    device_sample = op_samples.copy(sample, "tpu", cpu_args=op.name in CPU_ARGS)
    cpu_again = op_samples.copy(sample, "cpu")
    try:
        expected = compute(op, sample, 0)
        if expected is None:
            result.skipped += 1
            return
        if not same(compute(op, cpu_again, 1), expected):
            result.skipped += 1  # random: two CPU runs with different seeds differ
            return
    except Exception:
        result.skipped += 1  # fails on CPU too: not ours to count
        return
    if any(t.layout != torch.strided for t in tree_flatten(expected)[0]
           if isinstance(t, torch.Tensor)):
        result.skipped += 1
        return
    try:
        actual = compute(op, device_sample, 0)
        on_cpu = [t for t in tree_flatten(actual)[0]
                  if isinstance(t, torch.Tensor) and t.device.type != "tpu"]
        if on_cpu:
            raise AssertionError(f"a result is on {on_cpu[0].device}, not tpu")
    except Exception as exc:  # one broken op must not stop the run
        result.error(exc)
        return
    try:
        assert_same(actual, expected, atol=tol[0], rtol=tol[1])
    except AssertionError as exc:
        if _seeds_itself(op):
            result.skipped += 1  # random: equal seeds do not make tpu and CPU streams equal
            return
        result.mismatch(exc)
        return
    result.passed += 1


def check_op(op, *, mode: str = "forward", max_samples: int = 3,
             dtype: torch.dtype = torch.float32, timeout: float = 60.0) -> Result:
    """Run up to max_samples counted samples of one OpInfo on tpu against CPU."""
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    result = Result(name)
    reason = _skip_reason(op, dtype, mode)
    if reason is not None:
        result.first_error = f"(skipped: {reason})"
        return result
    tol = _tolerance(op, dtype, mode)

    def samples():
        torch.manual_seed(0)
        yield from op.sample_inputs("cpu", dtype, requires_grad=mode == "grad")

    def check(sample):
        if not op_samples.plain(sample):
            result.skipped += 1
        else:
            _check_sample(op, sample, mode, tol, result)

    # Samples skipped on CPU do not use up the cap, but do bound the search.
    return conformance.check_samples(result, samples(), check, max_samples=max_samples,
                                     timeout=timeout, search=4 * max_samples)


def _op_db():
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def run(ops: str | None = None, *, mode: str = "forward", max_samples: int = 3,
        dtype: torch.dtype = torch.float32, timeout_per_op: float = 60.0,
        progress: TextIO | None = None) -> Report:
    """Check every OpInfo whose full name (``name`` or ``name.variant``) matches ops fully."""
    if mode not in MODES:
        raise ValueError(f"torchtpu.argument: mode must be one of {MODES}, not {mode!r}")

    def names(item):
        op = item[0]
        return op.name, op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")

    def check(item):
        op, sparse = item
        if mode == "errors":
            run_op = errors.check_sparse if sparse else errors.check_op
            return run_op(op, max_samples=max_samples, timeout=timeout_per_op)
        return check_op(op, mode=mode, max_samples=max_samples, dtype=dtype,
                        timeout=timeout_per_op)

    # errors mode: each OpInfo's error_inputs, then, for those that have them, its sparse ones.
    items = [(op, False) for op in _op_db()]
    if mode == "errors":
        items += [(op, True) for op in _op_db() if op.error_inputs_sparse_func is not None]
    results, seconds = conformance.run_each(items, names, check, ops, progress)
    return Report(mode, results, seconds)


def main(argv: list[str] | None = None) -> int:
    parser = conformance.parser("python -m torchtpu.testing.opinfo", __doc__, "--ops", 3)
    parser.add_argument("--mode", choices=MODES, default="forward")
    args = parser.parse_args(argv)
    return conformance.finish(run(args.ops, mode=args.mode, max_samples=args.max_samples,
                                  dtype=args.dtype, timeout_per_op=args.timeout_per_op,
                                  progress=args.progress), args.top)


if __name__ == "__main__":
    sys.exit(main())
