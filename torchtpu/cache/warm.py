"""Warm starts: programs found by torchtpu's own key, without tracing or lowering them again.

JAX's persistent cache (``compile_cache.py``) finds an executable by a hash of its StableHLO, so
a new process still traces and lowers every program before the cache can answer: for a captured
training step that is most of a warm first step. Here a program is found by what torchtpu
recorded instead (the captured op sequence, an op's name and static arguments): a ``Program``
is a jitted function with such a key. Its first call in a process looks the key and the
arguments' shapes and dtypes up in an index entry of the cache directory; when the entry and the
executable it names are there, the executable is deserialized and wrapped in JAX's own
``Compiled`` object (what ``jax.experimental.serialize_executable`` rebuilds, without pickle:
index entries are JSON), and nothing is traced, lowered or compiled. Otherwise the program is
lowered and compiled as usual (JAX's cache may still find it) and the index entry is written.
``warm_dispatch.py`` does the same per signature for an eager op's program, which meets many
shapes (``compiled_for``).

Index entries and ``records`` (small JSON facts, such as the result shapes of recorded ops) are
entries of the same ``EntryStore`` as the executables: checksummed, written atomically, evicted
by the same LRU bound. Nothing read from the directory is unpickled; the executable is XLA's
serialized form, trusted as JAX's cache trusts it (see ``compile_cache.py``).

A key must name everything its program depends on (``warm_keys.py``). Callers give what is
theirs (``canonical`` turns op names, specs, view geometries and module-level functions into
stable text and refuses anything whose identity is only an address); ``fingerprint()`` adds the
versions of torch, JAX and jaxlib, the platform, its device kind and version, the XLA flags and a
hash of torchtpu's own source, so that an edited lowering never loads a program built from the
old one; a program's
call adds the JAX settings it is traced under (``TRACED_SETTINGS``: x64, the matmul precision,
the random bits' settings, ...) and the compiler options it is compiled under
(``compiler_options.py``): a ``Program`` keeps an executable per such settings, as jit keeps a
trace per JAX setting of its trace context.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import logging
import os
import stat
import threading
import warnings
from pathlib import Path

import jax
import numpy as np
from jax._src import compilation_cache as jax_cache
from jax._src import config as jax_config
from jax._src import core, stages
from jax._src.interpreters import pxla
from jax._src.lib import xla_client as xc
from jax.sharding import SingleDeviceSharding

from torchtpu import metrics

# warm_keys as a module: importing it first starts the platform, whose start loads this module
# (runtime/hooks.py), while warm_keys' names are not defined yet.
from torchtpu.cache import compile_cache, warm_ahead, warm_keys
from torchtpu.runtime import compiler_options, hooks

# A program loaded by key is logged as JAX logs one it compiles: the watch tools count both (a
# new shape every step costs a program whether a cache holds it or not).
PROGRAM_LOG = logging.getLogger(__name__)

_RECORD = "ttpu_record"


# ---------------------------------------------------------------------------- records


def cache_on() -> bool:
    """Whether the persistent cache (and so anything kept for warm starts) is on."""
    return compile_cache.store() is not None


_refused: set = set()  # directories already warned about


def private_store():
    """The store, if its directory is one only this user can write; else None, with a warning
    once. An index entry chooses which executable a program runs, without the StableHLO hash
    that binds JAX's entries to their programs: a directory others can write (a shared root)
    keeps to JAX's cache."""
    store = compile_cache.store()
    if store is None:
        return None
    path = store.path
    try:
        why = _not_private(path)
    except OSError:
        return None  # the directory cannot be used at all: the store's own warning says so
    if why is None:
        return store
    if path not in _refused:
        _refused.add(path)
        warnings.warn(f"torchtpu.cache: warm starts are off for {path}: the directory {why}. "
                      "Programs are still found in it through JAX's cache (traced and lowered "
                      "first); for warm starts use a directory only you can write (chmod go-w, "
                      "or point TORCHTPU_CACHE_DIR at one of your own).",
                      compile_cache.CompileCacheWarning, stacklevel=3)
    return None


