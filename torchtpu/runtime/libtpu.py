"""libtpu for TPU targets: the version JAX pins, whether a TPU is attached, and libtpu's settings
for compiling without one.

Kept apart from the target and its compiles (``targets/tpu_target.py``) because the platform
(``jax_settings.py``) asks whether a TPU is attached (``environment.tpu_attached``) at import,
before anything loads libtpu: with libtpu
installed and no TPU here, JAX's TPU client is left out and libtpu, when a target loads it, gets
neutral settings (no lock file taken, no TPU VM variables to miss), so it prints nothing. Those
settings are environment variables that libtpu reads as it starts; they are set only while it
starts, so no child process inherits them (a child JAX program would think it runs on a pod).
"""

from __future__ import annotations

import contextlib
import importlib.metadata
import os
import re
from collections.abc import Iterator

import jax

from torchtpu.runtime import environment


class TargetError(RuntimeError):
    """The target cannot be used: unknown name, libtpu missing or mismatched, too few chips."""


def _error(text: str) -> TargetError:
    return TargetError(f"torchtpu.tpu: {text}")


def required_libtpu() -> str | None:
    """The libtpu version this JAX pins in its ``tpu`` extra ("0.0.42"), if it says."""
    for req in importlib.metadata.requires("jax") or ():
        m = re.match(r"libtpu\s*==\s*([\w.]+?)(\.\*)?\s*;.*extra\s*==\s*['\"]tpu['\"]", req)
        if m:
            return m.group(1)
    return None


def check_libtpu() -> str:
    """The installed libtpu version, or a ``TargetError`` naming the one to install."""
    wanted = required_libtpu()
    pin = f"libtpu=={wanted}" if wanted else "libtpu"
    try:
        have = importlib.metadata.version("libtpu")
    except importlib.metadata.PackageNotFoundError:
        raise _error(f"a TPU target needs libtpu, which is not installed: pip install "
                     f"'{pin}' (the one JAX {jax.__version__} pins), or "
                     "pip install -e '.[tpu-aot]'") from None
    if wanted and not (have == wanted or have.startswith(wanted + ".")):
        raise _error(f"libtpu {have} is installed, but JAX {jax.__version__} pins {wanted}: "
                     f"pip install '{pin}'")
    return have


@contextlib.contextmanager
def compile_only_env() -> Iterator[None]:
    """libtpu's settings for compiling without a TPU, in ``os.environ`` only while the block runs
    (libtpu starts inside it); a value the user set is kept. Nothing is set where a TPU is."""
    if environment.tpu_attached():
        yield
        return
    # No chip is opened, so the lock that keeps two processes off one TPU does not apply (without
    # this a second process on the machine fails on /tmp/libtpu_lockfile).
    # Without the others libtpu prints warnings and a "Source Location Trace" error; they
    # describe a one-host slice and are not what the topology name compiles for.
    settings = (("ALLOW_MULTIPLE_LIBTPU_LOAD", "1"), ("TPU_SKIP_MDS_QUERY", "1"),
                ("TPU_ACCELERATOR_TYPE", "v5litepod-4"), ("TPU_WORKER_HOSTNAMES", "localhost"),
                ("TPU_WORKER_ID", "0"))
    before = {name: os.environ.get(name) for name, _ in settings}
    for name, value in settings:
        os.environ.setdefault(name, value)
    try:
        yield
    finally:
        environment.put_back(before)
