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

import argparse
import collections
import contextlib
import dataclasses
import os
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Iterator
from typing import Any, TextIO

import torch
from torch.utils._pytree import tree_flatten

import torchtpu  # noqa: F401  (registers the device)
from torchtpu.testing.compare import assert_same

# The OpInfo tests whose skips, expected failures and tolerances describe a comparison of one
# device against CPU; decorations of other tests (jit, vmap, numpy references...) do not apply.
_TESTS = {
    "forward": ("test_compare_cpu", "test_variant_consistency_eager"),
    "grad": ("test_compare_cpu", "test_variant_consistency_eager", "test_fn_grad"),
}

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

_MISSING = re.compile(r"aten op '([^']+)' has no tpu lowering")


@dataclasses.dataclass
class OpResult:
    """Sample counts for one OpInfo (``name`` includes its variant, e.g. ``max.reduction``)."""

    name: str
    passed: int = 0
    failed: int = 0
    errored: int = 0
    skipped: int = 0
    first_error: str = ""
    missing: collections.Counter = dataclasses.field(default_factory=collections.Counter)

    @property
    def counted(self) -> int:
        return self.passed + self.failed + self.errored

    def note(self, message: str) -> None:
        if not self.first_error:
            self.first_error = message


@dataclasses.dataclass
class Report:
    mode: str
    ops: list[OpResult]
    seconds: float = 0.0

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.ops)

    @property
    def failed(self) -> int:
        return sum(r.failed + r.errored for r in self.ops)

    def missing(self) -> list[tuple[str, int, int]]:
        """(aten op, OpInfos it blocks, samples it blocks), most OpInfos first."""
        ops: collections.Counter = collections.Counter()
        samples: collections.Counter = collections.Counter()
        for r in self.ops:
            for name, n in r.missing.items():
                ops[name] += 1
                samples[name] += n
        return sorted(((k, ops[k], samples[k]) for k in ops), key=lambda t: (-t[1], -t[2], t[0]))

    def format(self, top: int = 25) -> str:
        width = max([len(r.name) for r in self.ops] + [8])
        lines = [f"{'op':<{width}}  pass  fail   err  skip  first error"]
        for r in self.ops:
            lines.append(f"{r.name:<{width}}  {r.passed:4d}  {r.failed:4d}  {r.errored:4d}  "
                         f"{r.skipped:4d}  {r.first_error}")
        missing = self.missing()
        if missing:
            lines.append("")
            lines.append(f"top missing aten ops (OpInfos blocked, samples blocked), "
                         f"{len(missing)} in all:")
            lines.extend(f"  {name:<50} {n_ops:4d} {n_samples:5d}"
                         for name, n_ops, n_samples in missing[:top])
        total = self.passed + self.failed
        fully = sum(1 for r in self.ops if r.counted and r.passed == r.counted)
        lines.append("")
        lines.append(f"mode {self.mode}: {len(self.ops)} OpInfos, {fully} with every sample "
                     f"passing; samples {100.0 * self.passed / max(total, 1):.1f}% passing; "
                     f"{self.seconds:.0f} s")
        lines.append(f"{self.passed} passed, {self.failed} failed")
        return "\n".join(lines)


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


# ----------------------------------------------------------------------------- samples

def _tensors(sample) -> list[torch.Tensor]:
    leaves, _ = tree_flatten((sample.input, sample.args, sample.kwargs))
    return [x for x in leaves if isinstance(x, torch.Tensor)]


def _plain(sample) -> bool:
    return all(type(t) is torch.Tensor and t.layout == torch.strided and not t.is_quantized
               and not t.is_nested for t in _tensors(sample))


def _device_value(v: Any) -> Any:
    if (isinstance(v, torch.device) and v.type == "cpu") or (isinstance(v, str) and v == "cpu"):
        return "tpu"
    return v


def _copy(sample, device: str, cpu_args: bool = False):
    """A detached copy of sample on device; leaves keep requires_grad, device= args follow."""

    def move(t):
        if not isinstance(t, torch.Tensor):
            return t
        return t.detach().to(device, copy=True).requires_grad_(t.requires_grad)

    copy = sample.transform(move)
    if cpu_args:
        copy.args = _copy(sample, "cpu").args
    if device == "tpu":
        copy.args = tuple(_device_value(a) for a in copy.args)
        copy.kwargs = {k: _device_value(v) for k, v in copy.kwargs.items()}
    return copy


def _call(op, sample, seed: int):
    torch.manual_seed(seed)
    out = op(sample.input, *sample.args, **sample.kwargs)
    return sample.output_process_fn_grad(out)


def _run_grad(op, sample, seed: int):
    """Gradients of the sample's float outputs against a fixed random cotangent, or None."""
    inputs = [t for t in _tensors(sample) if t.requires_grad]
    outs = [t for t in tree_flatten(_call(op, sample, seed))[0]
            if isinstance(t, torch.Tensor) and t.requires_grad and t.is_floating_point()]
    if not inputs or not outs:
        return None
    # The cotangent is the same on both devices and in both CPU runs, whatever the seed.
    gen = torch.Generator().manual_seed(1234)
    cotangents = [torch.randn(o.shape, generator=gen, dtype=o.dtype).to(o.device) for o in outs]
    return torch.autograd.grad(outs, inputs, cotangents, allow_unused=True)


