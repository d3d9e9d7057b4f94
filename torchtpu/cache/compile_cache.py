"""The persistent compile cache: every XLA program, kept across runs, in ``~/.cache/torchtpu``.

``TORCHTPU_CACHE_DIR`` moves it; ``TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT`` names a root shared
by several hosts; ``TORCHTPU_CACHE_DIR=off`` turns it off. Every program is cached, however fast
it compiled: on XLA:CPU even small programs cost 50-150 ms, and eager runs compile many of them.
Eager per-op programs and compiled graphs both go through ``jax.jit``, so both are cached.

JAX decides what to cache and computes the key (a hash of the StableHLO, compile options,
devices and JAX/XLA versions); ``EntryStore`` replaces JAX's file store, which writes entries in
place and keeps a broken one forever (its reader warns and recompiles, its writer then skips the
key because the file exists). Here each entry is one file ``<key>.ttpu``:

    b"TTPU3" | sha256(rest) (32 bytes) | rest = compile seconds (float64, big-endian)
             | kind (b"X": an executable its writer read back, b"R": anything else)
             | host length (uint16) | host | payload

where payload is JAX's own entry: a zlib- or zstd-compressed 4-byte compile time followed by
XLA's serialized executable (the runtime's binary format; nothing here or in JAX unpickles
anything read from the cache directory). JAX rounds its compile time down to whole seconds, so
the store keeps its own: the time from JAX's miss on a key to its write of that key.

An executable is only ever loaded if it was written whole by a process that then read it back:
before an executable's entry is published, its writer deserializes it (``_read_back``); one that
does not read back is not cached (a ``torchtpu.cache:`` warning names it), and JAX's reads take
only entries of kind ``X``. ``host`` names what the machine code was built for: the platform,
jaxlib and, on XLA:CPU (which compiles for the features of the CPU it runs on, and which JAX's
key leaves out), the CPU's features; an entry written on another host (AVX-512 code read on an
AVX2 machine would die of an illegal instruction) is skipped. An entry that is short, has
another header, fails its digest, comes from another host or was not read back is reported with
a ``CompileCacheWarning``, deleted, and treated as a miss, so the program is recompiled and
written again; one written by an older torchtpu (``TTPU1``, ``TTPU2``) is replaced without a
warning. (Hosts of different CPUs sharing one directory replace each other's entries.)

XLA:CPU crashes (SIGSEGV) when the process runs out of memory maps, in whichever compile or
cache read comes next (issue 26); ``map_room`` keeps it from running out, and every read here
makes room first.
A directory that fails (full, read-only, deleted, never creatable) costs compiles, never a
program (``cache_faults``: one warning per kind of failure).
Writes go to a private temporary file in the same directory and are renamed into place (atomic
on POSIX), so concurrent writers and readers only ever see whole entries; two processes writing
one key leave one whole entry.

The directory is bounded: ``TORCHTPU_CACHE_MAX_BYTES`` (default 1 GiB; ``0`` means no limit) caps
the bytes of its entries, and when a write takes it over the cap the least recently used entries
are deleted down to 90% of it. "Used" is the file's modification time, which a hit refreshes, so
the order is shared by every process using the directory. Each process counts what it writes and
rescans the directory (a sizes-only ``scandir``) when its count reaches the cap or it has written
a tenth of the cap since its last scan, so each concurrent writer overshoots by at most a tenth
of the cap; an ``flock`` keeps two processes from evicting at once, and a reader whose entry was
just evicted sees a miss.

``verify()`` reads every entry of the directory and names those a reader would refuse, and
``prune()`` deletes them (``python -m torchtpu.doctor [--prune-cache]``). ``stats()``
(``torch.tpu._get_cache_stats()``) reports this process's requests and hits and, per entry it
read, the read count, the last read and the compile time stored in the entry.

Serializing a program (XLA's ``executable.serialize()``, which runs on the compiling thread
right after the compile, before anything else can run or donate to the new executable, which
keeps its client alive) is the one step of a write that must run there; the rest (compressing,
the read-back, the file) runs on a writer thread (``cache_writer``), so a big program's entry
does not hold up its first call. A process can be torn down under a write: a thread that
compiles (PyTorch's autograd thread, a data loader's prefetch thread, a user's daemon thread)
may be serializing, or the writer writing, when the main thread exits, and XLA's static state is
destroyed under it. So every write is counted from its start to its end, and at exit (an
``atexit`` hook that runs before JAX's own clean-up) the process stops starting writes and waits,
up to ``cache_writer.EXIT_WAIT_SECONDS``, for those under way: no program is serialized once
exit has begun. ``flush()`` waits for the writes begun so far.

The digest detects damage, not tampering: like JAX's cache, the directory is trusted (whoever can
write to it can make this process run code of their choosing). Do not share it with untrusted
users. Only a directory no one else can write (``warm.private_store``) also gets torchtpu's
warm-start records and PyTorch's pickled caches of tpu graphs (``compile/torch_caches.py``).
"""