def _not_private(path: Path) -> str | None:
    st = os.stat(path)
    if st.st_uid != os.getuid():
        return f"is owned by uid {st.st_uid}, not by this user (uid {os.getuid()})"
    if st.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        return f"is writable by others (mode {stat.S_IMODE(st.st_mode):o})"
    return None


_written: list = []  # callables run after each program's index entry is written


def on_program_written(fn) -> None:
    """fn() (cheap: on the compiling thread) runs after each new program's index entry is
    written: facts learned on the way to it (``eager/facts.py``) are written with it."""
    if fn not in _written:
        _written.append(fn)


def read_record(kind: str, key: str):
    """The JSON value stored for (kind, key), or None (no private cache, no entry)."""
    store = private_store()
    data = None if store is None else store.get(f"{_RECORD}_{kind}-{key}")
    return None if data is None else json.loads(data)


def write_record(kind: str, key: str, value) -> None:
    """Store value (JSON-able) for (kind, key), replacing what was there."""
    store = private_store()
    if store is not None:
        store.replace(f"{_RECORD}_{kind}-{key}", json.dumps(value).encode())


# ---------------------------------------------------------------------------- structures


def encode_tree(tree) -> object:
    """A pytree structure (of tuples, lists, None and leaves) as JSON; Unstable otherwise."""
    return _encode(jax.tree_util.tree_unflatten(tree, [0] * tree.num_leaves))


def _encode(x):
    if x is None:
        return None
    if isinstance(x, int) and not isinstance(x, bool):
        return "*"
    if type(x) in (tuple, list):
        return {"t" if type(x) is tuple else "l": [_encode(v) for v in x]}
    raise warm_keys.Unstable(f"a {type(x).__name__} node")


def decode_tree(encoded):
    return jax.tree_util.tree_structure(_decode(encoded))


def _decode(x):
    if x is None:
        return None
    if x == "*":
        return 0
    (kind, items), = x.items()
    values = [_decode(v) for v in items]
    return tuple(values) if kind == "t" else values


def encode_aval(a) -> list:
    if not isinstance(a.dtype, np.dtype):
        raise warm_keys.Unstable(f"dtype {a.dtype}")
    return [list(a.shape), a.dtype.name, bool(getattr(a, "weak_type", False))]


def decode_aval(e) -> core.ShapedArray:
    return core.ShapedArray(tuple(e[0]), jax.numpy.dtype(e[1]), weak_type=e[2])


# JAX settings that change what a trace computes or refuses (a program loaded by key is not
# traced: a process with JAX_THREEFRY_PARTITIONABLE=false drew another's random numbers).
TRACED_SETTINGS = tuple(f"jax_{n}" for n in (
    "enable_x64 default_matmul_precision threefry_partitionable default_prng_impl "
    "enable_custom_prng random_seed_offset high_dynamic_range_gumbel softmax_custom_jvp "
    "numpy_dtype_promotion numpy_rank_promotion allow_f16_reductions debug_nans debug_infs "
    "disable_jit explicit_x64_dtypes").split())  # (the device: in the fingerprint)


def traced_settings() -> list:
    """``TRACED_SETTINGS``' values now, as text (a name this JAX lacks is skipped)."""
    return [str(getattr(jax.config, n)) for n in TRACED_SETTINGS if n in jax_config.config_states]


def _signature(args: tuple) -> list:
    out = []
    for a in args:
        if isinstance(a, (bool, int, float, complex)):
            out.append(type(a).__name__)
        else:
            out.append([list(a.shape), np.dtype(a.dtype).name, bool(getattr(a, "weak_type", 0))])
    return out


# ---------------------------------------------------------------------------- programs


