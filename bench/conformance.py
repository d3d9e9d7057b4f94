"""Conformance with PyTorch's own device-generic tests: runs a PyTorch test file written for
``instantiate_device_type_tests`` for CPU and for tpu, pairs every tpu test with its CPU twin,
and reports per file how many of the tests that pass on CPU pass on tpu, with the tpu failures
grouped by cause (exception type and the start of its message).

    python bench/conformance.py --tests-dir /work/pytorch-tests test_view_ops.py [-k EXPR]

PyTorch's test files are not part of this repository: they are read from ``--tests-dir``.
Each file runs in a child pytest that loads this module as a plugin (``-p conformance``). The
plugin bounds every test with an alarm and appends each outcome to a JSON-lines log as it
happens, so a child that crashes or hangs in native code loses nothing: the runner kills it, counts
the test it was in as crashed, and starts a new child without the tests already done.
Missing lowerings are errors, not silent CPU fallbacks (``TORCHTPU_CPU_FALLBACK=error``), so the
rate measures what runs on the device. Failures refused by design (sparse, quantized) or due to
a test's CPU-or-CUDA assumption are listed in ``EXPECTED`` and reported apart, not counted.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import time
from collections import Counter, defaultdict
from pathlib import Path

LOG_ENV = "TORCHTPU_CONFORMANCE_LOG"
TIMEOUT_ENV = "TORCHTPU_CONFORMANCE_TIMEOUT"
# The class suffix instantiate_device_type_tests gives each device (PrivateUse1's is its generic
# name), and the device string inside the test names.
CLASS_SUFFIXES = {"CPU": "cpu", "PRIVATEUSE1": "tpu", "TPU": "tpu"}
# tpu failures expected by design, matched on the generic test name or on the failure's cause:
# (what, pattern, why). They are reported apart, with the reason, and not counted in the rate.
EXPECTED = (
    ("test", r"^test_tensor_storage_type(_|$)",
     "the test expects CPU's torch.<X>Storage on every device but CUDA; PyTorch's storage_type() "
     "gives torch.tpu.<X>Storage for a PrivateUse1 device"),
    ("test", r"^test_upsamplingBiMode2d_nonsupported_dtypes_.*_mode_(bilinear|bicubic)_uint8",
     "the test expects every device but CPU to refuse uint8 bilinear/bicubic upsampling (CUDA's "
     "rule), while test_upsamplingBiMode2d_consistency expects uint8 to work on every device but "
     "CUDA; tpu computes uint8 as CPU does"),
    ("cause", r"sparse tensors \(.*\) are not supported on tpu",
     "sparse layouts are refused on tpu by design (torchtpu/device/sparse.py)"),
    ("cause", r"quantized tensors \(.*\) are not supported on tpu",
     "quantized dtypes are refused on tpu by design (torchtpu/device/quantized.py)"),
)


# ----------------------------------------------------------------------------- the child's plugin

_outcomes: dict[str, dict] = {}


def _log(record: dict) -> None:
    with open(os.environ[LOG_ENV], "a") as f:
        f.write(json.dumps(record) + "\n")


def _on_alarm(signum, frame):
    raise TimeoutError(f"conformance: test ran past {os.environ[TIMEOUT_ENV]} s")


def pytest_runtest_logstart(nodeid, location):
    if LOG_ENV in os.environ:
        _log({"start": nodeid, "t": time.time()})
        signal.signal(signal.SIGALRM, _on_alarm)
        signal.alarm(int(os.environ.get(TIMEOUT_ENV, "120")))


def pytest_runtest_logreport(report):
    if LOG_ENV not in os.environ:
        return
    state = _outcomes.setdefault(report.nodeid, {"outcome": "passed", "cause": ""})
    if report.when == "call" or state["outcome"] == "passed":
        if hasattr(report, "wasxfail"):
            state["outcome"], state["cause"] = "xfail", str(report.wasxfail)[:200]
        elif report.skipped:
            state["outcome"], state["cause"] = "skipped", _skip_reason(report)
        elif report.failed:
            state["outcome"], state["cause"] = "failed", _failure_cause(report)
    if report.when == "teardown":
        signal.alarm(0)
        _log({"end": report.nodeid, **_outcomes.pop(report.nodeid)})


def _skip_reason(report) -> str:
    longrepr = report.longrepr
    if isinstance(longrepr, tuple) and len(longrepr) == 3:
        return str(longrepr[2]).removeprefix("Skipped: ")[:200]
    return str(longrepr)[:200]


def _failure_cause(report) -> str:
    crash = getattr(report.longrepr, "reprcrash", None)
    text = crash.message if crash is not None else str(report.longrepr)
    return text.strip().splitlines()[0][:300] if text.strip() else "unknown"


# ----------------------------------------------------------------------------- the runner

def _read_log(path: Path) -> tuple[dict[str, dict], tuple[str, float] | None]:
    """The finished tests' outcomes, and the test still running (nodeid, start time), if any."""
    done: dict[str, dict] = {}
    running = None
    if not path.exists():
        return done, running
    for line in path.read_text().splitlines():
        try:
            record = json.loads(line)
        except json.JSONDecodeError:  # a line cut short by a kill
            continue
        if "start" in record:
            running = (record["start"], record["t"])
        elif "end" in record:
            done[record.pop("end")] = record
            running = None
    return done, running


