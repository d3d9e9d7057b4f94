"""The persistent compile cache across processes: hits after a restart, damaged entries, races."""

import json
import os
import subprocess
import sys
import threading
import warnings

import pytest

from torchtpu.cache import cache_check, compile_cache
from torchtpu.cache.compile_cache import MAGIC, SUFFIX, CompileCacheWarning, EntryStore

# One process's work: a compiled forward and backward of a small model, and two eager ops.
_SCRIPT = """
import json, torch, torchtpu
from torch import nn
torch.manual_seed(0)
model = nn.Sequential(nn.Linear(6, 16), nn.Tanh(), nn.Linear(16, 3)).to("tpu")
x = torch.randn(5, 6).to("tpu")
loss = torch.compile(model, backend="tpu")(x).square().mean()
loss.backward()
eager = (torch.exp(x) * 3).sum()
# (read before the counts: the programs that read them back count too)
values = {"loss": loss.item(), "grad": model[0].weight.grad.sum().item(), "eager": eager.item()}
m = torchtpu.metrics.snapshot()
stats = torch.tpu._get_cache_stats()
print(json.dumps({**values, "compiles": m["executable_compiles"],
                  "hits": m["persistent_cache_hits"],
                  "by_key": m.get("programs_loaded_by_key", 0), "stats": stats}))
"""


def _start(cache: str) -> subprocess.Popen:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": cache, "TORCHTPU_CPU_FALLBACK": "error"}
    return subprocess.Popen([sys.executable, "-c", _SCRIPT], env=env, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def _finish(proc: subprocess.Popen) -> tuple[dict, str]:
    out, err = proc.communicate(timeout=300)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1]), err


def _entries(cache) -> list:
    return sorted(p for p in cache.iterdir() if p.name.endswith(SUFFIX))


def _assert_whole(cache) -> None:
    store = EntryStore(cache)
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileCacheWarning)
        for p in _entries(cache):
            assert store.get(p.name.removesuffix(SUFFIX)) is not None
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]


@pytest.fixture(scope="module")
def warm_cache(tmp_path_factory):
    """Two processes racing to fill one empty cache, then the results of each."""
    cache = tmp_path_factory.mktemp("compile_cache")
    procs = [_start(str(cache)) for _ in range(2)]
    return cache, [_finish(p)[0] for p in procs]


def test_concurrent_writers_leave_whole_entries(warm_cache):
    cache, (a, b) = warm_cache
    assert a["compiles"] + b["compiles"] > 0
    assert {k: a[k] for k in ("loss", "grad", "eager")} == \
        {k: b[k] for k in ("loss", "grad", "eager")}
    assert len(_entries(cache)) >= 4  # forward, backward, and the eager ops
    _assert_whole(cache)


def test_restart_compiles_nothing(warm_cache):
    cache, (first, _) = warm_cache
    again, err = _finish(_start(str(cache)))
    assert again["compiles"] == 0, err
    # The compiled graphs from JAX's cache, the eager ops loaded by torchtpu's key.
    assert again["hits"] >= 2 and again["by_key"] >= 2
    stats = again["stats"]
    # (a program loaded by key reads two entries: its index record and its executable; the
    # list of the programs to load ahead, warm_ahead, and the eager calls' meta results,
    # eager/facts.py, are two more; none is read twice or for nothing, whether it was loaded
    # ahead or when asked)
    assert stats["num_cache_hits"] == again["hits"] + 2 * again["by_key"] + 2 \
        <= stats["num_cache_reqs"]
    assert all(e["read_count"] == 1 and (e["compilation_duration"] > 0
                                         or key.startswith("ttpu_record_"))
               for key, e in stats["entries"].items())
    assert {k: again[k] for k in ("loss", "grad", "eager")} == \
        {k: first[k] for k in ("loss", "grad", "eager")}


