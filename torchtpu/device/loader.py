"""Feeding data to the device: ``DeviceLoader`` prefetch and DataLoader ``pin_memory``.

``DeviceLoader(loader)`` moves each batch to "tpu" on a background thread, ``prefetch`` batches
ahead, so collation and the host-to-device copy overlap the model's work. ``pin_memory=True`` in a
DataLoader (Hugging Face's Trainer sets it by default) is accepted and leaves batches as they are:
JAX stages host copies itself. Prefetch threads still running at exit are stopped before JAX's
clean-up.
"""

from __future__ import annotations

import atexit
import queue
import threading
import time
from collections.abc import Iterable, Iterator
from typing import Any

import torch
from torch.utils._pytree import tree_map

_DONE = object()
EXIT_WAIT_SECONDS = 10.0
_running: set = set()  # (stop, worker, slots) of every prefetch under way


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
        running = (stop, worker, slots)
        _running.add(running)
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
            _running.discard(running)
            _stop(stop, worker, slots, deadline=None)


def _stop(stop: threading.Event, worker: threading.Thread, slots: queue.Queue,
          deadline: float | None) -> None:
    stop.set()
    while worker.is_alive() and (deadline is None or time.monotonic() < deadline):
        try:  # unblock a producer waiting on a full queue
            slots.get_nowait()
        except queue.Empty:
            worker.join(timeout=0.01)


def _stop_all() -> None:
    # A prefetch thread still copying to the device when the interpreter tears JAX down aborts
    # the process; atexit runs this (registered after jax's clean-up, so before it) first.
    deadline = time.monotonic() + EXIT_WAIT_SECONDS
    for running in list(_running):
        _stop(*running, deadline=deadline)


atexit.register(_stop_all)


def install_pin_memory() -> None:
    """Let DataLoader(pin_memory=True) run when "tpu" is the accelerator.

    Where ``device/pinned.py`` answers PrivateUse1's pinned-memory hooks, DataLoader pins for
    real and nothing is patched; elsewhere pinning would raise, so its batches pass unpinned
    (PJRT copies from any host buffer: pinning only makes the copy cheaper on a GPU).
    """
    from torch.utils.data._utils import pin_memory as pin_module

    from torchtpu.device import pinned

    if pinned.status()[0]:
        return

    original = pin_module.pin_memory

    def pin_memory(data, device=None):
        if device is None or torch.device(device).type == "tpu":
            return data
        return original(data, device)

    pin_module.pin_memory = pin_memory