def _kill(proc: subprocess.Popen) -> None:
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
    proc.wait()


def _collect(tests_dir: Path, name: str, select: str | None, env: dict) -> list[str]:
    """The file's test ids, so that tests a run never reached are reported as not run."""
    cmd = [sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider",
           "--rootdir", str(tests_dir), name] + (["-k", select] if select else [])
    done = subprocess.run(cmd, cwd=tests_dir, env={**env, LOG_ENV: os.devnull},
                          capture_output=True, text=True, timeout=600)
    ids = [line for line in done.stdout.splitlines() if line.startswith(name + "::")]
    if not ids:  # an import error (a helper this torch lacks) would read as a 0/0 file
        tail = "\n".join((done.stdout + done.stderr).strip().splitlines()[-15:])
        raise SystemExit(f"torchtpu.bench: pytest collected no tests from {name}:\n{tail}")
    return ids


def run_file(tests_dir: Path, name: str, work: Path, timeout: int, file_timeout: int,
             select: str | None, fallback: str) -> dict[str, dict]:
    """Runs one test file to the end, restarting the child past crashes and hangs."""
    log = work / (Path(name).stem + ".jsonl")
    log.unlink(missing_ok=True)
    env = dict(os.environ, **{LOG_ENV: str(log), TIMEOUT_ENV: str(timeout),
                              "TORCHTPU_CPU_FALLBACK": fallback,
                              "PYTHONPATH": os.pathsep.join(
                                  [str(Path(__file__).resolve().parent),
                                   os.environ.get("PYTHONPATH", "")])})
    deadline = time.time() + file_timeout
    extra = {nodeid: {"outcome": "not run", "cause": ""}
             for nodeid in _collect(tests_dir, name, select, env)}
    while True:
        done, _ = _read_log(log)
        skip = sorted(set(done) | {k for k, v in extra.items() if v["outcome"] != "not run"})
        cmd = [sys.executable, "-m", "pytest", "-p", "conformance", "-p", "no:cacheprovider",
               "-q", "--tb=line", "--rootdir", str(tests_dir), name]
        cmd += ["-k", select] if select else []
        cmd += [arg for nodeid in skip for arg in ("--deselect", nodeid)]
        with open(work / (Path(name).stem + ".out"), "a") as out:
            proc = subprocess.Popen(cmd, cwd=tests_dir, env=env, stdout=out,
                                    stderr=subprocess.STDOUT, start_new_session=True)
            try:
                while proc.poll() is None:
                    time.sleep(2)
                    _, running = _read_log(log)
                    hung = running is not None and time.time() - running[1] > 2 * timeout + 30
                    if hung or time.time() > deadline:
                        _kill(proc)
            finally:
                if proc.poll() is None:
                    _kill(proc)
        done, running = _read_log(log)
        if running is None or time.time() > deadline:
            if running is not None:
                extra[running[0]] = {"outcome": "crashed", "cause": "file time limit reached"}
            return {**extra, **done}
        extra[running[0]] = {"outcome": "crashed",
                             "cause": f"child died or hung (exit {proc.returncode})"}


_DEVICE_IN_NAME = re.compile(r"_(cpu|tpu)(?=_|$)")


def _split(nodeid: str) -> tuple[str, tuple[str, str]] | None:
    """("tpu", (generic class, generic test)) for an instantiated test, None for any other."""
    parts = nodeid.split("::")
    if len(parts) != 3:
        return None
    cls, test = parts[1], parts[2]
    suffix = next((s for s in CLASS_SUFFIXES if cls.endswith(s)), None)
    matches = list(_DEVICE_IN_NAME.finditer(test))
    if suffix is None or not matches or matches[-1].group(1) != CLASS_SUFFIXES[suffix]:
        return None
    m = matches[-1]
    return CLASS_SUFFIXES[suffix], (cls[:-len(suffix)], test[:m.start()] + test[m.end():])


def _group(cause: str) -> str:
    """A failure's cause with the numbers and quoted values that vary between tests blurred."""
    cause = re.sub(r"'[^']*'|\"[^\"]*\"", "'…'", cause)
    cause = re.sub(r"\d+(\.\d+)?", "N", cause)
    return cause[:120]


def expected_reason(test: str, cause: str) -> str | None:
    """Why a tpu failure of generic test name ``test`` with ``cause`` is expected, or None."""
    for what, pattern, why in EXPECTED:
        if re.search(pattern, test if what == "test" else cause):
            return why
    return None


