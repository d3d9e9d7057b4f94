"""``python -m torchtpu.doctor [--json] [--prune-cache]``: what this machine gives torchtpu, and
what is wrong.

It reports the platform and devices, the torch / jax / jaxlib versions and whether they are a
tested combination, whether ``import torch`` loads torchtpu, the compile cache (directory, size,
writable, entries a reader would refuse: damaged, truncated, written for another host or CPU;
``--prune-cache`` deletes them), the torchtpu and TorchTPU environment variables in
effect (values checked, unknown names flagged), and runs a self-test: an op in each eager mode,
one compiled graph, and a program written to the persistent cache and read back. Each check is
"ok", "warning" or "error", with the fix for anything not ok; the exit status is 1 when any check
is an error.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import jax
import torch

from torchtpu import errors, metrics, settings
from torchtpu.cache import cache_check, compile_cache
from torchtpu.commands import describe
from torchtpu.commands import main as tool_main
from torchtpu.runtime import platform
from torchtpu.tools import render

# The dev extra's pins (pyproject.toml), the combination the test suite runs on, and the timm
# extra's (torch 2.14.1 for torchvision; tests/test_timm.py and the core tests run on it).
TESTED = (("2.13.0", "0.10.2", "0.10.2"), ("2.14.1", "0.10.2", "0.10.2"))
_PACKAGE = Path(__file__).resolve().parents[1]
_NAME = re.compile(r"\bTORCH_TPU_[A-Z0-9_]+\b")
# The reference's and PyTorch's settings with a closed set of values (torchtpu's own TORCHTPU_*
# ones are checked by their declarations in ``torchtpu.settings``).
_VALUES = {
    "TORCH_TPU_LAUNCH_BLOCKING": ("0", "1"),
    "TORCH_TPU_DEFER_AND_FUSE": ("0", "1"),
    "TORCH_DEVICE_BACKEND_AUTOLOAD": ("0", "1"),
}
_ALSO_SHOWN = ("TORCH_DEVICE_BACKEND_AUTOLOAD", "LOCAL_RANK", "JAX_PLATFORMS", "XLA_FLAGS")


@dataclass
class Check:
    name: str
    status: str          # "ok", "warning" or "error"
    detail: str
    fix: str = ""


def _version(name: str) -> str:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"


def check_platform() -> tuple[Check, dict]:
    try:
        name = platform.platform()
        devices = [{"id": d.id, "kind": d.device_kind} for d in platform.devices()]
    except Exception as e:
        return Check("platform", "error", f"no usable device: {describe(e)}",
                     "check TORCHTPU_PLATFORM / JAX_PLATFORMS; for TPU install libtpu "
                     "(pip install 'jax[tpu]')"), {}
    facts = {"platform": name, "devices": devices, "local_device": str(platform.local_device())}
    return Check("platform", "ok", f"{name}: {len(devices)} device(s), "
                 f"this process drives {facts['local_device']}"), facts


def check_versions() -> tuple[Check, dict]:
    found = (torch.__version__.split("+")[0], _version("jax"), _version("jaxlib"))
    facts = dict(zip(("torch", "jax", "jaxlib"), found))
    text = ", ".join(f"{k} {v}" for k, v in facts.items())
    if found in TESTED:
        return Check("versions", "ok", f"{text} (tested)"), facts
    tested = "; ".join(f"torch {t}, jax {j}, jaxlib {jl}" for t, j, jl in TESTED)
    return Check("versions", "warning", f"{text} is not a tested combination",
                 f"install a tested one ({tested}): pip install -e '.[dev]'"), facts


def check_autoload() -> tuple[Check, dict]:
    points = [e for e in importlib.metadata.entry_points(group="torch.backends")
              if e.value.startswith("torchtpu")]
    setting = os.environ.get("TORCH_DEVICE_BACKEND_AUTOLOAD", "1")
    facts = {"entry_point": points[0].value if points else None, "autoload": setting != "0"}
    if not points:
        return Check("autoload", "warning", "no torch.backends entry point for torchtpu: "
                     "`import torch` alone does not give the tpu device",
                     "install the package (pip install -e .), or `import torchtpu`"), facts
    if setting == "0":
        return Check("autoload", "warning", "TORCH_DEVICE_BACKEND_AUTOLOAD=0: `import torch` "
                     "does not load torchtpu", "unset it, or `import torchtpu`"), facts
    return Check("autoload", "ok", f"`import torch` loads torchtpu ({points[0].value})"), facts


def cache_state(prune: bool = False) -> dict:
    """The compile cache as the doctor sees it (the only place tools read the cache), the
    entries it refuses deleted if prune."""
    path = compile_cache.cache_dir()
    if path is None:
        return {"enabled": False}
    found = (cache_check.prune if prune else cache_check.verify)(path)
    state = {"enabled": True, "path": str(path), "exists": path.is_dir(),
             "entries": found["entries"], "bytes": found["bytes"],
             "damaged": sorted(found["damaged"]), "why": found["damaged"],
             "pruned": prune, "max_bytes": compile_cache.max_bytes()}
    try:
        probe = path if state["exists"] else path.parent
        with tempfile.NamedTemporaryFile(dir=probe):
            state["writable"] = True
    except OSError:
        state["writable"] = False
    return state


def check_cache(prune: bool = False) -> tuple[Check, dict]:
    try:
        state = cache_state(prune)
    except ValueError as e:  # a bad TORCHTPU_CACHE_MAX_BYTES
        return Check("compile cache", "error", str(e), "fix the variable"), {}
    if not state["enabled"]:
        return Check("compile cache", "warning", "off: every process compiles every program",
                     "unset TORCHTPU_CACHE_DIR=off to keep programs across runs"), state
    where = f"{state['path']}: {state['entries']} entries, {render.size(state['bytes'])}"
    if not state["writable"]:
        return Check("compile cache", "error", f"{where}, not writable",
                     "set TORCHTPU_CACHE_DIR to a directory this user can write"), state
    if state["damaged"]:
        reasons = sorted({why.split(" (")[0] for why in state["why"].values()})
        if state["pruned"]:
            return Check("compile cache", "ok", f"{where}, writable, "
                         f"{len(state['damaged'])} refused entries deleted "
                         f"({'; '.join(reasons)})"), state
        return Check("compile cache", "warning",
                     f"{where}, {len(state['damaged'])} refused ({'; '.join(reasons)})",
                     "nothing needed: refused entries are deleted and recompiled on use "
                     "(or delete them now: python -m torchtpu.doctor --prune-cache)"), state
    return Check("compile cache", "ok", f"{where}, writable, every entry whole and "
                 "written for this host"), state


def _known_names() -> set:
    """Every TORCHTPU_* / TORCH_TPU_* name torchtpu reads (TORCH_TPU_* ones: from its source)."""
    names = set(_VALUES) | {s.name for s in settings.declared()}
    for file in _PACKAGE.rglob("*.py"):
        names.update(_NAME.findall(file.read_text(errors="replace")))
    return names


def _invalid(name: str, value: str) -> str | None:
    """What torchtpu's setting name accepts where value is not that (else None)."""
    try:
        setting = settings.named(name)
        setting.parse(value)
    except KeyError:  # not a TORCHTPU_ setting
        return None
    except ValueError:
        return setting.accepted
    return None