def test_damaged_entries_warn_and_recompile(warm_cache):
    cache, (first, _) = warm_cache
    entries = _entries(cache)
    truncated, flipped = entries[0], entries[1]
    truncated.write_bytes(truncated.read_bytes()[: len(MAGIC) + 40])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    again, err = _finish(_start(str(cache)))
    assert err.count("CompileCacheWarning") == 2, err
    assert again["compiles"] == 2
    assert {k: again[k] for k in ("loss", "grad", "eager")} == \
        {k: first[k] for k in ("loss", "grad", "eager")}
    assert _entries(cache) == entries  # rewritten
    _assert_whole(cache)


def test_racing_writers_and_readers_see_whole_entries(tmp_path):
    store = EntryStore(tmp_path)
    values = [bytes([i]) * (1 << 20) for i in range(4)]
    seen = []

    def work(i):
        for k in range(8):
            store.put(f"key{k}", values[(i + k) % 4])
            seen.append(store.get(f"key{k}"))

    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileCacheWarning)
        threads = [threading.Thread(target=work, args=(i,)) for i in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    assert len(seen) == 32 and all(v in values for v in seen)
    _assert_whole(tmp_path)


def test_entry_store_rejects_foreign_and_short_files(tmp_path):
    store = EntryStore(tmp_path)
    store.put("k", b"payload")
    assert store.get("k") == b"payload"
    assert store.get("missing") is None
    store.entry("j").write_bytes(b"\x00" * 100)  # e.g. a file in another format
    with pytest.warns(CompileCacheWarning, match="no torchtpu header"):
        assert store.get("j") is None
    assert not store.entry("j").exists()
    store.entry("k").write_bytes(MAGIC + b"\x01")
    with pytest.warns(CompileCacheWarning, match="truncated"):
        assert store.get("k") is None


def test_verify_names_the_entries_that_fail_their_checks(tmp_path, monkeypatch):
    store = EntryStore(tmp_path)
    store.put("whole", b"payload")
    store.put("flipped", b"payload")
    damaged = bytearray(store.entry("flipped").read_bytes())
    damaged[-1] ^= 1
    store.entry("flipped").write_bytes(bytes(damaged))
    store.entry("short").write_bytes(MAGIC + b"\x01")
    store.entry("old").write_bytes(b"TTPU1" + bytes(64))  # replaced quietly on use
    found = cache_check.verify(tmp_path)
    assert found["entries"] == 4
    assert found["bytes"] == sum(p.stat().st_size for p in tmp_path.glob(f"*{SUFFIX}"))
    assert found["damaged"] == {f"flipped{SUFFIX}": "its checksum does not match (truncated or "
                                "damaged)", f"short{SUFFIX}": "it is truncated (6 bytes)"}
    assert store.entry("flipped").exists()  # reported, not deleted
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path))
    assert cache_check.verify() == found
    assert cache_check.verify(tmp_path / "absent") == {"entries": 0, "bytes": 0, "damaged": {}}


def _fill(store: EntryStore, keys, size: int = 1000) -> None:
    for k in keys:
        assert store.get(k) is None
        store.put(k, bytes(size))


def test_eviction_keeps_the_directory_under_its_cap_least_recently_used_first(tmp_path):
    # An entry's header names the host's CPU features, so its size differs between machines:
    # the cap is 9.57 entries, wherever this runs.
    probe = EntryStore(tmp_path / "probe")
    _fill(probe, ["p"])
    entry = probe.entry("p").stat().st_size
    cap, root = entry * 10_000 // 1045, tmp_path / "store"
    store = EntryStore(root, max_bytes=cap)
    _fill(store, [f"a{i}" for i in range(5)])
    for i in range(5):
        os.utime(store.entry(f"a{i}"), (1000 + i, 1000 + i))  # a0 is the oldest
    assert store.get("a0") is not None  # a hit makes a0 the newest
    _fill(store, [f"b{i}" for i in range(7)])  # two evictions of two entries
    left = {p.name.removesuffix(SUFFIX) for p in _entries(root)}
    assert sum(p.stat().st_size for p in _entries(root)) <= cap
    assert "a0" in left and not {"a1", "a2", "a3", "a4"} & left
    assert {f"b{i}" for i in range(7)} <= left
    assert store.stats()["entries"]["a0"]["read_count"] == 1