class Program:
    """A jitted function with a key of torchtpu's own, called at one argument signature: its
    first call loads the executable by key when a warm cache has it (see the module doc)."""

    __slots__ = ("_jitted", "_key", "_calls")

    def __init__(self, jitted, key: str | None) -> None:
        self._jitted = jitted
        self._key = key
        self._calls: dict = {}  # settings -> what a call at them runs

    @property
    def jitted(self):
        return self._jitted

    @property
    def __name__(self) -> str:  # the program's name, as the profiler reads it off a jitted one
        return self._jitted.__name__

    def __call__(self, *args):
        # A compiled executable is bound to the compiler options and the JAX settings it was
        # built under (jit's own cache keys its trace context; an executable loaded or compiled
        # here does not): a capture under torch.tpu.precision(HIGHEST) reuses this Program when
        # it recorded the same ops as one under DEFAULT.
        settings = (compiler_options.generation, jax_config.trace_context())
        call = self._calls.get(settings)
        if call is None:
            if len(self._calls) >= 8:  # (settings toggled many times: keep the recent ones)
                self._calls.clear()
            call = self._calls[settings] = self._prepare(args)
        if call is self._jitted:
            return call(*args)
        try:
            return call(*args)
        except TypeError:
            # Arguments of another signature than the first call's (checked before anything
            # runs or is donated): jit serves them, as it would have.
            self._calls[settings] = self._jitted
            return self._jitted(*args)

    def _prepare(self, args: tuple):
        if self._key is None or not cache_on() or hooks.every_compile_watched():
            return self._jitted  # (a TPU target compiles what JAX compiles: no load by key)
        return compiled_for(self._jitted, self._key, args)


def compiled_for(jitted, key: str, args: tuple):
    """jitted's executable for args: loaded by key (and the settings it is traced under) when
    an index entry has it, else lowered and compiled, its entry written."""
    # With the settings it is traced under now, which a process may change as it runs
    # (torch.set_float32_matmul_precision sets JAX's).
    # (An op's arguments may be lists of arrays: a _foreach_ op's.)
    leaves, tree = jax.tree_util.tree_flatten(args)
    settings = [traced_settings(), _signature(leaves), str(tree), compiler_options.key()]
    key = hashlib.sha256(f"{key}\0{json.dumps(settings)}".encode()).hexdigest()
    ahead = _ahead()
    loaded = ahead.take(key) if ahead is not None else None
    entry = None if loaded is not None else read_record("index", key)
    if entry is not None:
        try:
            loaded = _load(entry)
        except Exception as e:  # noqa: BLE001 (any failure: the program compiles instead)
            warnings.warn(f"torchtpu.cache: a warm-start entry is unusable ({e!r}); "
                          "compiling the program and replacing the entry",
                          compile_cache.CompileCacheWarning, stacklevel=4)
    if loaded is not None:
        if ahead is not None:  # (the list the next run loads ahead: kept only where it will)
            _used.setdefault(key)
        metrics.program_loaded_by_key()
        if PROGRAM_LOG.isEnabledFor(logging.DEBUG):
            PROGRAM_LOG.debug("Loading %s with global shapes and types %s",
                              getattr(jitted, "__name__", "program"),
                              [jax.typeof(x) for x in leaves])
        return loaded
    with compile_cache.requests() as asked:
        compiled = jitted.lower(*args).compile()
    entry = _describe(compiled, asked)
    if entry is not None:
        write_record("index", key, entry)
        if ahead is not None:
            _used.setdefault(key)
        for fn in _written:
            fn()
    return compiled


# ---------------------------------------------------------------------------- ahead

_ahead_lock = threading.Lock()
_ahead_state: list = []  # [the process's Ahead, or None], once its first program asked
_used: dict = {}  # the index keys this process loaded or wrote, in first-use order


def _ahead() -> warm_ahead.Ahead | None:
    """The loader of the programs the last run of this command used, started at the process's
    first program (``warm_ahead``); None when it is off."""
    if _ahead_state:
        return _ahead_state[0]
    with _ahead_lock:
        if not _ahead_state:
            manifest = warm_keys.key_of("manifest", warm_ahead.command())
            if manifest is None or not warm_ahead.enabled() or private_store() is None:
                _ahead_state.append(None)
            else:
                atexit.register(_write_manifest, manifest, os.getpid())
                # (read here, not on the thread: a restart's reads do not hang on its timing)
                _ahead_state.append(warm_ahead.Ahead(read_record("manifest", manifest) or [],
                                                     _load_key))
    return _ahead_state[0]


def _load_key(key: str):
    entry = read_record("index", key)
    return None if entry is None else _load(entry)


