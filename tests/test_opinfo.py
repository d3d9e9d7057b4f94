"""The OpInfo conformance runner: its bookkeeping, and a fixed set of common ops that must pass."""

import re

import pytest
import torch
from torch.testing._internal.common_dtype import floating_types
from torch.testing._internal.opinfo.core import ErrorInput, OpInfo, SampleInput

from torchtpu.testing import errors, opinfo

COMMON_OPS = [
    "add", "sub", "mul", "div.no_rounding_mode", "neg", "abs", "exp", "log", "tanh", "sigmoid",
    "pow", "maximum", "clamp", "where", "sum", "mean", "amax", "matmul", "mm", "bmm", "softmax",
    "log_softmax", "nn.functional.relu", "nn.functional.linear", "cat", "stack", "index_select",
    "gather", "transpose", "reshape", "permute", "unsqueeze", "expand",
]


@pytest.mark.parametrize("mode", ["forward", "grad"])
def test_common_ops_pass(mode):
    pattern = "|".join(re.escape(name) for name in COMMON_OPS)
    report = opinfo.run(pattern, mode=mode, max_samples=2)
    table = report.format()
    assert set(COMMON_OPS) <= {r.name for r in report.results}, table
    assert report.failed == 0, table
    # Every op ran samples on the device: an op skipped whole would pass vacuously.
    assert all(r.passed > 0 for r in report.results if r.name in COMMON_OPS), table


# A custom op with only a CPU kernel stands for an aten op that has no tpu lowering.
_lib = torch.library.Library("torchtpu_opinfo_test", "DEF")
_lib.define("twice(Tensor x) -> Tensor")
_lib.impl("twice", lambda x: x * 2, "CPU")


def _fake_opinfo(name, fn, requires_grad_ok=True):
    def samples(op, device, dtype, requires_grad, **kwargs):
        for shape in ((3,), (2, 4)):
            yield SampleInput(torch.randn(shape, device=device, dtype=dtype,
                                          requires_grad=requires_grad))

    return OpInfo(name, op=fn, dtypes=floating_types(), sample_inputs_func=samples,
                  supports_autograd=requires_grad_ok)


def _count(result):
    return result.passed, result.failed, result.errored


def test_runner_counts_pass_mismatch_missing_and_crash(monkeypatch):
    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "error")
    good = opinfo.check_op(_fake_opinfo("good", lambda x: x * 3 + 1), max_samples=2)
    assert _count(good) == (2, 0, 0)

    wrong = opinfo.check_op(
        _fake_opinfo("wrong", lambda x: x + (x.device.type == "tpu")), max_samples=2)
    assert _count(wrong) == (0, 2, 0) and "Mismatched elements" in wrong.first_error

    missing = opinfo.check_op(
        _fake_opinfo("missing", torch.ops.torchtpu_opinfo_test.twice), max_samples=2)
    assert _count(missing) == (0, 0, 2)
    assert missing.missing == {"torchtpu_opinfo_test.twice.default": 2}

    def crash(x):
        if x.device.type == "tpu":
            raise RuntimeError("boom")
        return x

    crashed = opinfo.check_op(_fake_opinfo("crash", crash), max_samples=2)
    assert _count(crashed) == (0, 0, 2) and crashed.first_error == "RuntimeError: boom"

    report = opinfo.Report("forward", [good, wrong, missing, crashed])
    assert report.format().splitlines()[-1] == "2 passed, 6 failed"
    assert report.missing() == [("torchtpu_opinfo_test.twice.default", 1, 2)]


def test_runner_skips_what_fails_on_cpu_and_random_ops():
    def cpu_fails(x):
        raise ValueError("fails everywhere")

    skipped = opinfo.check_op(_fake_opinfo("cpu_fails", cpu_fails), max_samples=2)
    assert _count(skipped) == (0, 0, 0) and skipped.skipped > 0

    noisy = opinfo.check_op(_fake_opinfo("noisy", lambda x: x + torch.rand_like(x)),
                            max_samples=2)
    assert _count(noisy) == (0, 0, 0) and noisy.skipped > 0


def test_grad_mode_compares_gradients():
    good = opinfo.check_op(_fake_opinfo("good", lambda x: (x * x).sum(-1)), mode="grad",
                           max_samples=2)
    assert _count(good) == (2, 0, 0)

    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            ctx.on_tpu = x.device.type == "tpu"
            return x * 2

        @staticmethod
        def backward(ctx, g):
            return g * (3 if ctx.on_tpu else 2)

    wrong = opinfo.check_op(_fake_opinfo("wrong_grad", WrongGrad.apply), mode="grad",
                            max_samples=2)
    assert _count(wrong) == (0, 2, 0)


# One or more OpInfos per mechanism that makes bad input raise as on CPU: argument and data
# checks (uniform_, kthvalue, multinomial, masked_scatter, aminmax, gather bounds), memory
# overlap of out= (cat, take, index_select), CPU's words for what a meta kernel or JAX refused
# (conv2d, mean, embedding, narrow_copy).
ERROR_OPS = [
    "uniform", "kthvalue", "multinomial", "masked_scatter", "aminmax", "gather", "cat", "take",
    "index_select", "nn.functional.conv2d", "mean", "nn.functional.embedding", "narrow_copy",
    "complex",
]


def test_error_inputs_raise_as_on_cpu():
    pattern = "|".join(re.escape(name) for name in ERROR_OPS)
    report = opinfo.run(pattern, mode="errors", max_samples=6)
    table = report.format()
    assert set(ERROR_OPS) <= {r.name for r in report.results}, table
    assert report.failed == 0, table
    assert all(r.passed > 0 for r in report.results if r.name in ERROR_OPS), table


def _fake_error_opinfo(name, fn, error_type=RuntimeError, regex="bad input"):
    def error_inputs(op, device, **kwargs):
        for shape in ((3,), (2, 4)):
            yield ErrorInput(SampleInput(torch.randn(shape, device=device)),
                             error_type=error_type, error_regex=regex)

    return OpInfo(name, op=fn, dtypes=floating_types(), sample_inputs_func=None,
                  error_inputs_func=error_inputs)


def test_errors_mode_counts_acceptance_wrong_errors_and_cpu_acceptance():
    def refuse(x):
        raise RuntimeError("bad input: negative size")

    good = errors.check_op(_fake_error_opinfo("good", refuse))
    assert _count(good) == (2, 0, 0)

    def on_tpu(answer):
        def fn(x):
            if x.device.type == "tpu":
                return answer(x)
            refuse(x)

        return fn

    accepted = errors.check_op(_fake_error_opinfo("accepted", on_tpu(lambda x: x)))
    assert _count(accepted) == (0, 2, 0) and "accepted" in accepted.first_error

    for name, error in (("wrong_type", TypeError("bad input from inside JAX")),
                        ("wrong_words", RuntimeError("something else"))):
        def fail(x, error=error):
            raise error

        wrong = errors.check_op(_fake_error_opinfo(name, on_tpu(fail)))
        assert _count(wrong) == (0, 0, 2) and type(error).__name__ in wrong.first_error

    cpu_accepts = errors.check_op(_fake_error_opinfo("cpu_accepts", lambda x: x))
    assert _count(cpu_accepts) == (0, 0, 0) and cpu_accepts.skipped == 2
