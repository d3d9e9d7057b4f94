"""``torch_xla.core.xla_model`` (``xm``): devices, ordinals, the step, collectives, saving.

Each name maps onto torchtpu's public API: the device is ``torch.device("tpu", 0)`` (one process
per device), ``mark_step`` is the step boundary of ``_step`` (DeferAndFuse's flush plus step
closures), collectives are ``torch.distributed`` on ``tpu_dist`` (``collectives``), ordinals
come from ``runtime``. PyTorch/XLA's ``xla_device()`` names ``xla:0``; here the device is
``tpu:0``, so a script that tests ``device.type == "xla"`` sees ``"tpu"``.
"""

from __future__ import annotations

import io
import sys
import time
from typing import Any

import torch
import torch.distributed as dist
from torch.utils._pytree import tree_map

from torchtpu.integrations.torch_xla import _missing, _step, runtime
from torchtpu.integrations.torch_xla.core.collectives import (  # noqa: F401 (xm names)
    REDUCE_AND,
    REDUCE_MAX,
    REDUCE_MIN,
    REDUCE_MUL,
    REDUCE_OR,
    REDUCE_SUM,
    all_gather,
    all_reduce,
    reduce_scatter,
)


def xla_device(n: int | None = None, devkind: str | None = None) -> torch.device:
    """This process's device, ``tpu:0``; PyTorch/XLA's other indices belong to other processes."""
    if n not in (None, 0):
        raise IndexError(f"torchtpu.device: xla_device({n}): torchtpu drives one device per "
                         "process, tpu:0; start one process per device (xmp.spawn, "
                         "torch_xla.launch or torchrun)")
    return torch.device("tpu", 0)


def get_xla_supported_devices(devkind: str | None = None, max_devices: int | None = None) -> list:
    return ["tpu:0"]


def xla_device_hw(device) -> str:
    """``"TPU"``, ``"GPU"`` or ``"CPU"``: the platform behind device "tpu"."""
    if torch.device(device).type != "tpu":
        raise ValueError(f"torchtpu.device: xla_device_hw({device!r}) needs the tpu device")
    return runtime.device_type()


def xla_device_kind(device=None) -> str:
    return torch.tpu.get_device_name()


def xla_real_devices(devices=None) -> list[str]:
    return [f"{runtime.device_type()}:0"]


def is_xla_tensor(tensor: torch.Tensor) -> bool:
    return tensor.device.type == "tpu"


def get_ordinal() -> int:
    return runtime.global_ordinal()


def get_local_ordinal() -> int:
    return runtime.local_ordinal()


def xrt_world_size() -> int:
    return runtime.world_size()


def is_master_ordinal(local: bool = True) -> bool:
    """Whether this is ordinal 0 of its host (``local=True``) or of the whole job."""
    return (runtime.local_ordinal() if local else runtime.global_ordinal()) == 0


def master_print(*args: Any, fd=sys.stdout, local: bool = False, flush: bool = False) -> None:
    if is_master_ordinal(local=local):
        print(*args, file=fd, flush=flush)


def mark_step(wait: bool = False, reset_scope: bool = True) -> None:
    """Run what is pending as one program, then the step closures (``torch_xla.sync``)."""
    _step.sync(wait)


def wait_device_ops(devices: list | None = None) -> None:
    _step.wait_device_ops()


def add_step_closure(closure, args: tuple = (), run_async: bool = False) -> None:
    """Run ``closure(*args)`` after the next ``mark_step``, when its tensors are computed."""
    _step.add_closure(closure, args, run_async)


def unlazy(tensors: list[torch.Tensor]) -> None:
    torch.tpu.synchronize(list(tensors))


def _gradients(optimizer: torch.optim.Optimizer) -> list[torch.Tensor]:
    return [p.grad for g in optimizer.param_groups for p in g["params"] if p.grad is not None]


