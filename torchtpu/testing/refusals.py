"""Dtype refusals against CPU: every dtype (and mixed dtypes) of every OpInfo, refused alike.

``python -m torchtpu.testing.refusals [--ops REGEX] [--mode strict|debug|defer_and_fuse]``
takes each OpInfo of ``op_db``, generates one sample on CPU in a base dtype it supports (float32
where it can), and casts the sample's base-dtype tensors to each dtype of :data:`DTYPES`: all of
them (``uniform``), or all but the first (``mixed``: ``mm(float, long)``), so index tensors and
masks keep theirs. Each variant runs on CPU, then on a tpu copy with its results read back (a
check that runs on the device raises there). A variant CPU refuses passes when tpu raises the
same exception type with the same message; tpu accepting it is a silently wrong answer
(``failed``); another error is ``errored``. With ``--over`` the variants CPU accepts run on tpu
too: one tpu refuses is counted in ``over``; one both accept is not counted (values are the
forward mode's business, ``opinfo``).

The rate is the share of CPU's refusals that tpu makes in CPU's words.
"""

from __future__ import annotations

import dataclasses
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import torch

from torchtpu.eager import modes
from torchtpu.testing import conformance, op_samples
from torchtpu.testing.conformance import Report, Result, shorten
from torchtpu.testing.errors import _raise
from torchtpu.testing.opinfo import CPU_ARGS, _op_db

DTYPES = (torch.bool, torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
          torch.float16, torch.bfloat16, torch.float32, torch.float64, torch.complex64,
          torch.complex128)

MODES = {"strict": modes.EagerMode.DEFER_NEVER,
         "debug": modes.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING,
         "defer_and_fuse": modes.EagerMode.DEFER_AND_FUSE}


@dataclasses.dataclass
class Counts(Result):
    """A Result whose ``passed`` are CPU's refusals made alike; ``over`` counts variants CPU
    accepts that tpu refuses."""

    over: int = 0
    over_error: str = ""


def _base_dtype(op) -> torch.dtype | None:
    supported = op.supported_dtypes("cpu")
    for dtype in (torch.float32, torch.float64, torch.int64, torch.bool):
        if dtype in supported:
            return dtype
    return None


def _cast(sample, base: torch.dtype, dtype: torch.dtype, skip_first: bool):
    """A copy of sample whose tensors of the base dtype are cast to dtype (but the first one,
    with skip_first); None when nothing would change."""
    seen = [0]

    def cast(t):
        if not isinstance(t, torch.Tensor) or t.dtype != base:
            return t
        seen[0] += 1
        if skip_first and seen[0] == 1:
            return t.detach().clone()
        return t.detach().to(dtype)

    copy = sample.transform(cast)
    if seen[0] < (2 if skip_first else 1):
        return None
    return copy


def variants(sample, base: torch.dtype) -> Iterator[tuple[str, Any]]:
    """(label, sample) for each dtype other than base, uniform then mixed."""
    for skip_first, kind in ((False, "uniform"), (True, "mixed")):
        for dtype in DTYPES:
            if dtype == base:
                continue
            cast = _cast(sample, base, dtype, skip_first)
            if cast is not None:
                yield f"{kind} {str(dtype).removeprefix('torch.')}", cast


def _check_variant(op, label: str, sample, result: Counts, over: bool) -> None:
    device_sample = op_samples.copy(sample, "tpu", cpu_args=op.name in CPU_ARGS)
    torch.manual_seed(0)
    expected = _raise(op, sample)
    if expected is None and not over:
        return
    torch.manual_seed(0)
    actual = _raise(op, device_sample)
    if expected is None:
        if actual is not None:
            result.over += 1
            if not result.over_error:
                result.over_error = f"{label}: {shorten(actual)}"
        return
    if actual is None:
        result.mismatch(AssertionError(f"accepted; CPU raises {shorten(expected)}"), f"{label}: ")
    elif type(actual) is type(expected) and str(actual) == str(expected):
        result.passed += 1
    else:
        result.error(actual, f"{label}: want {shorten(expected)}, got ")


def check_op(op, *, over: bool = True, timeout: float = 120.0) -> Counts:
    """Run every dtype variant of the first usable sample of one OpInfo; without over, only
    those CPU refuses run on tpu."""
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    result = Counts(name)
    base = _base_dtype(op)
    if base is None:
        result.first_error = "(skipped: no base dtype)"
        return result

    def samples():
        torch.manual_seed(0)
        for sample in op.sample_inputs("cpu", base):
            if op_samples.plain(sample) and op_samples.tensors(sample):
                yield sample
                return

    def check(sample):
        for label, variant in variants(sample, base):
            try:
                _check_variant(op, label, variant, result, over)
            except Exception as exc:  # a copy to tpu that fails: a dtype tpu cannot hold
                result.error(exc, f"{label}: ")

    return conformance.check_samples(result, samples(), check, max_samples=1000,
                                     timeout=timeout)


def run(ops: str | None = None, *, mode: str = "strict", over: bool = True,
        timeout_per_op: float = 120.0, progress: TextIO | None = None) -> Report:
    """Check every OpInfo whose full name (``name`` or ``name.variant``) matches ops fully."""
    if mode not in MODES:
        raise ValueError(f"torchtpu.argument: mode must be one of {tuple(MODES)}, not {mode!r}")

    def names(op):
        return op.name, op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")

    with modes.set_eager_mode(MODES[mode]):
        results, seconds = conformance.run_each(
            _op_db(), names, lambda op: check_op(op, over=over, timeout=timeout_per_op), ops,
            progress)
    return Report(f"refusals ({mode})", results, seconds, unit="refusals")


def summary(report: Report, over: bool) -> str:
    """The rate line, and (over) how many variants CPU accepts that tpu refuses."""
    refused = report.passed + report.failed
    accepted = sum(r.failed for r in report.results)
    line = (f"{report.passed} of {refused} CPU refusals made alike "
            f"({100.0 * report.rate:.1f}%); {accepted} accepted on tpu; "
            f"{refused - report.passed - accepted} refused otherwise")
    if over:
        line += (f"; {sum(r.over for r in report.results if isinstance(r, Counts))} variants "
                 "CPU accepts refused on tpu")
    return line


def main(argv: list[str] | None = None) -> int:
    parser = conformance.parser("python -m torchtpu.testing.refusals", __doc__, "--ops", 1,
                                timeout=120.0, dtype=False)
    parser.add_argument("--mode", choices=tuple(MODES), default="strict")
    parser.add_argument("--over", action="store_true",
                        help="also run the variants CPU accepts on tpu, and list the OpInfos "
                             "with some that tpu refuses (about twice as long)")
    args = parser.parse_args(argv)
    report = run(args.ops, mode=args.mode, over=args.over, timeout_per_op=args.timeout_per_op,
                 progress=args.progress)
    print(report.format(top=args.top))
    if args.over:
        for r in report.results:
            if isinstance(r, Counts) and r.over:
                print(f"over {r.name}: {r.over}  {r.over_error}")
    print(summary(report, args.over))
    return 0 if report.failed == 0 else 1


if __name__ == "__main__":
    sys.exit(main())
