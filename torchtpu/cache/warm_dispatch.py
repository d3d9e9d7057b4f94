"""Strict's per-op programs loaded by torchtpu's key in a new process, through JAX's own C++
dispatch (``dispatched``).

A new process traced and lowered every eager op program again before JAX's persistent cache
could answer (~30 ms each; a colocated GRPO step's first step met 383 of them). An op's program
meets many argument signatures, so ``warm.Program`` (one signature, a ``Compiled`` called from
Python: 12-14% more per call) does not fit it. Here the op's program is a C++ dispatcher of
JAX's (what ``jax.jit`` returns, as fast per call: ``bench/warm_dispatch.py``) whose cache miss,
for each new signature, finds the executable by the key's index entry (``warm.compiled_for``:
loaded, or lowered and compiled and its entry written) and hands JAX that executable's fast-path
data: later calls of that signature never leave C++.

This uses JAX's private entry points: ``_jax.pjit`` called with no function and a cache miss of
its own, the form JAX's ``MeshExecutable.create_cpp_call`` uses for a ``Compiled``, and the
``_cache_miss`` of a jitted function and of such a call. They are the same in JAX 0.10 and
0.11 (the versions torchtpu supports; checked in 0.10.2 and 0.11.2). Under another version,
or where one of them is missing or refuses that call form, each op program is plain
``jax.jit`` (traced in every process, found in JAX's StableHLO-keyed cache): counted as
``warm_dispatch_off`` in ``torchtpu.metrics``, and said once in a warning when a cache
directory is in use.
"""

from __future__ import annotations

import functools
import warnings

import jax
from jax._src import core, tree_util
from jax._src.interpreters import pxla
from jax._src.lib import _jax

from torchtpu import metrics
from torchtpu.cache import compile_cache, warm, warm_keys
from torchtpu.runtime import dump, hooks

# (major, minor) versions of JAX whose private dispatch entry points this module was checked in.
CHECKED = ((0, 10), (0, 11))


def dispatched(jitted):
    """jitted (named by ``warm_keys.named``) called through JAX's per-signature dispatch, each new
    signature's executable loaded by key when a warm cache has it (see the module doc); jitted
    itself when it has no key's parts or JAX's entry points cannot be used here."""
    parts = getattr(jitted, "_ttpu_parts", None)
    if parts is None:
        return jitted
    if unavailable() is not None:
        metrics.count("warm_dispatch_off")
        return jitted
    key = []  # found at the first miss: a process whose cache is off never hashes it

    def miss(*args):
        # JAX's C++ dispatch calls this for a signature it has no executable for; what it
        # returns (the results, and the executable's fast-path data) serves the next calls.
        if not key:
            key.append(warm_keys.key_of(*parts))
        # (Traced values, or none but inside another program's trace (a recorded call of no
        # arguments, such as zeros): the program is staged into that trace, as jit's call is,
        # not run and baked in as a constant. A dump asks for each program's text, which only a
        # trace writes.)
        if (key[0] is None or not warm.cache_on() or hooks.every_compile_watched()
                or dump.active()
                or not isinstance(core.trace_ctx.trace, core.EvalTrace)
                or any(isinstance(x, core.Tracer) for x in jax.tree_util.tree_leaves(args))):
            return jitted._cache_miss(*args)
        compiled = warm.compiled_for(jitted, key[0], args)
        call = compiled._executable.create_cpp_call(compiled._params)
        if call is None:  # (effects or host callbacks: jit's own dispatch handles them)
            return jitted._cache_miss(*args)
        return call._cache_miss(*args)

    fn = functools.wraps(jitted)(_jax.pjit(jitted.__name__, None, miss, [], [],
                                           pxla.JitGlobalCppCacheKeys(),
                                           tree_util.dispatch_registry, pxla.cc_shard_arg))
    fn.jitted = jitted  # (``lower`` is jit's too: wraps copied what it reads)
    return fn


def keyed(jitted, *parts):
    """jitted known by ``parts`` in keys (``warm_keys.named``) and called through
    :func:`dispatched`: the device layer's own programs (a view read or write, a cast, a copy),
    which eager code runs as often as op programs, load by key in a new process as those do."""
    return dispatched(warm_keys.named(jitted, *parts))


@functools.cache
def unavailable() -> str | None:
    """Why JAX's dispatch entry points cannot be used in this process, or None."""
    why = _why_not()
    if why is not None and warm.cache_on():
        warnings.warn(f"torchtpu.cache: eager op programs are not loaded by key ({why}); "
                      "each is traced in every process and found in JAX's cache",
                      compile_cache.CompileCacheWarning, stacklevel=4)
    return why


def _why_not() -> str | None:
    version = tuple(int(p) for p in jax.__version__.split(".")[:2] if p.isdigit())
    if version not in CHECKED:
        return (f"JAX {jax.__version__}: its private dispatch entry points were checked in "
                f"{', '.join('.'.join(map(str, v)) for v in CHECKED)} only")
    pjit = getattr(_jax, "pjit", None)
    if pjit is None or not hasattr(pxla.MeshExecutable, "create_cpp_call"):
        return f"jaxlib {jax.lib.__version__} has no _jax.pjit or create_cpp_call"
    try:
        probe = pjit("probe", None, _never, [], [], pxla.JitGlobalCppCacheKeys(),
                     tree_util.dispatch_registry, pxla.cc_shard_arg)
    except TypeError as e:  # (nanobind checks the call form when it is made)
        return f"_jax.pjit refuses the call form JAX {jax.__version__}'s create_cpp_call used ({e})"
    if not hasattr(probe, "_cache_miss") or not hasattr(jax.jit(_never), "_cache_miss"):
        return "a dispatcher of this JAX has no _cache_miss"
    return None


def _never(*args):
    raise AssertionError("the probe of JAX's entry points is never called")
