"""DataLoader with pin_memory=True, and DeviceLoader prefetching batches to the device."""

import threading

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

import torchtpu
from torchtpu.device import loader, pinned


def _dataset():
    return TensorDataset(torch.arange(40, dtype=torch.float32).reshape(20, 2), torch.arange(20))


def test_pin_memory_dataloader_runs():
    batches = list(DataLoader(_dataset(), batch_size=5, pin_memory=True))
    assert len(batches) == 4
    # Pinned for real where the hooks could be answered, as on CUDA.
    assert batches[0][0].is_pinned() == pinned.status()[0]
    torch.testing.assert_close(batches[1][1], torch.arange(5, 10))


def test_device_loader_prefetches_to_tpu():
    cpu = list(DataLoader(_dataset(), batch_size=6))
    dev = list(torchtpu.DeviceLoader(DataLoader(_dataset(), batch_size=6), prefetch=2))
    assert len(dev) == len(cpu) == 4
    for (x, y), (cx, cy) in zip(dev, cpu):
        assert x.device.type == "tpu" and y.device.type == "tpu"
        torch.testing.assert_close(x.cpu(), cx)
        torch.testing.assert_close(y.cpu(), cy)


def test_device_loader_dict_batches_and_early_stop():
    data = [{"ids": torch.full((2,), i), "name": f"b{i}"} for i in range(10)]
    it = iter(torchtpu.DeviceLoader(data, prefetch=1))
    first = next(it)
    assert first["ids"].device.type == "tpu" and first["name"] == "b0"
    it.close()  # stopping early must not hang on the producer thread


def test_device_loader_reraises_loader_errors():
    def broken():
        yield torch.ones(1)
        raise ValueError("bad sample 1")

    with pytest.raises(ValueError, match="bad sample 1"):
        list(torchtpu.DeviceLoader(broken()))


def test_exit_stops_a_prefetch_still_running():
    # At exit the prefetch thread must be stopped before JAX's clean-up (a thread copying to
    # the device while XLA's state is torn down aborts the process).
    it = iter(loader.DeviceLoader([torch.randn(8) for _ in range(50)], prefetch=1))
    next(it)
    assert any(t.name == "torchtpu-prefetch" for t in threading.enumerate())
    loader._stop_all()
    assert not any(t.name == "torchtpu-prefetch" and t.is_alive() for t in threading.enumerate())
