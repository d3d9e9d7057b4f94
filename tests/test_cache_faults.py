"""The compile cache's directory failing under a running program: every program still runs (its
results equal CPU's), the failure is reported by one ``torchtpu.cache:`` warning (not one per
program), and JAX's own per-program cache warnings never fire.

One child process goes through every fault, each with its own store (``EntryStore``) installed
as JAX's cache: a cache directory that cannot be created (its path runs through a file; this is
the store ``import torchtpu`` builds), a full disk and a read-only directory (small tmpfs mounts
in a user and mount namespace, ``unshare -Urm``; skipped where the machine allows none), and a
directory deleted while the process runs.
"""

import json
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

import pytest

_SCRIPT = r"""
import json, os, shutil, subprocess, warnings
from pathlib import Path
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as at_import:
    warnings.simplefilter("always")
    import torch, torchtpu
    torch.zeros(1, device="tpu")  # the device, and its compile cache, start at the first use
import jax
from jax._src import compilation_cache as jax_cache
from torchtpu import metrics
from torchtpu.cache import compile_cache

# One eager program each, new to the process (another op, not another size: eager calls of
# growing sizes share one program per size bucket).
OPS = [torch.exp, torch.sin, torch.cos, torch.tan, torch.tanh, torch.sigmoid, torch.log,
       torch.log1p, torch.sqrt, torch.rsqrt, torch.neg, torch.reciprocal, torch.square,
       torch.expm1, torch.asin, torch.acos, torch.atan, torch.sinh, torch.cosh, torch.erf,
       torch.erfc, torch.log2]
X = torch.linspace(0.1, 0.9, 12).reshape(3, 4)

def program(k):
    return bool(torch.allclose(OPS[k](X.to("tpu")).cpu(), OPS[k](X)))

def texts(caught):
    found = [str(w.message) for w in caught]
    return {"cache": [t for t in found if t.startswith("torchtpu.cache")],
            "jax": [t for t in found if "persistent compilation cache" in t]}

def phase(sizes, path=None):
    if path is not None:  # a fresh store: its own record of what it reported
        jax_cache._cache = compile_cache.EntryStore(Path(path))
    # (an eager op's program is read back by JAX's key or by torchtpu's: warm_dispatch)
    read = lambda: sum(metrics.snapshot().get(k, 0) for k in (
        "persistent_cache_hits", "programs_loaded_by_key"))
    before = read()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        ok = all([program(n) for n in sizes])
        compile_cache.flush()  # (the writer thread's writes of the phase, and their warnings)
    where = jax_cache._cache.path
    entries = len(list(where.glob("*.ttpu"))) if where.is_dir() else 0
    return {"ok": ok, "entries": entries,
            "programs": len(sizes), "hits": read() - before, **texts(caught)}

out = {"import": texts(at_import), "unwritable": phase([0, 1, 2])}
if os.environ.get("FULL_DIR"):
    out["full"] = phase(range(3, 11), os.environ["FULL_DIR"])
    ro = os.environ["RO_DIR"]
    out["ro_fill"] = phase([11, 12], ro)
    subprocess.run(["mount", "-o", "remount,ro", ro], check=True)
    jax.clear_caches()
    out["ro"] = phase([11, 12, 13, 14, 15], ro)
gone = os.environ["GONE_DIR"]
out["gone_fill"] = phase([16, 17], gone)
shutil.rmtree(gone)
out["gone"] = phase([18, 19, 20])
print("RESULT " + json.dumps(out))
"""

_FULL_BYTES = 16 << 10  # room for an eager program entry or two


def _namespaces() -> bool:
    try:
        return shutil.which("unshare") is not None and subprocess.run(
            ["unshare", "-Urm", "true"], capture_output=True, timeout=30).returncode == 0
    except (OSError, subprocess.TimeoutExpired):
        return False


@pytest.fixture(scope="module")
def faults(tmp_path_factory):
    root = tmp_path_factory.mktemp("cache_faults")
    (root / "a_file").write_text("not a directory")
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(root / "a_file" / "cache"),
           "GONE_DIR": str(root / "gone"), "TORCHTPU_CPU_FALLBACK": "error"}
    command = [sys.executable, "-c", _SCRIPT]
    if _namespaces():
        full, ro = root / "full", root / "ro"
        full.mkdir()
        ro.mkdir()
        env.update(FULL_DIR=str(full), RO_DIR=str(ro))
        command = ["unshare", "-Urm", "sh", "-c",
                   f"mount -t tmpfs -o size={_FULL_BYTES},mode=0700 tmpfs {full} && "
                   f"mount -t tmpfs -o size=8m,mode=0700 tmpfs {ro} && exec \"$@\"", "sh", *command]
    proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")][-1]
    return json.loads(line.removeprefix("RESULT "))


def _one_warning(found: dict, says: str) -> None:
    assert len(found["cache"]) == 1 and says in found["cache"][0], found["cache"]
    assert not found["jax"], found["jax"][:3]


