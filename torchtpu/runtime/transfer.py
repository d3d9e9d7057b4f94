"""Host arrays onto a device, without ``jax.device_put``'s Python layers on every call.

``jax.device_put(numpy_array, device)`` ends in one C++ call, jaxlib's ``batched_device_put``
(abstract value, sharding, the buffer, the device), after ~80 µs of Python (argument pytrees,
sharding checks, dispatch): more than the transfer itself for the small arrays an eager step
moves (a batch's ``.to("tpu")``, the host-padded arrays of ``compile/eager_buckets.py``). ``put``
makes that call itself for a plain NumPy array of a dtype JAX keeps as it is (8.7 µs against
91 µs measured here), the same call with the same arguments, so what it returns (and whether it
may alias the host buffer, as ``device_put`` may on the CPU platform) is the same; anything else,
or a jaxlib whose call has another form, takes ``jax.device_put``.

Both directions of an array's trip through the host are counted here, where they happen
(``host_to_device_bytes`` in ``put``, ``device_to_host_bytes`` in ``fetch``): a layer that reads
a device array on the host (a view read by its strides, a padded value cut) cannot forget to.
A ``.cpu()`` counts its own (``device/kernels.to_numpy``: a copy, never an alias).
"""

from __future__ import annotations

import functools

import jax
import numpy as np
from jax._src import config, core, dtypes
from jax._src.lax import lax as lax_internal
from jax._src.lib import xla_client

from torchtpu import metrics

_fast = [getattr(xla_client, "batched_device_put", None)]


@functools.cache
def _sharding(device) -> jax.sharding.SingleDeviceSharding:
    return jax.sharding.SingleDeviceSharding(device)


def put(host, device) -> jax.Array:
    """host (a NumPy array) as an array on device, its bytes counted."""
    if isinstance(host, (np.ndarray, np.generic)):
        metrics.count("host_to_device_bytes", host.nbytes)
    fast = _fast[0]
    # A dtype JAX keeps as it is (not float64 made float32 with x64 off, which can change).
    if fast is not None and type(host) is np.ndarray \
            and dtypes.canonicalize_dtype(host.dtype) == host.dtype:
        aval = core.ShapedArray(host.shape, host.dtype)
        try:
            return fast(aval, _sharding(device), [host], [device], True)
        except TypeError:  # another jaxlib's form of the call: JAX's own path from now on
            _fast[0] = None
    return jax.device_put(host, device)


def fetch(array) -> np.ndarray:
    """array (a device array, or one already on the host) as a NumPy array, which may alias
    it: its bytes counted as they cross, not when JAX already holds its host copy (a TPU
    array's first read keeps one) or it is a host array."""
    if not isinstance(array, np.ndarray) and getattr(array, "_npy_value", None) is None:
        host = np.asarray(array)
        metrics.count("device_to_host_bytes", host.nbytes)
        return host
    return np.asarray(array)


def put_uncommitted(host: np.ndarray, device, weak: bool = False) -> jax.Array:
    """host (a NumPy array) on device, uncommitted: a program whose other arguments are on
    another device takes it there, as it takes a Python number. ``weak``: weakly typed, as JAX
    types a Python number (``x * 0.5`` of a float32 x stays float32). An explicit transfer, as
    ``jax.device_put``'s: ``jax.transfer_guard("disallow")`` lets it through."""
    fast = _fast[0]
    if fast is not None:
        aval = core.ShapedArray(host.shape, host.dtype, weak_type=weak)
        try:
            with config.explicit_device_put_scope():
                return fast(aval, _sharding(device), [host], [device], False)
        except TypeError:
            _fast[0] = None
    array = jax.device_put(host)
    return lax_internal._convert_element_type(array, weak_type=True) if weak else array