from __future__ import annotations

import atexit
import contextlib
import fcntl
import os
import tempfile
import threading
import time
import warnings
from pathlib import Path

import jax
from jax._src import compilation_cache as jax_cache
from jax._src.compilation_cache_interface import CacheInterface

from torchtpu import settings
from torchtpu.cache import cache_policy, map_room
from torchtpu.cache.cache_entry import MAGIC as MAGIC  # (re-exported: the format's)
from torchtpu.cache.cache_entry import (
    OTHER,
    READ_BACK,
    CompileCacheWarning,
    pack,
    parts,
    problem_of,
    read_back,
)
from torchtpu.cache.cache_faults import Faults
from torchtpu.cache.cache_writer import WRITES, hand_off, writing
from torchtpu.cache.map_room import make_room
from torchtpu.runtime import hooks

SUFFIX = ".ttpu"
DEFAULT_MAX_BYTES = 1 << 30
_EVICT_TO = 0.9  # of the cap: evicting a margin at once keeps scans rare
_RESCAN_EVERY = 0.1  # of the cap: what one process writes between scans of the directory


class EntryStore(CacheInterface):
    """JAX's cache interface over a directory of checksummed, atomically written entries,
    bounded to ``max_bytes`` by least-recently-used eviction."""

    def __init__(self, path: Path, max_bytes: int = DEFAULT_MAX_BYTES) -> None:
        self._path = path
        self._max_bytes = max_bytes
        self.faults = Faults(path)  # what failed in the directory
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as e:  # reads miss and writes fail: the programs still run
            self.faults.failed("write", e)
        self._lock = threading.Lock()
        self._bytes: int | None = None  # entry bytes as of the last scan, plus our writes since
        self._unscanned = 0  # bytes we wrote since the last scan
        self._requests = 0
        self._reads: dict[str, list] = {}  # key -> [read count, last read (time.time())]
        self._missed: dict[str, float] = {}  # key -> when JAX missed it (its compile follows)

    @property
    def path(self) -> Path:
        return self._path

    def entry(self, key: str) -> Path:
        return self._path / f"{key}{SUFFIX}"

    def get(self, key: str) -> bytes | None:
        if not cache_policy.reads():
            return None
        path = self.entry(key)
        WRITES.settle(key)  # (its entry on the way from this process's writer: wait for it)
        asked = getattr(_asked, "keys", None)
        if asked is not None:
            asked.append(key)
        with self._lock:
            self._requests += 1
        try:
            data = path.read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            data = None  # a miss (a directory that is gone is reported by the write)
        except OSError as e:
            self.faults.failed("read", e)
            data = None
        if data is not None:
            problem = problem_of(data)
            if problem is None and getattr(_executable_read, "on", False) \
                    and parts(data)[1] != READ_BACK:
                problem = "it was not read back by the process that wrote it"
            if problem is None:
                self._record_read(key, path)
                return parts(data)[3]
            if problem:
                warnings.warn(f"torchtpu.cache: compile cache entry {path} is unusable: {problem}; "
                              "recompiling and replacing it", CompileCacheWarning, stacklevel=2)
            with contextlib.suppress(OSError):  # read-only: the write reports it
                path.unlink(missing_ok=True)
        with self._lock:
            self._missed[key] = time.monotonic()
        return None

    def get_executable(self, key: str) -> bytes | None:
        """``get`` for an executable's entry (one its writer read back), with room made in the
        memory maps for the executable the caller deserializes from it."""
        with _executable_reads():
            return self.get(key)

    def _record_read(self, key: str, path: Path) -> None:
        now = time.time()
        with self._lock:
            read = self._reads.setdefault(key, [0, now])
            read[0] += 1
            read[1] = now
        try:
            os.utime(path)  # the LRU order: a hit makes the entry the newest
        except OSError:
            pass  # evicted since we read it (we have the bytes), or a read-only directory

    def put(self, key: str, value: bytes) -> None:
        path = self.entry(key)
        with self._lock:
            missed = self._missed.pop(key, None)
        if os.path.exists(path) or not self.faults.writable() or not cache_policy.writes():
            return
        kind, compiled_at = OTHER, time.monotonic()
        serialized = writing()  # (on the writer thread, cache_writer)
        if serialized is not None:
            if not read_back(value, serialized, serialized.backend):
                return
            kind, compiled_at = READ_BACK, serialized.at
        seconds = compiled_at - missed if missed is not None else float("nan")
        self._write(path, pack(value, seconds, kind))

    def replace(self, key: str, value: bytes) -> None:
        """Store value under key, over what is there (torchtpu's own records, ``warm.py``)."""
        self._write(self.entry(key), pack(value, float("nan"), OTHER))

    def _write(self, path: Path, data: bytes) -> None:
        """data as path, the directory kept under its cap; an OS error leaves it unwritten."""
        if not self.faults.writable():
            return
        try:
            self._publish(path, data)
            self._account(len(data))
        except OSError as e:
            self.faults.failed("write", e)

    def _publish(self, path: Path, data: bytes) -> None:
        prefix = f".{path.name[:16]}-"
        try:
            fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=self._path)
        except FileNotFoundError:  # the directory was deleted under us
            self._path.mkdir(parents=True, exist_ok=True)
            self.faults.recreated()
            fd, tmp = tempfile.mkstemp(prefix=prefix, suffix=".tmp", dir=self._path)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            os.replace(tmp, path)
        except BaseException:
            with contextlib.suppress(OSError):
                Path(tmp).unlink(missing_ok=True)
            raise

    def clear(self) -> None:
        for p in self._path.glob(f"*{SUFFIX}"):
            p.unlink(missing_ok=True)
        with self._lock:
            self._bytes = 0

    # ------------------------------------------------------------------ size bound

    def _entries(self) -> list[tuple[float, int, str]]:
        """(last use, bytes, path) of every entry now in the directory."""
        found = []
        with os.scandir(self._path) as it:
            for e in it:
                if e.name.endswith(SUFFIX):
                    try:
                        st = e.stat()
                    except FileNotFoundError:
                        continue
                    found.append((st.st_mtime, st.st_size, e.path))
        return found

    def _account(self, nbytes: int) -> None:
        if not self._max_bytes:
            return
        with self._lock:
            self._unscanned += nbytes
            rescan = self._bytes is None or self._unscanned > self._max_bytes * _RESCAN_EVERY
            if not rescan:
                self._bytes += nbytes
                rescan = self._bytes > self._max_bytes
            if rescan:
                self._unscanned = 0
        if rescan:
            total = sum(size for _, size, _ in self._entries())
            with self._lock:
                self._bytes = total
            if total > self._max_bytes:
                self.evict()

    def evict(self) -> None:
        """Delete least recently used entries until the directory is under 90% of the cap."""
        with open(self._path / ".evict.lock", "w") as lock:
            try:
                fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return  # another process is evicting now
            entries = sorted(self._entries())
            total = sum(size for _, size, _ in entries)
            target = int(self._max_bytes * _EVICT_TO)
            for _, size, path in entries:
                if total <= target:
                    break
                Path(path).unlink(missing_ok=True)
                total -= size
        with self._lock:
            self._bytes = total

    # ------------------------------------------------------------------ statistics

    def stats(self) -> dict:
        """This process's requests and hits, and per entry read: reads, last read, compile time."""
        with self._lock:
            reads = {k: list(v) for k, v in self._reads.items()}
            requests = self._requests
        entries = {
            key: {"read_count": count, "last_read": last,
                  "compilation_duration": _stored_compile_seconds(self.entry(key))}
            for key, (count, last) in reads.items()
        }
        return {"num_cache_reqs": requests,
                "num_cache_hits": sum(count for count, _ in reads.values()),
                "entries": entries, "cache_dir": str(self._path),
                "max_bytes": self._max_bytes}


