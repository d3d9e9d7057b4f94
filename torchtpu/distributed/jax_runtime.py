"""Which transport a tpu_dist group uses, and starting JAX's multi-process runtime for the XLA one.

Two transports move collective data: ``host`` (device values through host memory and gloo,
``host.py``) and ``xla`` (XLA collective programs over the devices' own links, ``xla.py``).
``TORCHTPU_DIST_TRANSPORT=xla|host`` (or ``init_process_group(..., pg_options=
torchtpu.distributed.Transport("xla"))``) forces one; by default a TPU or GPU uses ``xla`` (ICI,
NVLink) and XLA:CPU uses ``host``, which measured faster there (bench/RESULTS.md).

The XLA transport needs JAX's multi-process runtime (``jax.distributed.initialize``), which must
run before JAX creates its backend, while ``import torch`` already loads torchtpu. torchtpu
starts JAX's backend lazily, at the first tpu tensor, so ``init_process_group`` called first
(the usual order) starts the runtime itself: rank 0 picks a free port, publishes
``MASTER_ADDR:port`` in the c10d store, and every rank connects there (torchrun and mp.spawn
with an ``init_method`` alike). A tpu tensor made before ``init_process_group`` leaves the XLA
transport unavailable: on a TPU or GPU that is an error saying to call ``init_process_group``
first; on CPU the group falls back to the host transport with a one-time warning.

The runtime starts only where the XLA transport may be used: the platform asked for, or a TPU
or GPU attached (an installed libtpu alone is not one: the tpu-aot extra installs it to compile
for TPUs on CPU machines, where the groups use the host transport).

A rank that dies (SIGKILL, a crash) inside an XLA collective makes the others' collective fail
with a Python error by their next read of its result (naming the lost rank: ``peers``); the
runtime is started recoverable, so the survivors go on and exit cleanly instead of being
aborted by JAX's coordination service. Recoverable, it no longer orders the ranks' exits, so
this module does (``_shut_down_in_order``): rank 0, whose process hosts the service, stops it
last. (Rank 0's own death still ends the others through JAX's service.)
"""

from __future__ import annotations

import atexit
import contextlib
import dataclasses
import datetime
import importlib.util
import os
import socket
import time
import warnings

import jax
import torch.distributed as dist
from jax._src import hardware_utils, xla_bridge

from torchtpu import settings
from torchtpu.distributed import peers
from torchtpu.runtime import environment, platform

TRANSPORTS = ("xla", "host")
_ACCELERATORS = ("tpu", "gpu")
# Why the XLA transport could not start in this process (None: it did start, or was not asked).
_unavailable: list[str | None] = [None]
_warned = [False]
# What the ordered shutdown at exit needs, once this process started JAX's runtime.
_at_exit: dict = {}


@dataclasses.dataclass(frozen=True)
class Transport:
    """``pg_options`` for a tpu_dist group: ``Transport("xla")`` or ``Transport("host")``."""

    name: str

    def __post_init__(self) -> None:
        _check(self.name, "Transport")


def _check(name: str, where: str) -> str:
    if name not in TRANSPORTS:
        raise ValueError(f"torchtpu.config: {where}={name!r} is not one of xla, host (or unset: "
                         f"xla on TPU and GPU, host on CPU)")
    return name


def forced(backend_options=None) -> str | None:
    """The transport the user asked for (pg_options first, then the environment), else None."""
    if isinstance(backend_options, Transport):
        return backend_options.name
    return settings.DIST_TRANSPORT.get()


def _installed(names: tuple[str, ...]) -> bool:
    for name in names:
        try:
            if importlib.util.find_spec(name) is not None:
                return True
        except (ImportError, ValueError):
            continue
    return False


def _accelerator_expected() -> bool:
    """Whether this process will likely run on a TPU or GPU, judged without starting JAX's
    backend: TORCHTPU_PLATFORM, else JAX_PLATFORMS, else a TPU or GPU attached whose PJRT plugin
    is installed. An installed plugin alone is no sign: the tpu-aot extra installs libtpu on
    machines without a TPU, to compile for one (issue 37: starting JAX's runtime there for the
    host transport's groups, which never use it, aborted a rank at exit)."""
    wanted = settings.PLATFORM.get()
    if wanted:
        return wanted in _ACCELERATORS
    jax_platforms = os.environ.get("JAX_PLATFORMS", "").strip().lower()
    if jax_platforms:
        return any(name in jax_platforms for name in ("tpu", "cuda", "rocm", "gpu"))
    if _installed(("libtpu",)) and environment.tpu_attached():
        return True
    gpu = ("jax_cuda12_plugin", "jax_cuda13_plugin", "jax_rocm7_plugin",
           "jax_plugins.xla_cuda12", "jax_plugins.xla_cuda13")
    return _installed(gpu) and (hardware_utils.has_visible_nvidia_gpu()
                                or hardware_utils.num_available_amd_gpus(stop_at=1) > 0)