def _shorten(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    missing = _MISSING.search(text)
    if missing:
        return f"missing {missing.group(1)}"
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 110 else text[:107] + "..."


def _same(a: Any, b: Any) -> bool:
    try:
        assert_same(a, b, atol=0.0, rtol=0.0)
    except Exception:
        return False
    return True


def _seeds_itself(op) -> bool:
    """Random OpInfos reseed CPU inside the call, so two CPU runs agree but tpu may not."""
    code = getattr(op.op, "__code__", None)
    return code is not None and "wrapper_set_seed" in code.co_names


def _check_sample(op, sample, mode: str, tol: tuple[float, float], result: OpResult) -> None:
    compute = _run_grad if mode == "grad" else _call
    device_sample = _copy(sample, "tpu", cpu_args=op.name in CPU_ARGS)
    cpu_again = _copy(sample, "cpu")
    try:
        expected = compute(op, sample, 0)
        if expected is None:
            result.skipped += 1
            return
        if not _same(compute(op, cpu_again, 1), expected):
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
        result.errored += 1
        missing = _MISSING.search(str(exc))
        if missing:
            result.missing[missing.group(1)] += 1
        result.note(_shorten(exc))
        return
    try:
        assert_same(actual, expected, atol=tol[0], rtol=tol[1])
    except AssertionError as exc:
        if _seeds_itself(op):
            result.skipped += 1  # random: equal seeds do not make tpu and CPU streams equal
            return
        result.failed += 1
        result.note(_shorten(exc))
        return
    result.passed += 1


class _OpTimeout(BaseException):
    """Raised by the alarm; a BaseException so per-sample handlers let it through."""


@contextlib.contextmanager
def _time_limit(seconds: float):
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise _OpTimeout(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_op(op, *, mode: str = "forward", max_samples: int = 3,
             dtype: torch.dtype = torch.float32, timeout: float = 60.0) -> OpResult:
    """Run up to max_samples counted samples of one OpInfo on tpu against CPU."""
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    result = OpResult(name)
    reason = _skip_reason(op, dtype, mode)
    if reason is not None:
        result.first_error = f"(skipped: {reason})"
        return result
    tol = _tolerance(op, dtype, mode)
    seen = 0
    try:
        with _time_limit(timeout):
            torch.manual_seed(0)
            for sample in op.sample_inputs("cpu", dtype, requires_grad=mode == "grad"):
                seen += 1
                # Samples skipped on CPU do not use up the cap, but do bound the search.
                if result.counted >= max_samples or seen > 4 * max_samples:
                    break
                if not _plain(sample):
                    result.skipped += 1
                    continue
                _check_sample(op, sample, mode, tol, result)
    except _OpTimeout as exc:
        result.errored += 1
        result.note(str(exc))
    except Exception as exc:  # generating samples failed: nothing device-specific yet
        if not result.counted:
            result.first_error = f"(skipped: sample generation: {_shorten(exc)})"
    return result


def _op_db():
    from torch.testing._internal.common_methods_invocations import op_db

    return op_db


def run(ops: str | None = None, *, mode: str = "forward", max_samples: int = 3,
        dtype: torch.dtype = torch.float32, timeout_per_op: float = 60.0,
        progress: TextIO | None = None) -> Report:
    """Check every OpInfo whose full name (``name`` or ``name.variant``) matches ops fully."""
    if mode not in _TESTS:
        raise ValueError(f"mode must be one of {sorted(_TESTS)}, not {mode!r}")
    pattern = re.compile(ops) if ops else None
    previous = os.environ.get("TORCHTPU_CPU_FALLBACK")
    os.environ["TORCHTPU_CPU_FALLBACK"] = "error"
    start = time.perf_counter()
    results = []
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            for op in _op_db():
                full = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
                if pattern is not None and not (pattern.fullmatch(full)
                                                or pattern.fullmatch(op.name)):
                    continue
                t0 = time.perf_counter()
                results.append(check_op(op, mode=mode, max_samples=max_samples, dtype=dtype,
                                        timeout=timeout_per_op))
                if progress is not None:
                    r = results[-1]
                    progress.write(f"[{len(results)}] {r.name}: {r.passed}/{r.counted} "
                                   f"({time.perf_counter() - t0:.1f} s)\n")
                    progress.flush()
    finally:
        if previous is None:
            os.environ.pop("TORCHTPU_CPU_FALLBACK", None)
        else:
            os.environ["TORCHTPU_CPU_FALLBACK"] = previous
    return Report(mode, results, time.perf_counter() - start)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtpu.testing.opinfo",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--mode", choices=sorted(_TESTS), default="forward")
    parser.add_argument("--ops", help="regex matched fully against OpInfo names")
    parser.add_argument("--max-samples", type=int, default=3, help="counted samples per op")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--timeout-per-op", type=float, default=60.0, help="seconds; 0: none")
    parser.add_argument("--top", type=int, default=25, help="missing aten ops to list")
    parser.add_argument("--progress", action="store_true", help="one line per op on stderr")
    args = parser.parse_args(argv)
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        parser.error(f"unknown dtype {args.dtype!r}")
    report = run(args.ops, mode=args.mode, max_samples=args.max_samples, dtype=dtype,
                 timeout_per_op=args.timeout_per_op,
                 progress=sys.stderr if args.progress else None)
    print(report.format(top=args.top))
    return 0 if report.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