def reduce_gradients(optimizer: torch.optim.Optimizer, groups=None, pin_layout: bool = True,
                     ) -> None:
    """Average the optimizer's gradients over the replicas (in place)."""
    count = runtime.world_size()
    if count > 1:
        all_reduce(REDUCE_SUM, _gradients(optimizer), scale=1.0 / count, groups=groups)


def optimizer_step(optimizer: torch.optim.Optimizer, barrier: bool = False,
                   optimizer_args: dict | None = None, groups=None, pin_layout: bool = True):
    """Average gradients over replicas, ``optimizer.step(**optimizer_args)``, and with barrier a
    ``mark_step``; returns what ``step`` returns."""
    reduce_gradients(optimizer, groups=groups)
    loss = optimizer.step(**(optimizer_args or {}))
    if barrier:
        mark_step()
    return loss


def _to_cpu(data: Any) -> Any:
    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, data)


def save(data: Any, file_or_path, master_only: bool = True, global_master: bool = False) -> None:
    """``torch.save`` of data with its tensors on CPU, by the master ordinal only (by default)."""
    if not master_only or is_master_ordinal(local=not global_master):
        torch.save(_to_cpu(data), file_or_path)


def rendezvous(tag: str, payload: bytes = b"", replicas: list | None = None) -> list[bytes]:
    """Wait for every replica to arrive; each replica's payload, by ordinal."""
    if replicas:
        raise NotImplementedError(_missing.text("torch_xla.core.xla_model.rendezvous(replicas=)"))
    if runtime.world_size() == 1:
        return [payload]
    payloads: list = [None] * runtime.world_size()
    dist.all_gather_object(payloads, (tag, payload))
    tags = {t for t, _ in payloads}
    if len(tags) > 1:
        raise RuntimeError(f"torchtpu.distributed: rendezvous tags differ between replicas: "
                           f"{sorted(tags)}")
    return [p for _, p in payloads]


def mesh_reduce(tag: str, data, reduce_fn):
    """reduce_fn of every replica's data (tensors on CPU)."""
    data = _to_cpu(data)
    if runtime.world_size() == 1:
        return reduce_fn([data])
    buffer = io.BytesIO()
    torch.save(data, buffer)
    copies = [torch.load(io.BytesIO(b), weights_only=False)
              for b in rendezvous(tag, buffer.getvalue())]
    return reduce_fn(copies)


def do_on_ordinals(target, data=(), ordinals=(0,)):
    ordinals = (ordinals,) if isinstance(ordinals, int) else ordinals
    result = target(*_to_cpu(data)) if runtime.global_ordinal() in ordinals else None
    rendezvous("torch_xla.core.xla_model.do_on_ordinals")
    return result


def set_rng_state(seed: int, device=None) -> None:
    torch.tpu.manual_seed(seed)


def get_rng_state(device=None) -> int:
    return torch.tpu.initial_seed()


def get_memory_info(device=None) -> dict:
    free, total = torch.tpu.mem_get_info()
    return {"bytes_used": torch.tpu.memory_allocated(), "bytes_limit": total,
            "peak_bytes_used": torch.tpu.max_memory_allocated()}


class RateTracker:
    """Items per second: ``rate()`` since its previous call (smoothed), ``global_rate()`` in all."""

    def __init__(self, smooth_factor: float | None = None) -> None:
        self.smooth = 0.4 if smooth_factor is None else smooth_factor
        self.start = self.last = time.time()
        self.total = self.pending = 0.0
        self.previous: float | None = None

    def add(self, count: float) -> None:
        self.pending += count

    def rate(self) -> float:
        now = time.time()
        if now <= self.last:
            return 0.0
        current = self.pending / (now - self.last)
        if self.previous is not None:
            current = (1 - self.smooth) * current + self.smooth * self.previous
        self.total += self.pending
        self.pending, self.last, self.previous = 0.0, now, current
        return current

    def global_rate(self) -> float:
        elapsed = time.time() - self.start
        return (self.total + self.pending) / elapsed if elapsed > 0 else 0.0


__getattr__ = _missing.module_getattr(__name__.replace("torchtpu.integrations.", ""))
