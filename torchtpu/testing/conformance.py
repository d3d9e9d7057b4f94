"""What the conformance runners (OpInfo, ModuleInfo, OptimizerInfo) share: the per-entry counts,
the report, the run loop with the CPU fallback switched to an error, and the command line.

Each runner turns one database entry into a :class:`Result` (samples or configurations passed,
failed, errored, skipped); :func:`run_each` walks the database under the shared policy and
:class:`Report` prints the table, the missing aten ops and the pass rate.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import dataclasses
import re
import signal
import sys
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator
from typing import Any, TextIO

from torchtpu import settings
from torchtpu.testing.compare import assert_same

MISSING = re.compile(r"aten op '([^']+)' has no tpu lowering")


@dataclasses.dataclass
class Result:
    """Counts for one database entry (an OpInfo with its variant, a ModuleInfo, ...)."""

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

    def error(self, exc: BaseException, where: str = "") -> None:
        """Count a sample that raised on tpu, remembering the aten op it lacked, if any."""
        self.errored += 1
        missing = MISSING.search(str(exc))
        if missing:
            self.missing[missing.group(1)] += 1
        self.note(where + shorten(exc))

    def mismatch(self, exc: BaseException, where: str = "") -> None:
        self.failed += 1
        self.note(where + shorten(exc))

    def fail(self, exc: BaseException, where: str = "") -> None:
        """A wrong result (an AssertionError from a comparison) or an error on tpu."""
        (self.mismatch if isinstance(exc, AssertionError) else self.error)(exc, where)


@dataclasses.dataclass
class Report:
    """The results of one run; ``entries`` and ``unit`` name what a row and a count are."""

    mode: str
    results: list[Result]
    seconds: float = 0.0
    entries: str = "OpInfos"
    unit: str = "samples"

    @property
    def passed(self) -> int:
        return sum(r.passed for r in self.results)

    @property
    def failed(self) -> int:
        return sum(r.failed + r.errored for r in self.results)

    @property
    def rate(self) -> float:
        return self.passed / max(self.passed + self.failed, 1)

    def missing(self) -> list[tuple[str, int, int]]:
        """(aten op, entries it blocks, samples it blocks), most entries first."""
        entries: collections.Counter = collections.Counter()
        samples: collections.Counter = collections.Counter()
        for r in self.results:
            for name, n in r.missing.items():
                entries[name] += 1
                samples[name] += n
        return sorted(((k, entries[k], samples[k]) for k in entries),
                      key=lambda t: (-t[1], -t[2], t[0]))

    def format(self, top: int = 25) -> str:
        width = max([len(r.name) for r in self.results] + [8])
        lines = [f"{'name':<{width}}  pass  fail   err  skip  first error"]
        for r in self.results:
            lines.append(f"{r.name:<{width}}  {r.passed:4d}  {r.failed:4d}  {r.errored:4d}  "
                         f"{r.skipped:4d}  {r.first_error}")
        missing = self.missing()
        if missing:
            lines.append("")
            lines.append(f"top missing aten ops ({self.entries} blocked, {self.unit} blocked), "
                         f"{len(missing)} in all:")
            lines.extend(f"  {name:<50} {n_entries:4d} {n_samples:5d}"
                         for name, n_entries, n_samples in missing[:top])
        fully = sum(1 for r in self.results if r.counted and r.passed == r.counted)
        lines.append("")
        lines.append(f"mode {self.mode}: {len(self.results)} {self.entries}, {fully} with every "
                     f"{self.unit[:-1]} passing; {self.unit} {100.0 * self.rate:.1f}% passing; "
                     f"{self.seconds:.0f} s")
        lines.append(f"{self.passed} passed, {self.failed} failed")
        return "\n".join(lines)


def shorten(exc: BaseException) -> str:
    text = " ".join(str(exc).split())
    missing = MISSING.search(text)
    if missing:
        return f"missing {missing.group(1)}"
    text = f"{type(exc).__name__}: {text}"
    return text if len(text) <= 110 else text[:107] + "..."


def same(a: Any, b: Any) -> bool:
    """Whether two results are bitwise equal (two CPU runs of something random are not)."""
    try:
        assert_same(a, b, atol=0.0, rtol=0.0)
    except Exception:
        return False
    return True


class Timeout(BaseException):
    """Raised by the alarm; a BaseException so per-sample handlers let it through."""


@contextlib.contextmanager
def time_limit(seconds: float) -> Iterator[None]:
    if not seconds or threading.current_thread() is not threading.main_thread():
        yield
        return

    def expire(signum, frame):
        raise Timeout(f"timed out after {seconds:g} s")

    previous = signal.signal(signal.SIGALRM, expire)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def check_samples(result: Result, samples: Iterable[Any], check: Callable[[Any], None], *,
                  max_samples: int, timeout: float, search: int | None = None) -> Result:
    """check each sample until max_samples are counted, or search samples were seen (a bound
    on a search through skipped ones), within timeout seconds in all."""
    seen = 0
    try:
        with time_limit(timeout):
            for sample in samples:
                seen += 1
                if result.counted >= max_samples or (search is not None and seen > search):
                    break
                check(sample)
    except Timeout as exc:
        result.errored += 1
        result.note(str(exc))
    except Exception as exc:  # generating samples failed: nothing device-specific yet
        if not result.counted:
            result.first_error = f"(skipped: sample generation: {shorten(exc)})"
    return result


@contextlib.contextmanager
def fallback_as_error() -> Iterator[None]:
    """The CPU fallback refused (as ``TORCHTPU_CPU_FALLBACK=error``), and the samples' warnings
    silenced."""
    with settings.CPU_FALLBACK.overridden("error"), warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def run_each(items: Iterable[Any], names: Callable[[Any], Iterable[str]],
             check: Callable[[Any], Result], pattern: str | None,
             progress: TextIO | None = None) -> tuple[list[Result], float]:
    """check every item one of whose names matches pattern fully; (results, seconds)."""
    regex = re.compile(pattern) if pattern else None
    start = time.perf_counter()
    results = []
    with fallback_as_error():
        for item in items:
            if regex is not None and not any(regex.fullmatch(n) for n in names(item)):
                continue
            t0 = time.perf_counter()
            results.append(check(item))
            if progress is not None:
                r = results[-1]
                progress.write(f"[{len(results)}] {r.name}: {r.passed}/{r.counted} "
                               f"({time.perf_counter() - t0:.1f} s)\n")
                progress.flush()
    return results, time.perf_counter() - start


def _dtype(name: str):
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise argparse.ArgumentTypeError(f"unknown dtype {name!r}")
    return dtype


def parser(prog: str, doc: str, filter_flag: str, max_default: int, unit: str = "samples",
           timeout: float = 60.0, dtype: bool = True) -> argparse.ArgumentParser:
    """The options every runner takes: a name filter, a cap, a time limit, the report's length;
    ``--progress`` parses to a stream or None, ``--dtype`` to a torch.dtype."""
    p = argparse.ArgumentParser(prog=prog, description=doc.split("\n\n")[0])
    p.add_argument(filter_flag, help="regex matched fully against the entries' names")
    p.add_argument("--max-samples", type=int, default=max_default,
                   help=f"counted {unit} per entry")
    p.add_argument("--timeout-per-op", type=float, default=timeout,
                   help="seconds per entry; 0: none")
    p.add_argument("--top", type=int, default=25, help="missing aten ops to list")
    p.add_argument("--progress", action="store_const", const=sys.stderr, default=None,
                   help="one line per entry on stderr")
    if dtype:
        p.add_argument("--dtype", type=_dtype, default="float32")
    return p


def finish(report: Report, top: int) -> int:
    """Print the report; the exit status is 0 when nothing failed."""
    print(report.format(top=top))
    return 0 if report.failed == 0 else 1
