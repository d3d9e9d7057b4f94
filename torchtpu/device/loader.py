"""Feeding data to the device: ``DeviceLoader`` prefetch and DataLoader ``pin_memory``.

``DeviceLoader(loader)`` moves each batch to "tpu" on a background thread, ``prefetch`` batches
ahead, so collation and the host-to-device copy overlap the model's work. ``pin_memory=True`` in a
DataLoader (Hugging Face's Trainer sets it by default) is accepted and leaves batches as they are:
PyTorch has no way for a Python backend to provide pinned memory, and JAX stages host copies
itself.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

_DONE = object()


def to_device(batch: Any, device: torch.device | str = "tpu") -> Any:
    """batch (any nesting of lists, tuples, dicts) with every tensor moved to device."""
    return tree_map(lambda x: x.to(device) if isinstance(x, torch.Tensor) else x, batch)


class DeviceLoader:
    """Iterate over loader with each batch already on device, prefetching on a thread."""

    def __init__(self, loader: Iterable, device: torch.device | str = "tpu",
                 prefetch: int = 2) -> None:
        if prefetch < 1:
            raise ValueError(f"torchtpu.argument: prefetch must be at least 1, got {prefetch}")
        self.loader, self.device, self.prefetch = loader, torch.device(device), prefetch

    def __len__(self) -> int:
        return len(self.loader)

    def __iter__(self) -> Iterator:
        slots: queue.Queue = queue.Queue(maxsize=self.prefetch)
        stop = threading.Event()

        def produce() -> None:
            try:
                for batch in self.loader:
                    if stop.is_set():
                        return
                    slots.put(to_device(batch, self.device))
                slots.put(_DONE)
            except BaseException as e:  # handed to the consumer, raised at its next batch
                slots.put(e)

        worker = threading.Thread(target=produce, name="torchtpu-prefetch", daemon=True)
        worker.start()
        try:
            while True:
                item = slots.get()
                if item is _DONE:
                    return
                if isinstance(item, BaseException):
                    raise item
                yield item
        finally:
            stop.set()
            while worker.is_alive():  # unblock a producer waiting on a full queue
                try:
                    slots.get_nowait()
                except queue.Empty:
                    worker.join(timeout=0.01)


def install_pin_memory() -> None:
    """Let DataLoader(pin_memory=True) run when "tpu" is the accelerator."""
    from torch.utils.data._utils import pin_memory as pin_module

    original = pin_module.pin_memory

    def pin_memory(data, device=None):
        if device is None or torch.device(device).type == "tpu":
            return data
        return original(data, device)

    pin_module.pin_memory = pin_memory