def _write_manifest(manifest: str, pid: int) -> None:
    if _used and os.getpid() == pid:  # (a forked child inherits its parent's exit hooks)
        write_record("manifest", manifest, list(_used)[:warm_ahead.MAX_KEYS])


def _forget_ahead() -> None:
    """A forked child starts its own: the parent's thread is not running in it."""
    global _ahead_lock
    _ahead_lock = threading.Lock()
    _ahead_state.clear()
    _used.clear()


os.register_at_fork(after_in_child=_forget_ahead)


def _describe(compiled, asked: list) -> dict | None:
    """What _load needs to rebuild compiled from JAX's cache entry; None if it cannot."""
    exe = getattr(compiled, "_executable", None)
    u = getattr(exe, "_unloaded_executable", None)
    if not isinstance(u, pxla.UnloadedMeshExecutable) or len(asked) != 1:
        return None
    if (compiled._params.const_args or u.ordered_effects or u.unordered_effects
            or u.host_callbacks or u.mut is not None or len(u.device_list) != 1
            or any(x is not None for x in u.dispatch_in_layouts)
            or not all(isinstance(s, SingleDeviceSharding)
                       for s in (*u.input_shardings, *u.output_shardings))):
        return None
    try:
        flat, in_tree = jax.tree_util.tree_flatten(compiled.args_info)
        args_tree, kwargs = jax.tree_util.tree_unflatten(in_tree, [0] * len(flat))
        if kwargs:
            return None
        return {"jax_key": asked[0], "name": u.name, "device": u.device_list[0].id,
                "committed": bool(u.committed), "kept": sorted(u.kept_var_idx),
                "args": [[*encode_aval(i._aval), bool(i.donated)] for i in flat],
                "args_tree": _encode(args_tree),
                "in": [encode_aval(a) for a in u.input_avals],
                "out": [encode_aval(a) for a in u.output_avals],
                "out_tree": encode_tree(compiled.out_tree)}
    except warm_keys.Unstable:
        return None


@functools.cache
def _host_kernels_registered() -> None:
    """XLA:CPU's LAPACK kernels registered with XLA, as JAX does before it runs a deserialized
    module (``jax.export``): lowering a linear-algebra op registers them, and a program loaded
    in a process that lowered none called them unregistered (``torch.linalg.inv``'s program,
    loaded by a second process, crashed it with a segmentation fault)."""
    from jax._src.lax import linalg

    linalg.initialize_lapack()


def _load(entry: dict):
    """The Compiled program an index entry describes, or None (its executable is gone)."""
    store = compile_cache.store()
    device = {d.id: d for d in jax.devices()}.get(entry["device"])
    data = store.get_executable(entry["jax_key"]) if store is not None else None
    if device is None or data is None:
        return None
    serialized, _ = jax_cache.extract_executable_and_time(jax_cache.decompress_executable(data))
    devices = xc.DeviceList((device,))
    _host_kernels_registered()
    executable = device.client.deserialize_executable(serialized, devices)
    sharding = SingleDeviceSharding(device)
    ins = [decode_aval(a) for a in entry["in"]]
    outs = [decode_aval(a) for a in entry["out"]]
    unloaded = pxla.UnloadedMeshExecutable(
        xla_executable=executable, device_list=devices, backend=device.client,
        input_avals=ins, input_shardings=[sharding] * len(ins), output_avals=outs,
        output_shardings=[sharding] * len(outs), committed=entry["committed"],
        name=entry["name"], unordered_effects=[], ordered_effects=[], keepalive=[],
        host_callbacks=[], kept_var_idx=set(entry["kept"]), mut=None,
        xla_in_layouts=[None] * len(ins), dispatch_in_layouts=[None] * len(ins),
        xla_out_layouts=[None] * len(outs), all_args_info=None, pgle_profiler=None)
    infos = [stages.ArgInfo(decode_aval(a[:3]), a[3]) for a in entry["args"]]
    args_tree = jax.tree_util.tree_structure((_decode(entry["args_tree"]), {}))
    return stages.Compiled(unloaded.load(), [], args_tree.unflatten(infos),
                           decode_tree(entry["out_tree"]), no_kwargs=True)


hooks.keep_records(read_record, write_record)  # the TPU target's verdicts (targets/tpu_target.py)