def _coordinator_host(store: dist.Store) -> str:
    """The address other hosts reach rank 0 at: torchrun's MASTER_ADDR, else the TCP store's
    host (mp.spawn with a tcp:// init_method), else this host's name."""
    if os.environ.get("MASTER_ADDR"):
        return os.environ["MASTER_ADDR"]
    while isinstance(store, dist.PrefixStore):
        store = store.underlying_store
    if isinstance(store, dist.TCPStore) and store.host:
        return store.host
    return socket.gethostname()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def start(store: dist.Store, rank: int, size: int, timeout: datetime.timedelta,
          local_index: int, backend_options=None) -> None:
    """At the default group's creation: start JAX's multi-process runtime if the XLA transport
    may be used and JAX's backend has not started; else record why not."""
    wanted = forced(backend_options)
    if wanted == "host" or (wanted is None and not _accelerator_expected()):
        return
    if jax.distributed.is_initialized() or size == 1:
        return
    if xla_bridge.backends_are_initialized():
        _unavailable[0] = (
            "JAX's backend started before init_process_group (a tpu tensor was created, or JAX "
            "was used, first), and JAX's multi-process runtime can only start before it")
        return
    key = "tpu_dist/jax_coordinator"
    if rank == 0:
        store.set(key, f"{_coordinator_host(store)}:{_free_port()}")
    address = store.get(key).decode()
    # XLA:CPU's cross-process collectives: gloo over TCP (JAX's default, named to pin it).
    jax.config.update("jax_cpu_collectives_implementation", "gloo")
    # A rank that dies must not take the others with it: JAX's coordination service otherwise
    # propagates the death (a missed heartbeat, the shutdown barrier at exit) as a fatal error
    # that aborts every live process, which has already seen the failed collective's error and
    # may want to checkpoint, report or exit cleanly (issue 24).
    if "jax_enable_recoverability" in jax.config.values:
        jax.config.update("jax_enable_recoverability", True)
    seconds = max(1, int(timeout.total_seconds()))  # the group's timeout bounds both waits
    jax.distributed.initialize(
        address, size, rank, local_device_ids=[local_index],
        initialization_timeout=seconds, shutdown_timeout_seconds=seconds)
    _at_exit.update(store=store, rank=rank, size=size, seconds=seconds)
    atexit.register(_shut_down_in_order)  # after JAX's own atexit: runs before it


def _shut_down_in_order() -> None:
    """At exit: JAX's runtime shut down on every rank, rank 0 (which hosts its coordination
    service) last.

    Started recoverable, JAX's shutdown no longer waits at a barrier for the other ranks, so
    rank 0 could stop the service while another rank still ran; that rank's client then found
    the service gone and JAX aborted it ("Terminating process because the JAX distributed
    service detected fatal errors", issue 37). So every other rank disconnects first and says
    so in the c10d store, and rank 0 waits for them (a rank whose process exited, or the
    group's timeout, ends the wait) before it stops the service."""
    state = dict(_at_exit)
    _at_exit.clear()
    if not state or not jax.distributed.is_initialized():
        return
    store, rank = state["store"], state["rank"]
    key = "tpu_dist/jax_runtime_down/{}"
    if rank != 0:
        jax.distributed.shutdown()
        with contextlib.suppress(RuntimeError):  # the store's host is gone: nobody waits
            store.set(key.format(rank), "")
        return
    waiting = list(range(1, state["size"]))
    deadline = time.monotonic() + state["seconds"]
    while waiting and time.monotonic() < deadline:
        try:
            gone = set(peers.exited(waiting))
            waiting = [r for r in waiting if r not in gone and not store.check([key.format(r)])]
        except RuntimeError:
            break
        if waiting:
            time.sleep(0.05)
    jax.distributed.shutdown()


def choose(size: int, backend_options=None) -> str:
    """The transport of a new group: ``"xla"`` or ``"host"`` (see the module docstring)."""
    wanted = forced(backend_options)
    name = platform.platform()
    if wanted == "host" or (wanted is None and name not in _ACCELERATORS):
        return "host"
    if size == 1 or jax.distributed.is_initialized():
        return "xla"
    reason = _unavailable[0] or (
        "JAX's multi-process runtime is not running (it starts when init_process_group runs "
        "with the XLA transport wanted: set TORCHTPU_DIST_TRANSPORT=xla or "
        "TORCHTPU_PLATFORM)")
    if name in _ACCELERATORS:
        raise RuntimeError(
            f"torchtpu.distributed: tpu_dist cannot use XLA collectives on {name}: {reason}. "
            "Call dist.init_process_group before creating any tpu tensor (or set "
            f"{settings.DIST_TRANSPORT.name}=host to move collectives through host memory instead)")
    if not _warned[0]:
        _warned[0] = True
        warnings.warn(f"torchtpu.distributed: tpu_dist uses the host transport (gloo), not XLA "
                      f"collectives: {reason}. Call dist.init_process_group before creating "
                      "any tpu tensor", stacklevel=2)
    return "host"