def _stored_compile_seconds(path: Path) -> float | None:
    """The compile time kept in an entry's header (None once the entry is gone)."""
    try:
        data = path.read_bytes()
    except OSError:
        return None  # evicted since it was read, or the directory is gone
    return parts(data)[0] if problem_of(data) is None else None


_executable_read = threading.local()  # .on: JAX is reading an executable


@contextlib.contextmanager
def _executable_reads():
    """Reads of executables' entries inside the block, with room made for one executable."""
    make_room()
    _executable_read.on = True
    try:
        yield
    finally:
        _executable_read.on = False


def spans_processes(executable) -> bool:
    """Whether a program runs over devices of several processes (an SPMD program of JAX's
    multi-process runtime, such as tpu_dist's XLA collectives).

    Such a program is never persisted: reading it back, which a write must do first, can only
    place it on this process's own devices, and XLA aborts the process for a program whose
    sharding spans more devices than that ("tile count and device count does not match").
    """
    if jax.process_count() == 1:
        return False
    head = executable.hlo_modules()[0].to_string().split("\n", 1)[0]
    devices = 1
    for name in ("replica_count", "num_partitions"):
        _, found, rest = head.partition(f"{name}=")
        if found:
            devices *= int(rest.split(",")[0].split(" ")[0] or 1)
    return devices > len(executable.local_devices())