def summarize(results: dict[str, dict]) -> dict:
    by_device: dict[str, dict] = defaultdict(dict)
    for nodeid, outcome in results.items():
        split = _split(nodeid)
        if split is not None:
            by_device[split[0]][split[1]] = (nodeid, outcome)
    cpu, tpu = by_device["cpu"], by_device["tpu"]
    cpu_passed = {k for k, (_, o) in cpu.items() if o["outcome"] == "passed"}
    twins = cpu_passed & set(tpu)
    skipped = Counter(tpu[k][1]["cause"][:100] for k in twins
                      if tpu[k][1]["outcome"] == "skipped")
    not_run = {k for k in twins if tpu[k][1]["outcome"] == "not run"}
    expected = {k: why for k in twins if tpu[k][1]["outcome"] in ("failed", "crashed")
                and (why := expected_reason(k[1], tpu[k][1]["cause"])) is not None}
    counted = {k for k in twins if tpu[k][1]["outcome"] not in ("skipped", "not run")
               and k not in expected}
    passed = {k for k in counted if tpu[k][1]["outcome"] == "passed"}
    groups: dict[str, list[str]] = defaultdict(list)
    for k in sorted(counted - passed):
        nodeid, outcome = tpu[k]
        groups[f"{outcome['outcome']}: {_group(outcome['cause'])}"].append(nodeid)
    return {
        "cpu_passed": len(cpu_passed), "cpu_only": len(cpu_passed - set(tpu)),
        "tpu_skipped": sum(skipped.values()), "tpu_not_run": len(not_run),
        "tpu_expected": len(expected),
        "expected_reasons": dict(Counter(expected.values()).most_common()),
        "counted": len(counted), "tpu_passed": len(passed),
        "rate": len(passed) / len(counted) if counted else 0.0,
        "tpu_passed_cpu_not": sum(1 for k, (_, o) in tpu.items()
                                  if o["outcome"] == "passed" and k not in cpu_passed),
        "skip_reasons": dict(skipped.most_common()),
        "groups": {g: ids for g, ids in sorted(groups.items(), key=lambda kv: -len(kv[1]))},
    }


def format_summary(name: str, s: dict, examples: int = 2) -> str:
    lines = [f"## {name}: {s['tpu_passed']}/{s['counted']} = {100 * s['rate']:.1f}% of the tests "
             f"that pass on CPU pass on tpu",
             f"   ({s['cpu_passed']} pass on CPU; {s['cpu_only']} of them have no tpu twin; "
             f"{s['tpu_skipped']} skipped on tpu by the test file, "
             f"{s['tpu_expected']} failures expected by design and "
             f"{s['tpu_not_run']} not reached in the time limit, none counted; "
             f"{s['tpu_passed_cpu_not']} pass on tpu only)"]
    for group, ids in s["groups"].items():
        shown = ", ".join(i.split("::")[-1] for i in ids[:examples])
        lines.append(f"   {len(ids):5d}  {group}   [{shown}]")
    for reason, n in s["expected_reasons"].items():
        lines.append(f"   expected {n:4d}  {reason}")
    for reason, n in list(s["skip_reasons"].items())[:8]:
        lines.append(f"   skip {n:4d}  {reason}")
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="+", help="test files inside --tests-dir, run in order")
    parser.add_argument("--tests-dir", type=Path, required=True)
    parser.add_argument("-k", dest="select", help="pytest -k expression, passed through")
    parser.add_argument("--timeout", type=int, default=120, help="seconds per test")
    parser.add_argument("--file-timeout", type=int, default=3 * 3600, help="seconds per file")
    parser.add_argument("--fallback", default="error", help="TORCHTPU_CPU_FALLBACK in the child")
    parser.add_argument("--work", type=Path, default=Path("/tmp/torchtpu-conformance"),
                        help="where the logs, pytest's output and summary.json go")
    args = parser.parse_args()
    tests_dir = args.tests_dir.resolve()
    if not tests_dir.is_dir():
        parser.error(f"torchtpu.bench: --tests-dir {tests_dir} is not a directory")
    args.work.mkdir(parents=True, exist_ok=True)
    summaries = {}
    for name in args.files:
        if not (tests_dir / name).is_file():
            parser.error(f"torchtpu.bench: no test file {name} in {tests_dir}")
        t0 = time.time()
        results = run_file(tests_dir, name, args.work, args.timeout, args.file_timeout,
                           args.select, args.fallback)
        summaries[name] = summarize(results)
        summaries[name]["seconds"] = round(time.time() - t0)
        print(format_summary(name, summaries[name]), flush=True)
        (args.work / "summary.json").write_text(json.dumps(summaries, indent=1))


if __name__ == "__main__":
    main()