def check_environment() -> tuple[list, dict]:
    shown = {k: v for k, v in sorted(os.environ.items())
             if k.startswith(("TORCHTPU_", "TORCH_TPU_")) or k in _ALSO_SHOWN}
    known, found = _known_names(), []
    for name, value in shown.items():
        allowed = _VALUES.get(name)
        accepted = _invalid(name, value)
        if accepted:
            found.append(Check(f"env {name}", "error", f"{name}={value!r} is not accepted",
                               f"use {accepted}"))
        elif allowed and value.strip().lower() not in allowed:
            found.append(Check(f"env {name}", "error", f"{name}={value!r} is not accepted",
                               f"use one of {', '.join(allowed)}"))
        elif name.startswith(("TORCHTPU_", "TORCH_TPU_")) and name not in known:
            close = [k for k in known if k.split("_")[-1] == name.split("_")[-1]]
            found.append(Check(f"env {name}", "warning", f"{name} is not a variable torchtpu "
                               "reads", f"a typo? did you mean {' or '.join(sorted(close))}"
                               if close else "remove it (docs, Settings lists them)"))
    if not found:
        found.append(Check("environment", "ok", f"{len(shown)} setting(s) in effect, all valid"))
    return found, shown


def _self_test_steps():
    x = torch.arange(6.0).reshape(2, 3)
    expected = (x * 2 + 1).sum(0)
    deprecated = (torch.tpu.EagerMode.DEFER_AND_FUSE_WITH_O1,)
    for mode in (m for m in torch.tpu.EagerMode if m not in deprecated):
        def op(mode=mode):
            with torch.tpu.set_eager_mode(mode):
                got = (x.to("tpu") * 2 + 1).sum(0).cpu()
            torch.testing.assert_close(got, expected)
        yield f"eager {mode.name}", op

    def graph():
        fn = torch.compile(lambda a: (a.sin() * 2).sum(1), backend="tpu")
        torch.testing.assert_close(fn(x.to("tpu")).cpu(), (x.sin() * 2).sum(1))
    yield "torch.compile graph", graph

    def round_trip():
        path = compile_cache.cache_dir()
        if path is None:
            return "skipped: the cache is off"
        before = set(path.glob(f"*{compile_cache.SUFFIX}"))
        nonce = float(time.time_ns() % 1_000_003)  # a program no earlier run has cached

        def fresh():
            return jax.jit(lambda a: a * 3 + nonce)

        hits = metrics.snapshot()["persistent_cache_hits"]
        first = fresh()(jax.numpy.ones(3))
        compile_cache.flush(timeout=60)  # entries are written on the cache's writer thread
        written = set(path.glob(f"*{compile_cache.SUFFIX}")) - before
        second = fresh()(jax.numpy.ones(3))  # a new function: JAX looks in the persistent cache
        hit = metrics.snapshot()["persistent_cache_hits"] - hits
        for entry in written:
            entry.unlink(missing_ok=True)
        if not written:
            raise RuntimeError(errors.message("cache", f"no entry was written to {path}"))
        if hit < 1 or not bool((first == second).all()):
            raise RuntimeError(errors.message("cache", f"the entry written to {path} was not "
                                              "read back"))
        return None
    yield "persistent cache round trip", round_trip