def test_unwritable_directory_at_start_warns_once_and_runs(faults):
    _one_warning(faults["import"], "cannot write the compile cache directory")
    assert faults["unwritable"]["ok"]
    assert not faults["unwritable"]["cache"] and not faults["unwritable"]["jax"]


def test_full_disk_warns_once_and_every_program_runs(faults):
    if "full" not in faults:
        pytest.skip("no user and mount namespaces here (unshare -Urm) for a small tmpfs")
    full = faults["full"]
    assert full["ok"]
    _one_warning(full, "No space left on device")
    assert full["entries"] > 0  # the disk filled up under the cache's writes


def test_read_only_directory_still_gives_hits_and_warns_once(faults):
    if "ro" not in faults:
        pytest.skip("no user and mount namespaces here (unshare -Urm) for a read-only tmpfs")
    fill, ro = faults["ro_fill"], faults["ro"]
    assert fill["ok"] and fill["entries"] >= 2 and not fill["cache"]
    assert ro["ok"]
    assert ro["hits"] >= fill["programs"]  # what was cached before it went read-only
    _one_warning(ro, "Read-only file system")
    assert ro["entries"] == fill["entries"]


def test_directory_deleted_while_running_is_recreated(faults):
    fill, gone = faults["gone_fill"], faults["gone"]
    assert fill["ok"] and fill["entries"] >= 2 and not fill["cache"]
    assert gone["ok"]
    _one_warning(gone, "was deleted while this process used it")
    assert gone["entries"] >= 3  # the three new programs, cached in the new directory


# ---------------------------------------------------------------- torch.compile's own caches

_COMPILE = r"""
import json, warnings
warnings.simplefilter("always")
with warnings.catch_warnings(record=True) as caught:
    warnings.simplefilter("always")
    import torch, torchtpu
    f = torch.compile(lambda x: torch.sin(x) * 2 + 1, backend="tpu")
    x = torch.linspace(-1, 1, 8)
    ok = bool(torch.allclose(f(x.to("tpu")).cpu(), torch.sin(x) * 2 + 1))
print("RESULT " + json.dumps({"ok": ok, "cache": [str(w.message) for w in caught
                                                 if str(w.message).startswith("torchtpu.cache")]}))
"""

_NOBODY = 65534


def _nobody_runs(prefix: list[str]) -> bool:
    """Whether nobody can start this Python and read this checkout (not under a private home)."""
    probe = [*prefix, sys.executable, "-S", "-c", f"open({__file__!r}).read()"]
    return subprocess.run(probe, capture_output=True, timeout=60).returncode == 0


def _unusable(kind: str, root: Path) -> tuple[Path, list[str], dict]:
    """A cache directory of that kind under root, the command prefix and the environment that
    run a child that cannot use it: permissions bind root only through another user, so root
    runs it as nobody."""
    target = root / "cache"
    if kind == "a file":
        target.write_text("not a directory")
        return target, [], {}
    target.mkdir()
    prefix, env = [], {}
    if os.getuid() == 0:
        prefix = ["setpriv", f"--reuid={_NOBODY}", f"--regid={_NOBODY}", "--clear-groups"]
        if shutil.which("setpriv") is None or not _nobody_runs(prefix):
            pytest.skip("as root, needs setpriv, and a Python and checkout others can read")
        home = root / "home"
        home.mkdir()
        for path in (target, home):
            os.chown(path, _NOBODY, _NOBODY)
        root.chmod(0o755)
        env["HOME"] = str(home)
    target.chmod(0o000 if kind == "mode 000" else 0o555)
    return target, prefix, env


@pytest.mark.parametrize("kind", ["a file", "mode 000", "read-only and empty"])
def test_compile_goes_on_when_the_cache_directory_is_unusable(kind):
    """torch.compile runs, and the directory's failure is the store's warning, once per kind of
    failure (Inductor, pointed at an unusable directory, raises while it sets up)."""
    with tempfile.TemporaryDirectory() as name:
        target, prefix, env = _unusable(kind, Path(name))
        env = {**os.environ, **env, "TORCHTPU_CACHE_DIR": str(target)}
        env.pop("TORCHINDUCTOR_CACHE_DIR", None)
        try:
            proc = subprocess.run([*prefix, sys.executable, "-c", _COMPILE], env=env,
                                  capture_output=True, text=True, timeout=300,
                                  cwd=Path(__file__).resolve().parent.parent)
        finally:
            target.chmod(0o700)  # for the clean-up
    assert proc.returncode == 0, proc.stderr[-3000:]
    found = json.loads(proc.stdout.split("RESULT ")[-1])
    assert found["ok"]
    said = found["cache"]
    assert any(f"cannot write the compile cache directory {target}" in t for t in said), said
    assert all(t.startswith("torchtpu.cache: cannot ") for t in said), said
    assert len(said) == len({t.split(" the compile cache")[0] for t in said}), said
