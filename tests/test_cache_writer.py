"""Cache writes off the compiling thread (``cache/cache_writer.py``): the entry the writer
thread makes is the one a write on the compiling thread made, a program compiled again while
its entry is pending finds it, and the bytes waiting for the writer are bounded. (That exit
waits for a write under way: ``test_compile_cache``'s exit test.)"""

import threading
import time

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax._src import compilation_cache as jax_cache

import torchtpu
from torchtpu.cache import cache_writer, compile_cache
from torchtpu.cache.cache_entry import READ_BACK, parts
from torchtpu.cache.compile_cache import EntryStore


@pytest.fixture
def store(tmp_path):
    """A fresh store JAX reads and writes for the test (the process's own put back after: the
    store it had before ``enable``, which makes another)."""
    saved = jax_cache._cache, jax_cache._cache_initialized
    compile_cache.enable()  # (the guarded reads and writes; the test's store replaces its)
    compile_cache.flush()
    jax_cache._cache = fresh = EntryStore(tmp_path)
    try:
        yield fresh
    finally:
        compile_cache.flush()
        jax_cache._cache, jax_cache._cache_initialized = saved


def _program(scale: float):
    """A new function each call: JAX's in-memory caches never hold its executable."""
    return jax.jit(lambda x: jnp.sin(x) * scale + 1)


def test_the_writers_entry_is_what_a_write_on_the_compiling_thread_made(store):
    x = np.linspace(-2, 2, 7, dtype=np.float32)
    with compile_cache.requests() as asked:
        start = time.monotonic()
        compiled = _program(3.0).lower(x).compile()
        took = time.monotonic() - start
    assert compile_cache.flush(60)
    (key,) = asked
    seconds, kind, host, payload = parts(store.entry(key).read_bytes())
    # JAX's put on the executable itself: compress(compile time | serialize()).
    serialized, compile_time = jax_cache.extract_executable_and_time(
        jax_cache.decompress_executable(payload))
    assert serialized == compiled._executable.xla_executable.serialize()
    assert payload == jax_cache.compress_executable(
        jax_cache.combine_executable_and_time(serialized, compile_time))
    assert kind == READ_BACK and host == parts(store.entry(key).read_bytes())[2]
    assert 0 <= seconds <= took  # from the miss to the compile's end, not to the write's
    # The entry loads (a new process's read) and computes what the compiled program does.
    loaded = _program(3.0).lower(x).compile()
    np.testing.assert_array_equal(np.asarray(loaded(x)), np.asarray(compiled(x)))
    assert store.stats()["entries"][key]["read_count"] == 1


def test_a_program_compiled_again_while_its_entry_is_pending_finds_it(store, monkeypatch):
    written, put = [], store.put

    def slow_put(key, value):
        time.sleep(0.5)
        put(key, value)
        written.append(key)

    monkeypatch.setattr(store, "put", slow_put)
    x = np.ones(5, np.float32)
    hits = torchtpu.metrics.snapshot()["persistent_cache_hits"]
    compiled = _program(2.0).lower(x).compile()
    assert written == []  # the compile returned before its entry was written
    again = _program(2.0).lower(x).compile()  # waits for the entry, then reads it
    assert len(written) == 1
    assert torchtpu.metrics.snapshot()["persistent_cache_hits"] == hits + 1
    np.testing.assert_array_equal(np.asarray(again(x)), np.asarray(compiled(x)))


def test_the_bytes_waiting_for_the_writer_are_bounded(monkeypatch):
    writes = cache_writer.Writes()
    monkeypatch.setattr(cache_writer, "MAX_PENDING_BYTES", 100)
    release, ran = threading.Event(), []

    def job(name):
        def run():
            release.wait(60)
            ran.append(name)
        return run

    for name, nbytes in (("a", 60), ("b", 30)):
        assert writes.begin()
        writes.submit(name, nbytes, job(name))
    assert writes.begin()
    third = threading.Thread(target=writes.submit, args=("c", 30, job("c")))
    third.start()
    third.join(0.5)
    assert third.is_alive()  # 120 bytes would wait: the compiling thread waits instead
    assert not writes.settle("b", 0.01) and writes.settle("other", 0)
    release.set()
    third.join(60)
    assert writes.flush(60) and ran == ["a", "b", "c"]
    assert writes.close(1) and not writes.begin()  # closed: no write starts
