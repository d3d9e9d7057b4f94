"""``runtime/transfer.put``: host arrays onto the device through jaxlib's one transfer call, the
same arrays ``jax.device_put`` gives, and ``device_put`` itself for what the short path leaves."""

import jax
import numpy as np
import pytest

import torchtpu  # noqa: F401
from torchtpu.runtime import platform, transfer


@pytest.mark.parametrize("dtype", [np.float32, np.int8, np.bool_, np.float16, np.int64])
def test_put_gives_device_puts_array_without_calling_it(monkeypatch, dtype):
    host = (np.arange(24).reshape(2, 3, 4) % 5).astype(dtype)
    device = platform.local_device()
    expected = jax.device_put(host, device)
    monkeypatch.setattr(jax, "device_put", lambda *a, **k: pytest.fail("took device_put"))
    got = transfer.put(host, device)
    assert got.dtype == expected.dtype and got.shape == expected.shape
    assert got.devices() == {device} and got.committed
    np.testing.assert_array_equal(np.asarray(got), host)


def test_what_jax_would_convert_goes_through_device_put():
    device = platform.local_device()
    scalar = np.float32(2.5)  # not an ndarray
    assert transfer.put(scalar, device).dtype == np.float32
    host = np.ones(3, np.float64)
    got = transfer.put(host, device)
    assert got.dtype == jax.device_put(host, device).dtype  # float32 unless x64 is on
