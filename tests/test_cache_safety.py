"""Issue 26: reading or writing the compile cache cannot take the process down.

The risky step runs in a child process (a crash there is the only safe way to see one), which
must exit 0 with the right warning and CPU's results.
"""

import json
import os
import subprocess
import sys
import warnings

import pytest

from torchtpu.cache import cache_check, cache_entry, cache_writer, compile_cache
from torchtpu.cache.cache_entry import OTHER, READ_BACK, CompileCacheWarning, pack, parts
from torchtpu.cache.compile_cache import SUFFIX, EntryStore

# test_index_reduce's kind of work: index_reduce over shapes, reduce modes and dtypes, each
# result against CPU's. With MAPS_LEFT set, the process first takes all but that many of its
# memory maps (what ~6000 live executables take), and makes room at a reserve of a third of them.
_SCRIPT = """
import json, mmap, os, sys, warnings
import torch, torchtpu
from torchtpu.cache import map_room
warnings.simplefilter("always")
cases = [(n, reduce, dtype) for n in range(1, 9) for reduce in ("amax", "prod", "mean")
         for dtype in (torch.float32, torch.int32)]
hold = []
left = int(os.environ.get("MAPS_LEFT", "0"))
if left:
    limit = map_room.ROOM._limit
    map_room.ROOM = map_room.Room(limit, reserve=left / 3 / limit)
    while map_room._count() < limit - left:
        hold += [mmap.mmap(-1, 4096) for _ in range((limit - left - map_room._count()) // 2 + 1)]
before = torchtpu.metrics.snapshot()
for n, reduce, dtype in cases:
    dest = torch.arange(n * 4, dtype=dtype).reshape(n, 4) - 3
    src = torch.arange(6 * 4, dtype=dtype).reshape(6, 4) % 5
    index = torch.arange(6) % n
    got = dest.to("tpu").index_reduce_(0, index.to("tpu"), src.to("tpu"), reduce).cpu()
    torch.testing.assert_close(got, dest.index_reduce(0, index, src, reduce))
after = torchtpu.metrics.snapshot()
print(json.dumps({k: after.get(k, 0) - before.get(k, 0) for k in (
    "executable_compiles", "persistent_cache_hits", "programs_loaded_by_key",
    "executable_caches_cleared")}))
"""


def _run(cache, maps_left: int = 0) -> tuple[dict, str]:
    env = {**os.environ, "TORCHTPU_CACHE_DIR": str(cache), "MAPS_LEFT": str(maps_left),
           "TORCHTPU_CPU_FALLBACK": "error"}
    proc = subprocess.run([sys.executable, "-c", _SCRIPT], env=env, text=True,
                          capture_output=True, timeout=600)
    assert proc.returncode == 0, f"exit {proc.returncode}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1]), proc.stderr


def _entries(cache) -> list:
    return sorted(p for p in cache.iterdir() if p.name.endswith(SUFFIX))


@pytest.fixture(scope="module")
def filled(tmp_path_factory):
    """A cache one process filled (its own results checked against CPU)."""
    cache = tmp_path_factory.mktemp("cache_safety")
    first, _ = _run(cache)
    assert first["executable_compiles"] >= 30 and first["persistent_cache_hits"] == 0
    return cache, first


def test_index_reduce_programs_read_back_in_another_process(filled):
    cache, first = filled
    again, err = _run(cache)
    assert again["executable_compiles"] == 0, err
    # Each op's program loaded by torchtpu's key (warm_dispatch) or found in JAX's cache.
    assert again["persistent_cache_hits"] + again["programs_loaded_by_key"] == first[
        "executable_compiles"]
    assert again["programs_loaded_by_key"] > 0
    assert "torchtpu.cache" not in err


def test_out_of_memory_maps_clears_jax_caches_instead_of_crashing(filled):
    """The reproduction: the executables a cache read makes take the last memory maps (XLA:CPU
    segfaulted in the next read; without map_room this child dies of SIGSEGV)."""
    cache, first = filled
    again, err = _run(cache, maps_left=300)
    assert "memory maps of the" in err and "caches of compiled programs were cleared" in err
    assert again["executable_caches_cleared"] >= 1
    assert (again["persistent_cache_hits"] + again["programs_loaded_by_key"]
            >= first["executable_compiles"])


def _rewrite(cache, keep: str = "\0", **how) -> list:
    """Every entry's header rewritten (payload kept): written_on= a host, kind= a kind; those
    named keep... are left as they are."""
    entries = [p for p in _entries(cache) if not p.name.startswith(keep)]
    for p in entries:
        seconds, kind, host, payload = parts(p.read_bytes())
        p.write_bytes(pack(payload, seconds, how.get("kind", kind), how.get("written_on", host)))
    return entries


# JAX's keys depend on the directory's path (its compile options name XLA's caches in it), so
# the tests below change the shared cache in place; each child's recompiles make it whole again.


