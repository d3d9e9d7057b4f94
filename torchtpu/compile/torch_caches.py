"""Where PyTorch's own caches of tpu graphs live: in torchtpu's cache directory, when private.

PyTorch writes them (AOTAutogradCache's entries, Dynamo's precompiled functions: see
``graph_cache.py``) under Inductor's cache directory (``TORCHINDUCTOR_CACHE_DIR``, by
default ``/tmp/torchinductor_<user>``, which any user could have made first). They are
pickles, so torchtpu keeps them only in its own cache directory when that is private
(``warm.private_store``: owned by this user, writable by no one else), in ``torch/<key>``, the
key a hash of torch's and JAX's versions and torchtpu's source (a graph's AOTAutograd form
depends on which ops have lowerings, which PyTorch's key does not see). ``place`` points
``TORCHINDUCTOR_CACHE_DIR`` there when Dynamo is imported, so Inductor's caches of the same
process go there too. When the cache is off, the directory is shared, or the user chose a
``TORCHINDUCTOR_CACHE_DIR`` of their own, or the directory cannot be made or written, tpu graphs
are not cached this way (a ``torchtpu.cache:`` warning says why for the last three: for the
last, the store's own warning of a failing directory) and everything is traced as before.
A process that makes a new key's directory deletes all but the ``KEEP`` most recently made
ones (an upgrade or an edit of torchtpu leaves the old one unused); they are not counted in
``TORCHTPU_CACHE_MAX_BYTES``.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import os
import shutil
import warnings
from pathlib import Path

import jax
import torch

from torchtpu import settings
from torchtpu.cache import compile_cache, warm, warm_keys

KEEP = 4  # key directories kept (torch versions or torchtpu sources in use side by side)

_warned: set = set()


def warn_once(why: str) -> None:
    if why not in _warned:
        _warned.add(why)
        warnings.warn(f"torchtpu.cache: Dynamo's graphs are traced again in every process: {why}",
                      compile_cache.CompileCacheWarning, stacklevel=4)


def torch_dir() -> str | None:
    """Where PyTorch's caches of tpu graphs live: the private cache's ``torch/<key>``, the key
    a hash of the versions and torchtpu's source; None without a private cache."""
    store = warm.private_store()
    if store is None:
        return None
    key = hashlib.sha256("\0".join([torch.__version__, jax.__version__, jax.lib.__version__,
                                     warm_keys.source_digest()]).encode()).hexdigest()
    return str(Path(store.path).resolve() / "torch" / key[:16])




def _user_chose(chosen: str | None, ours: str) -> bool:
    """Whether TORCHINDUCTOR_CACHE_DIR=chosen is the user's (PyTorch writes its default there)."""
    # what ``place`` set it to in a parent (which may have had another TORCHTPU_CACHE_DIR)
    placed = settings.PLACED_INDUCTOR_CACHE_DIR.get()
    if chosen is None or os.path.abspath(chosen) in (ours, placed):
        return False
    from torch._inductor.runtime.cache_dir_utils import default_cache_dir

    return os.path.abspath(chosen) != os.path.abspath(default_cache_dir())


@functools.cache
def place() -> bool:
    """Point PyTorch's cache directory (AOTAutogradCache, Dynamo's precompile entries) into
    torchtpu's private one; whether tpu graphs may be cached. Runs at a torch.compile for
    "tpu" (``compile/__init__.py``), before Dynamo looks for a precompiled function, and warns once
    when they may not."""
    ours = torch_dir()
    if ours is None:
        return False  # the cache is off, or shared (warm.private_store warned)
    chosen = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if _user_chose(chosen, ours):
        warn_once(f"TORCHINDUCTOR_CACHE_DIR={chosen} is set; torchtpu reads PyTorch's pickled "
                  f"caches only from its own private directory ({ours}): unset "
                  "TORCHINDUCTOR_CACHE_DIR for warm starts of compiled graphs")
        return False
    try:
        _make(Path(ours))
    except OSError as error:
        # Inductor makes its cache's subdirectories as it sets up and raises when it cannot:
        # left at its default it compiles as without torchtpu's cache, and the directory's
        # failure is the store's one warning (``cache_faults``), as for eager programs.
        compile_cache.store().faults.failed("write", error)
        return False
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = ours
    settings.PLACED_INDUCTOR_CACHE_DIR.export(ours)
    return True


def _make(path: Path) -> None:
    """path made (an OSError when it cannot be made or written), and its parent's key
    directories but the KEEP newest deleted."""
    if not path.is_dir():
        path.mkdir(parents=True, exist_ok=True)
        for old in sorted(path.parent.iterdir(), key=lambda p: p.stat().st_mtime,
                          reverse=True)[KEEP:]:
            if old != path:
                shutil.rmtree(old, ignore_errors=True)
    if not os.access(path, os.W_OK | os.X_OK):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(path))