# One of two processes filling one directory: 15 entries of ~1.1 kB under a 20 kB cap.
_FILL_SCRIPT = """
import sys
from pathlib import Path
from torchtpu.cache.compile_cache import EntryStore
store = EntryStore(Path(sys.argv[1]), 20_000)
for i in range(15):
    assert store.get(f"{sys.argv[2]}{i}") is None
    store.put(f"{sys.argv[2]}{i}", bytes(1000))
"""


def test_two_processes_sharing_a_directory_stay_bounded(tmp_path):
    procs = [subprocess.Popen([sys.executable, "-c", _FILL_SCRIPT, str(tmp_path), name],
                              stderr=subprocess.PIPE, text=True) for name in "ab"]
    for proc in procs:
        assert proc.wait(timeout=300) == 0, proc.stderr.read()
    entries = _entries(tmp_path)
    total = sum(p.stat().st_size for p in entries)
    assert total <= 20_000 * 1.2 + 2 * 1200  # each overshoots by at most a tenth of the cap
    assert len(entries) < 30  # evicted (which process's entries depends on the timing)
    _assert_whole(tmp_path)


def test_stats_count_requests_hits_and_compile_time(tmp_path):
    store = EntryStore(tmp_path)
    assert store.get("k") is None
    store.put("k", b"executable")
    assert store.get("k") == b"executable" and store.get("k") == b"executable"
    stats = store.stats()
    assert (stats["num_cache_reqs"], stats["num_cache_hits"]) == (3, 2)
    entry = stats["entries"]["k"]
    assert entry["read_count"] == 2 and 0 <= entry["compilation_duration"] < 60


def test_an_older_format_is_replaced_without_a_warning(tmp_path):
    store = EntryStore(tmp_path)
    store.entry("old").write_bytes(b"TTPU1" + bytes(64))
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileCacheWarning)
        assert store.get("old") is None
    assert not store.entry("old").exists()


def test_max_bytes_from_the_environment(monkeypatch):
    cases = (("", compile_cache.DEFAULT_MAX_BYTES), ("2048", 2048), ("512M", 512 << 20),
             ("1.5G", 3 << 29), ("0", 0))
    for raw, expected in cases:
        monkeypatch.setenv("TORCHTPU_CACHE_MAX_BYTES", raw)
        assert compile_cache.max_bytes() == expected
    monkeypatch.setenv("TORCHTPU_CACHE_MAX_BYTES", "lots")
    with pytest.raises(ValueError, match="TORCHTPU_CACHE_MAX_BYTES='LOTS' is not a byte count"):
        compile_cache.max_bytes()


# A program's cache write is under way on the writer thread (slowed down) when the main thread
# exits; the log shows what happened before JAX's own exit handler clears its backends.
_EXIT_SCRIPT = """
import atexit, os, sys, threading, time
import jax, numpy as np
from jax._src import api
from torchtpu.cache import compile_cache
compile_cache.enable()  # and its exit handler

def log(event):
    n = sum(p.endswith(".ttpu") for p in os.listdir(os.environ["TORCHTPU_CACHE_DIR"]))
    print(event, n, flush=True)

clear_backends = api.clear_backends

def logged_clear_backends(*args, **kwargs):
    log("jax clean-up")
    jax.jit(lambda x: x - 5).lower(np.ones(3, np.float32)).compile()  # compiles; writes nothing
    log("compiled after close")
    clear_backends(*args, **kwargs)

api.clear_backends = logged_clear_backends
atexit.register(log, "exit begins")
store = compile_cache.store()
put = store.put

def slow_put(key, value):
    time.sleep(3.0)
    put(key, value)
    log("written")

store.put = slow_put
jax.jit(lambda x: x * 3 + 1).lower(np.ones(7, np.float32)).compile()
log("compiled")  # the compile returns while its entry is being written
"""


def test_exit_waits_for_a_write_under_way_and_starts_none(tmp_path):
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-c", _EXIT_SCRIPT], env=env,
                          text=True, capture_output=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split("\n")[:5] == [
        "compiled 0", "exit begins 0", "written 1", "jax clean-up 1", "compiled after close 1"
    ], proc.stdout
    _assert_whole(tmp_path)