def _guard_writes() -> None:
    """Route JAX's cache writes (serialize, compress, store) through ``WRITES`` and the
    read-back, and its reads through ``make_room``, once."""
    put = jax_cache.put_executable_and_time
    get = jax_cache.get_executable_and_time
    if getattr(put, "guarded_by_torchtpu", False):
        return

    def guarded_put(cache_key, module_name, executable, backend, *args, **kwargs) -> None:
        if spans_processes(executable):
            return  # its read-back would abort the process (see spans_processes)
        cache = store()
        if cache is not None and not cache.faults.writable():
            return  # a write just failed (cache_faults): serialize nothing
        if not WRITES.begin():
            return  # the process is exiting: the program is not persisted
        hand_off(put, cache_key, module_name, executable, backend, *args, **kwargs)

    def guarded_get(cache_key, *args, **kwargs):
        with _executable_reads():
            found = get(cache_key, *args, **kwargs)
        if found[0] is None:
            cache_policy.missed(cache_key)  # JAX compiles it next (unless refused there)
        return found

    guarded_put.guarded_by_torchtpu = True
    # JAX's compiler looks the functions up on their module at every write and read.
    jax_cache.put_executable_and_time = guarded_put
    jax_cache.get_executable_and_time = guarded_get
    # atexit runs handlers last-registered first: this one (registered when torchtpu is
    # imported, after jax) before JAX's clean-up, which clears the backends.
    atexit.register(WRITES.close)


_asked = threading.local()


@contextlib.contextmanager
def requests():
    """The keys this thread asks the store for inside the block (a list, filled as it runs)."""
    keys: list = []
    _asked.keys = keys
    try:
        yield keys
    finally:
        _asked.keys = None


def flush(timeout: float | None = None) -> bool:
    """Wait until every cache write begun so far is in the directory (or failed); True if none
    is left (False: timeout passed first)."""
    return WRITES.flush(timeout)


def max_bytes() -> int:
    """The cap ``TORCHTPU_CACHE_MAX_BYTES`` asks for (bytes, or with a K/M/G suffix); 0: none."""
    raw = (settings.CACHE_MAX_BYTES.get() or "").upper()
    if not raw:
        return DEFAULT_MAX_BYTES
    scale = {"K": 1 << 10, "M": 1 << 20, "G": 1 << 30}.get(raw[-1], 1)
    number = raw[:-1] if scale > 1 else raw
    try:
        value = int(float(number) * scale)
    except ValueError:
        value = -1
    if value < 0:
        raise ValueError(f"torchtpu.config: {settings.CACHE_MAX_BYTES.name}={raw!r} is not a byte "
                         "count (e.g. 1073741824, 512M, 2G; 0 for no limit)")
    return value


def cache_dir() -> Path | None:
    """The cache directory the environment asks for; None when the cache is off."""
    shared = os.environ.get("TORCH_TPU_TIER3_COMPILATION_CACHE_ROOT")
    chosen = settings.CACHE_DIR.get() or shared
    if chosen and chosen.strip().lower() in ("off", "0", "none"):
        return None
    if chosen:
        return Path(chosen).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "torchtpu"


def enable() -> None:
    """Point JAX's persistent cache at cache_dir(), stored by ``EntryStore``; compiles make
    room in the process's memory maps first (``map_room``), with the cache on or off."""
    map_room.install()
    _guard_writes()  # (also with the cache off: a test or tool may install a store later)
    path = cache_dir()
    if path is None:
        return
    store = EntryStore(path, max_bytes())
    jax.config.update("jax_compilation_cache_dir", str(path))
    jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
    jax.config.update("jax_persistent_cache_min_entry_size_bytes", 0)
    # JAX would point XLA's GPU autotuning cache into the directory, by its path, in every
    # program's compile options, which are part of each key: a copied or moved cache would
    # then miss everything. The executables themselves are cached here whatever the platform.
    jax.config.update("jax_persistent_cache_enable_xla_caches", "none")
    # JAX builds its file store lazily on first use; installing ours first keeps it from doing so.
    with jax_cache._cache_initialized_mutex:
        jax_cache._cache = store
        jax_cache._cache_initialized = True


def store() -> EntryStore | None:
    """The store JAX writes through, or None when the cache is off."""
    cache = jax_cache._cache
    return cache if isinstance(cache, EntryStore) else None


hooks.at_start(enable)  # when the platform starts, or now if it has
