"""SGLang's ``SRTPlatform`` for device "tpu": what SGLang asks a device, answered for torchtpu.

SGLang's CPU platform runs sgl-kernel's C++ CPU ops (AVX-512/AMX, built from source) and its CUDA
platform Triton and FlashInfer kernels; none of them can read a "tpu" tensor. The torch-native
attention backend and sampler are plain ATen, so they run on device "tpu" unchanged, and this
platform points SGLang at them. Graph capture is off (``capabilities``): SGLang's CUDA-graph
runner is CUDA-keyed.

SGLang on device "tpu" is one process (``refuse_unservable``), so its process groups are groups of
one, which need no transport: ``tpu_solo`` groups over a file-store rendezvous, where SGLang would
open a TCP store and gloo (a sandboxed TPU host refuses every internet socket; ``solo_groups``).
"""

from __future__ import annotations

import atexit
import logging
import os
import shutil
import tempfile

import psutil
import torch
from sglang.srt.platforms.device_mixin import DeviceMixin, PlatformEnum
from sglang.srt.platforms.interface import PlatformCapabilities, SRTPlatform

from torchtpu.distributed import solo
from torchtpu.runtime import platform as pjrt

log = logging.getLogger(__name__)


# with no --max-total-tokens on a host: a KV cache of this many bytes, or half the memory free,
# if less (vLLM's platform sizes its host KV cache the same way, vllm/platform.py) ...
DEFAULT_HOST_KV_BYTES = 4 << 30
# ... and of at most this many tokens: each step's KV write is an eager scatter into the pool,
# a new JAX array, so it costs in proportion to the pool (tiny Llama, one request of 8 tokens:
# ~15 s with 262144 tokens, 1-4 s with 4096; bench/RESULTS.md, sglang, session 16)
DEFAULT_HOST_KV_TOKENS = 16384


def _host_memory() -> bool:
    """On XLA:CPU device memory is host memory, shared with every other process."""
    return pjrt.platform() == "cpu"


# what the platform serves: anything else is refused at start-up by name (refuse_unservable)
ATTENTION_BACKENDS = ("torch_native",)
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16")


def refuse_unservable(server_args) -> None:
    """Raise, before any process starts, for a setting SGLang would otherwise take to a CUDA or
    sgl-kernel path deep inside the scheduler (or serve wrongly), saying what works instead."""
    for field in ("attention_backend", "prefill_attention_backend", "decode_attention_backend"):
        backend = getattr(server_args, field, None)
        if backend is not None and backend not in ATTENTION_BACKENDS:
            raise ValueError(f"torchtpu.unsupported: --{field.replace('_', '-')} {backend} does "
                             f"not run on device tpu; use {' or '.join(ATTENTION_BACKENDS)}")
    for field in ("tp_size", "pp_size", "dp_size"):
        if (getattr(server_args, field, 1) or 1) > 1:
            raise ValueError(f"torchtpu.unsupported: --{field.replace('_', '-')} "
                             f"{getattr(server_args, field)}: SGLang on device tpu runs one "
                             "process on one device; start one server per device instead")
    if getattr(server_args, "speculative_algorithm", None):
        raise ValueError(f"torchtpu.unsupported: --speculative-algorithm "
                         f"{server_args.speculative_algorithm} is not served on device tpu; "
                         "leave it unset")
    if getattr(server_args, "quantization", None):
        raise ValueError(f"torchtpu.unsupported: --quantization {server_args.quantization} is "
                         "not served on device tpu; serve unquantized weights")
    if getattr(server_args, "kv_cache_dtype", "auto") not in KV_CACHE_DTYPES:
        raise ValueError(f"torchtpu.unsupported: --kv-cache-dtype {server_args.kv_cache_dtype} "
                         f"is not served on device tpu; use one of {', '.join(KV_CACHE_DTYPES)}")


def kv_bytes_per_token(config, dtype: str) -> int:
    """K and V of one token in every layer of the Hugging Face ``config`` (4-byte elements
    unless ``dtype`` names a 2-byte one: "auto" may resolve to float32)."""
    text = getattr(config, "text_config", None) or config
    heads = text.num_attention_heads
    kv_heads = getattr(text, "num_key_value_heads", None) or heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    size = 2 if dtype in ("float16", "half", "bfloat16") else 4
    return 2 * text.num_hidden_layers * kv_heads * head_dim * size