def test_entries_of_another_cpu_are_skipped_and_recompiled(filled):
    cache, first = filled
    here = cache_entry.host()
    avx512 = here.rsplit("; cpu ", 1)[0] + "; cpu x86_64 0123456789abcdef (avx avx2 avx512f)"
    # (the list of programs to load ahead kept: the thread meets the other CPU's entries first,
    # and must refuse them as a caller does)
    entries = _rewrite(cache, keep="ttpu_record_manifest-", written_on=avx512)
    assert cache_check.verify(cache)["damaged"].keys() == {p.name for p in entries}
    again, err = _run(cache)
    assert err.count("written for another host") == len(entries), err
    assert "avx512f" in err and again["executable_compiles"] == first["executable_compiles"]
    assert again["programs_loaded_by_key"] == 0
    assert cache_check.verify(cache)["damaged"] == {}  # replaced by this host's entries
    # (executables read back by their writer; the op programs' index records, warm_dispatch,
    # and the list loaded ahead, warm_ahead, are plain records)
    record = [p.name.startswith("ttpu_record_") for p in _entries(cache)]
    assert any(record) and all(parts(p.read_bytes())[1:3] == (OTHER if r else READ_BACK, here)
                               for p, r in zip(_entries(cache), record))


def test_truncated_corrupted_and_unread_entries_are_refused(filled):
    cache, first = filled
    entries = _entries(cache)
    truncated, flipped, unread = entries[:3]
    truncated.write_bytes(truncated.read_bytes()[:len(compile_cache.MAGIC) + 20])
    data = bytearray(flipped.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flipped.write_bytes(bytes(data))
    seconds, _, host, payload = parts(unread.read_bytes())
    unread.write_bytes(pack(payload, seconds, OTHER, host))  # as if never read back
    found = cache_check.verify(cache)["damaged"]
    assert set(found) == {truncated.name, flipped.name}  # a record-kind entry reads fine
    again, err = _run(cache)
    assert "truncated" in err and "checksum does not match" in err, err
    assert "was not read back by the process that wrote it" in err
    assert again["executable_compiles"] == 3
    assert cache_check.verify(cache)["damaged"] == {} and len(_entries(cache)) == len(entries)


def test_a_program_that_does_not_read_back_is_not_cached(tmp_path):
    import jax

    store = EntryStore(tmp_path)
    compiled = jax.jit(lambda x: x + 1).lower(jax.numpy.ones(3)).compile()
    executable = compiled._executable.xla_executable
    cache_writer._writing.executable = cache_writer.Serialized(
        executable.serialize(), executable.local_devices(), jax.devices()[0].client)
    try:
        with pytest.warns(CompileCacheWarning, match="does not read back"):
            store.put("k", b"not an executable")
    finally:
        cache_writer._writing.executable = None
    assert not store.entry("k").exists()
    store.put("plain", b"record")  # outside a write of JAX's: kept, as kind R
    assert parts(store.entry("plain").read_bytes())[1] == OTHER
    with warnings.catch_warnings():
        warnings.simplefilter("error", CompileCacheWarning)
        assert store.get("plain") == b"record"
    with pytest.warns(CompileCacheWarning, match="not read back"):
        assert store.get_executable("plain") is None


def test_prune_deletes_what_verify_refuses(tmp_path):
    store = EntryStore(tmp_path)
    store.put("whole", b"payload")
    store.entry("short").write_bytes(compile_cache.MAGIC + b"\x01")
    store.entry("foreign").write_bytes(pack(b"payload", 1.0, READ_BACK, "tpu v9; jaxlib 0"))
    found = cache_check.prune(tmp_path)
    assert set(found["damaged"]) == {f"short{SUFFIX}", f"foreign{SUFFIX}"}
    assert [p.name for p in _entries(tmp_path)] == [f"whole{SUFFIX}"]


def test_doctor_checks_entries_as_readers_do_and_prunes_them(tmp_path, monkeypatch):
    from torchtpu.tools import doctor

    store = EntryStore(tmp_path)
    store.put("whole", b"payload")
    store.entry("foreign").write_bytes(pack(b"payload", 1.0, READ_BACK, "cpu; cpu avx512f"))
    monkeypatch.setenv("TORCHTPU_CACHE_DIR", str(tmp_path))
    check, state = doctor.check_cache()
    assert check.status == "warning" and "1 refused (it was written for another host" in \
        check.detail and "--prune-cache" in check.fix
    assert store.entry("foreign").exists()
    check, state = doctor.check_cache(prune=True)
    assert check.status == "ok" and "1 refused entries deleted" in check.detail
    assert [p.name for p in _entries(tmp_path)] == [f"whole{SUFFIX}"]
    assert doctor.check_cache()[0].detail.endswith("every entry whole and written for this host")


def test_programs_over_several_processes_are_never_persisted(monkeypatch):
    """Their read-back would place them on this process's devices only, which XLA aborts."""
    from types import SimpleNamespace

    from torchtpu.cache import compile_cache

    def executable(head: str, local: int):
        module = SimpleNamespace(to_string=lambda: head + "\n\nENTRY main {}")
        return SimpleNamespace(hlo_modules=lambda: [module], local_devices=lambda: [0] * local)

    spmd = executable("HloModule jit_body, is_scheduled=true, num_partitions=2", 1)
    local = executable("HloModule jit_aten_mm_default, is_scheduled=true", 1)
    assert not compile_cache.spans_processes(spmd)  # one process: every device is local
    monkeypatch.setattr(compile_cache.jax, "process_count", lambda: 2)
    assert compile_cache.spans_processes(spmd)
    assert not compile_cache.spans_processes(local)
    assert not compile_cache.spans_processes(
        executable("HloModule jit_f, replica_count=2, num_partitions=1", 2))
    written = []
    monkeypatch.setattr(compile_cache.WRITES, "begin", lambda: written.append(1) or False)
    compile_cache.jax_cache.put_executable_and_time("k", "m", spmd, None, 0.0)
    assert written == []  # refused before any write began
    compile_cache.jax_cache.put_executable_and_time("k", "m", local, None, 0.0)
    assert written == [1]