def check_self_test() -> list:
    found = []
    for name, step in _self_test_steps():
        start = time.perf_counter()
        try:
            note = step()
        except Exception as e:
            found.append(Check(f"self-test: {name}", "error", describe(e),
                               "run the test suite (pytest) to narrow it down, and report it"))
            continue
        ms = (time.perf_counter() - start) * 1e3
        found.append(Check(f"self-test: {name}", "warning" if note else "ok",
                           note or f"passed ({ms:.0f} ms)",
                           "set TORCHTPU_CACHE_DIR to enable the cache" if note else ""))
    return found


def run(self_test: bool = True, prune_cache: bool = False) -> dict:
    """Every check (the self-test too, unless self_test=False) and the facts behind them; the
    cache's refused entries deleted if prune_cache."""
    checks, facts = [], {}
    for probe, key in ((check_platform, "device"), (check_versions, "versions"),
                       (check_autoload, "autoload"),
                       (lambda: check_cache(prune_cache), "compile_cache")):
        c, f = probe()
        checks.append(c)
        facts[key] = f
    env_checks, facts["environment"] = check_environment()
    checks += env_checks
    if self_test and checks[0].status != "error":
        start = time.perf_counter()
        checks += check_self_test()
        facts["self_test_seconds"] = round(time.perf_counter() - start, 3)
    return {"ok": all(c.status != "error" for c in checks),
            "problems": [asdict(c) for c in checks if c.status != "ok"],
            "checks": [asdict(c) for c in checks], **facts}


def format_report(result: dict) -> str:
    lines = ["torchtpu doctor"]
    lines += render.table(["check", "status", "detail"],
                          [[c["name"], c["status"], c["detail"]] for c in result["checks"]])
    for p in result["problems"]:
        lines.append(f"{p['status']}: {p['name']}: fix: {p['fix']}")
    if "self_test_seconds" in result:
        lines.append(f"self-test: {result['self_test_seconds']:.1f} s")
    lines.append("all good" if result["ok"] and not result["problems"] else
                 ("no errors" if result["ok"] else "errors found"))
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtpu.doctor", description=__doc__)
    parser.add_argument("--json", action="store_true", help="print JSON for programs")
    parser.add_argument("--no-self-test", action="store_true", help="skip the self-test")
    parser.add_argument("--prune-cache", action="store_true",
                        help="delete the compile cache entries a reader would refuse")
    args = parser.parse_args(argv)

    def go() -> int:
        result = run(self_test=not args.no_self_test, prune_cache=args.prune_cache)
        print(json.dumps(result, indent=1) if args.json else format_report(result))
        return 0 if result["ok"] else 1
    return tool_main(go)


if __name__ == "__main__":
    sys.exit(main())