def host_kv_tokens(server_args, available: int | None = None) -> int:
    """``--max-total-tokens`` for XLA:CPU. SGLang's default sizes the KV pool as a fraction of the
    device's memory (``mem_fraction_static``); on a host that is most of the RAM free, allocated
    at start-up (11 GiB for the tiny test Llama on a 24 GiB box, where the process was then
    killed), so the pool gets ``min(DEFAULT_HOST_KV_BYTES, available / 2)`` instead, and at most
    ``DEFAULT_HOST_KV_TOKENS`` tokens."""
    from transformers import AutoConfig

    config = AutoConfig.from_pretrained(server_args.model_path,
                                        trust_remote_code=server_args.trust_remote_code)
    if available is None:
        available = psutil.virtual_memory().available
    budget = min(DEFAULT_HOST_KV_BYTES, available // 2)
    dtype = server_args.kv_cache_dtype
    if dtype == "auto":
        dtype = server_args.dtype
    return max(1, min(DEFAULT_HOST_KV_TOKENS, budget // kv_bytes_per_token(config, dtype)))


# SGLang's own override of its rendezvous (sglang/srt/distributed/bootstrap.py), read in the
# scheduler process when it makes its groups
INIT_METHOD_ENV = "SGLANG_DISTRIBUTED_INIT_METHOD_OVERRIDE"


def solo_groups() -> None:
    """Make the scheduler process's groups (it is alone: ``refuse_unservable``) ``tpu_solo``
    groups over a file store. SGLang's world and device groups take the platform's backend
    (``get_torch_distributed_backend_str``); its host groups, one beside each, name gloo, which
    opens a TCP device even for a group of one, so ``new_group`` maps gloo to ``tpu_solo`` for a
    world of one process, in this process only (SGLang has no hook for that group's backend).

    Not reached from here: without ``nccl_port`` SGLang's engine process picks one by binding a
    TCP socket (``PortArgs.init_new``) before any platform hook runs, and reads only the
    operator's value; where internet sockets are refused pass ``nccl_port`` (any number: the
    rendezvous is this file store and binds no port)."""
    import torch.distributed as dist

    solo.register()
    if INIT_METHOD_ENV not in os.environ:
        folder = tempfile.mkdtemp(prefix="torchtpu-sglang-")
        atexit.register(shutil.rmtree, folder, ignore_errors=True)
        os.environ[INIT_METHOD_ENV] = f"file://{folder}/store"
    if getattr(dist.new_group, "_torchtpu_solo", False):
        return
    new_group, monitored_barrier = dist.new_group, dist.monitored_barrier

    def solo_if_gloo(*args, backend=None, **kwargs):
        if backend == "gloo" and dist.is_initialized() and dist.get_world_size() == 1:
            backend = solo.BACKEND
        return new_group(*args, backend=backend, **kwargs)

    def solo_barrier(group=None, *args, **kwargs):
        # c10d serves it for gloo groups only; SGLang's after loading the weights (on its host
        # group): one process has no one to wait for
        if dist.get_backend(group) == solo.BACKEND:
            return None
        return monitored_barrier(group, *args, **kwargs)

    solo_if_gloo._torchtpu_solo = True
    dist.new_group, dist.monitored_barrier = solo_if_gloo, solo_barrier


class TpuDeviceMixin(DeviceMixin):
    _enum = PlatformEnum.OOT
    device_name = "tpu"
    device_type = "tpu"

    def get_device_total_memory(self, device_id: int = 0) -> int:
        if _host_memory():
            return int(psutil.virtual_memory().total)
        return int(torch.tpu.get_device_properties(device_id).total_memory)

    def get_current_memory_usage(self, device: torch.device | None = None) -> float:
        # SGLang reads free = total - this: on a host, what other processes hold is not free
        if _host_memory():
            vm = psutil.virtual_memory()
            return float(vm.total - vm.available)
        return float(torch.tpu.memory_allocated(device))

    def get_available_memory(self, device_id: int = 0) -> tuple[int, int]:
        total = self.get_device_total_memory(device_id)
        return total - int(self.get_current_memory_usage()), total

    def get_device(self, device_id: int = 0) -> torch.device:
        return torch.device("tpu", device_id)

    def set_device(self, device: torch.device) -> None:
        torch.tpu.set_device(device)

    def get_device_name(self, device_id: int = 0) -> str:
        return torch.tpu.get_device_name(device_id)

    def get_device_uuid(self, device_id: int = 0) -> str:
        return f"tpu:{device_id}:{pjrt.platform()}"

    def get_device_capability(self, device_id: int = 0) -> None:
        return None

    def synchronize(self) -> None:
        torch.tpu.synchronize()

    def get_torch_distributed_backend_str(self) -> str:
        """The scheduler asks this right before it resolves its rendezvous and makes its groups
        (sglang/srt/distributed/bootstrap.py), the one platform call there: so it sets them up."""
        solo_groups()
        return solo.BACKEND


class TpuSRTPlatform(TpuDeviceMixin, SRTPlatform):
    capabilities = PlatformCapabilities()

    def get_default_attention_backend(self) -> str:
        return "torch_native"

    def apply_server_args_defaults(self, server_args) -> None:
        refuse_unservable(server_args)
        if server_args.attention_backend is None:
            server_args.attention_backend = "torch_native"
        if server_args.sampling_backend is None:
            server_args.sampling_backend = "pytorch"
        if _host_memory() and server_args.max_total_tokens is None:
            server_args.max_total_tokens = host_kv_tokens(server_args)

    def get_compile_backend(self, mode: str | None = None) -> str:
        return "tpu"  # the few functions SGLang wraps in torch.compile (penalties, sampling)

    def post_load_model(self, model: torch.nn.Module) -> None:
        """Refuse a model SGLang's loader left anywhere but on one tpu device: a parameter on
        the host would run its layer on the CPU and still give the right tokens."""
        places = {t.device for t in (*model.parameters(), *model.buffers())}
        if len(places) != 1 or next(iter(places)).type != "tpu":
            raise RuntimeError("torchtpu.device: SGLang loaded the model onto "
                               f"{sorted(map(str, places))}, not one tpu device")
        log.info("torchtpu: SGLang's model is on %s", next(iter(places)))
