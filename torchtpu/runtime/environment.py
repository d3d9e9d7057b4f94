"""The user's environment variables stay as the user set them.

``import jax`` sets ``TF_CPP_MIN_LOG_LEVEL`` (which jaxlib reads once, as it loads),
``TPU_SKIP_MDS_QUERY`` where no TPU is and, with libtpu installed, ``TPU_LIBRARY_PATH`` (a hint JAX
finds its way without). Set in ``os.environ``
they reach every child process: a child JAX program, a compiler, a shell. When torchtpu is
imported before JAX, the two are put back right after JAX's import, on a machine without a TPU.
On a TPU VM JAX's settings stay: libtpu's client reads them when it starts, later.

libtpu's own compile-only settings are ``libtpu.compile_only_env``'s, set only while a TPU
target loads libtpu. Whether a TPU is attached (``tpu_attached``) is read here, from the
variables, the device files and the PCI ids, without libtpu.
"""

from __future__ import annotations

import glob
import os
import sys

from torchtpu.import_hooks import after_import

_SET_BY_JAX = ("TF_CPP_MIN_LOG_LEVEL", "TPU_LIBRARY_PATH", "TPU_SKIP_MDS_QUERY")
_before: dict = {}


def remember() -> None:
    """Note the variables JAX would set, to put them back once it is imported (idempotent)."""
    if "jax" in sys.modules or _before:
        return  # imported before torchtpu: the user's program chose JAX's settings
    _before.update({name: os.environ.get(name) for name in _SET_BY_JAX})
    after_import("jax", _restore)


def _restore() -> None:
    if tpu_attached():
        return
    put_back(_before)


def put_back(values: dict) -> None:
    """Set each variable to its value in values (None: unset)."""
    for name, value in values.items():
        if value is None:
            os.environ.pop(name, None)
        else:
            os.environ[name] = value


def tpu_attached() -> bool:
    """Whether this machine has a TPU (or says it is a TPU VM), checked without libtpu."""
    if os.environ.get("TPU_ACCELERATOR_TYPE") or os.environ.get("JAX_FORCE_TPU_INIT"):
        return True
    # TPU VMs show their chips as /dev/accel* (v4 and older) or VFIO groups (v5e and newer).
    if glob.glob("/dev/accel*") or glob.glob("/dev/vfio/[0-9]*"):
        return True
    # A scan of the PCI ids in /sys, no libtpu; imported here because this module loads at
    # ``import torch``, without JAX.
    from jax._src import hardware_utils

    return hardware_utils.num_available_tpu_chips_and_device_id()[0] > 0
