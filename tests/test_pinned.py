"""Pinned host memory on the tpu device: ``pin_memory=True``, ``Tensor.pin_memory()`` and
``is_pinned()``, answered through PrivateUse1's C++ hooks (torchtpu/device/pinned.py)."""

import gc

import torch

from torchtpu.device import pinned


def test_pin_memory_allocates_pinned_host_memory():
    assert pinned.status() == (True, None)
    t = torch.empty(5, pin_memory=True)
    assert t.device.type == "cpu" and t.is_pinned()
    assert not torch.ones(3).is_pinned()  # ordinary host memory stays unpinned
    u = torch.arange(6.0).pin_memory()
    assert u.is_pinned() and u.pin_memory() is u
    x = u.to("tpu", non_blocking=True)
    live = len(pinned._live)
    del t, u
    gc.collect()
    assert len(pinned._live) == live - 2  # freed memory is no longer pinned
    torch.testing.assert_close(x.cpu(), torch.arange(6.0))
