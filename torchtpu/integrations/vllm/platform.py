"""The vLLM ``Platform`` for device "tpu": what vLLM asks a device about, answered for torchtpu.

vLLM's built-in TPU platform is tied to libtpu and its CPU platform to compiled ``_C`` kernels
that read raw pointers (a "tpu" tensor's address is never dereferenceable), so this is an
out-of-tree platform (``PlatformEnum.OOT``) whose worker builds on vLLM's GPU worker, the way
vLLM's XPU platform does. Inductor and vLLM's CUDA graph wrappers are off: the model runner
pads decode steps and captures their forwards with ``torch.tpu.graph`` itself (``graphs.py``).
"""

from __future__ import annotations

import os

import torch
from vllm.logger import init_logger
from vllm.platforms.interface import Platform, PlatformEnum
from vllm.v1.attention.backends.registry import register_backend

from torchtpu import settings

# vLLM's CPU platform's KV-cache setting (GiB), honoured where device memory is host memory
KV_SPACE_ENV = "VLLM_CPU_KVCACHE_SPACE"
# with neither it nor kv_cache_memory_bytes: this much, or half the memory free, if less
DEFAULT_HOST_KV_BYTES = 4 << 30
# additional_config's key: the KV cache's bytes were torchtpu's default, so the worker may cut
# them to what the engine can hold (``fit_host_kv_cache``)
HOST_KV_FIT = "torchtpu_host_kv_fit"
WORKER = "torchtpu.integrations.vllm.worker.TpuWorker"
ATTENTION = "torchtpu.integrations.vllm.attention.TpuAttentionBackend"
COMMUNICATOR = "torchtpu.integrations.vllm.communicator.TpuCommunicator"
log = init_logger(__name__)
# vLLM names every backend by a member of its enum; an out-of-tree one adds its own
register_backend("TORCHTPU_ATTN", ATTENTION)


class TpuPlatform(Platform):
    _enum = PlatformEnum.OOT
    device_name: str = "tpu"
    device_type: str = "tpu"
    dispatch_key: str = "PrivateUse1"
    ray_device_key: str = "TPU"
    # vLLM's device groups are torchtpu's process groups (communicator.py); vLLM makes a gloo
    # group beside each for host-side coordination
    dist_backend: str = "tpu_dist"
    device_control_env_var: str = settings.VISIBLE_DEVICES.name
    simple_compile_backend: str = "eager"
    supported_quantization: list[str] = []

    @classmethod
    def get_device_name(cls, device_id: int = 0) -> str:
        return torch.tpu.get_device_name(device_id)

    @classmethod
    def get_device_total_memory(cls, device_id: int = 0) -> int:
        return torch.tpu.get_device_properties(device_id).total_memory

    @classmethod
    def set_device(cls, device: torch.device) -> None:
        torch.tpu.set_device(device)

    @classmethod
    def manual_seed_all(cls, seed: int) -> None:
        torch.tpu.manual_seed_all(seed)

    @classmethod
    def inference_mode(cls):
        # inference tensors cannot be written in place outside inference mode; vLLM's GPU
        # runner does so with its persistent buffers, as XPU found.
        return torch.no_grad()

    @classmethod
    def check_if_supports_dtype(cls, dtype: torch.dtype) -> None:
        if dtype not in (torch.float32, torch.bfloat16, torch.float16):
            raise ValueError(f"torchtpu.dtype: vLLM on device 'tpu' runs float32, bfloat16 or "
                             f"float16, not {dtype}")

    @classmethod
    def get_current_memory_usage(cls, device: torch.types.Device | None = None) -> float:
        return float(torch.tpu.memory_allocated(device))

    @classmethod
    def is_pin_memory_available(cls) -> bool:
        return False

    @classmethod
    def get_device_communicator_cls(cls) -> str:
        return COMMUNICATOR

    @classmethod
    def check_runner_kv_caches_multi_layer(cls) -> None:
        # a draft model's layers join the GPU runner's list of layer caches with the target's
        # layer indices; the tpu runner reads caches by layer name only, as CUDA's does
        return

    @classmethod
    def support_static_graph_mode(cls) -> bool:
        return False

    @classmethod
    def import_kernels(cls) -> None:
        # The base Platform imports vllm._C, vllm-cpu's AVX-512/BF16 build, unconditionally: on
        # an AVX2-only CPU that kills the process (SIGILL). The CPU platform loads the build the
        # CPU's features allow (_C, _C_AVX512 or _C_AVX2); the host-side kernels are that build's.
        from vllm.platforms.cpu import CpuPlatform

        CpuPlatform.import_kernels()

    @classmethod
    def register_triton_kernel_overrides(cls) -> None:
        # vLLM calls this in each worker before it builds the model: the quantized linear
        # layers' kernels are chosen then
        from torchtpu.integrations.vllm import draft, kernels, quant

        kernels.register()
        quant.register()
        draft.register()

    @classmethod
    def get_attn_backend_cls(cls, selected_backend, attn_selector_config,
                             num_heads: int | None = None) -> str:
        if attn_selector_config.use_mla or attn_selector_config.use_sparse:
            raise NotImplementedError(
                "torchtpu.unsupported: vLLM on device 'tpu' has no MLA or sparse attention yet"
            )
        return ATTENTION

    @classmethod
    def check_and_update_config(cls, vllm_config) -> None:
        from vllm.config import CUDAGraphMode
        from vllm.config.compilation import CompilationMode

        from torchtpu.integrations.vllm import preflight
        from torchtpu.integrations.vllm.support import configure_kv_transfer, refuse_unsupported

        refuse_unsupported(vllm_config)
        preflight.check_tokenizer(getattr(vllm_config, "model_config", None))
        configure_kv_transfer(vllm_config)
        compilation = vllm_config.compilation_config
        compilation.mode = CompilationMode.NONE
        compilation.cudagraph_mode = CUDAGraphMode.NONE
        if compilation.compile_sizes is None:
            compilation.compile_sizes = []
        if _size_host_kv_cache(vllm_config.cache_config) and isinstance(
                getattr(vllm_config, "additional_config", None), dict):
            vllm_config.additional_config[HOST_KV_FIT] = True
        # Async scheduling prepares a step before the last one's tokens reach the host; the
        # host-prepared program then reads them on the device (host_steps.step_input_ids).
        # Where steps cannot be prepared on the host, vLLM's device-side preparation would run
        # op by op around every step: async is then off, and the log says why.
        off = _async_off(vllm_config)
        if off and vllm_config.scheduler_config.async_scheduling:
            log.info("torchtpu: vLLM's async scheduling is off on device 'tpu': %s", off)
            vllm_config.scheduler_config.async_scheduling = False
        parallel = vllm_config.parallel_config
        if parallel.worker_cls == "auto":
            parallel.worker_cls = WORKER
        # a forked worker would inherit the parent's PJRT client and its threads
        os.environ.setdefault("VLLM_WORKER_MULTIPROC_METHOD", "spawn")


def _async_off(vllm_config) -> str | None:
    """Why this engine's steps cannot be async-scheduled on "tpu" (None: they can): the user
    turned it off, or a feature whose steps are not prepared on the host
    (``HostSteps._steps_on_host``, known from the configuration)."""
    if not settings.VLLM_ASYNC.get():
        return f"{settings.VLLM_ASYNC.name}=0"
    model, parallel = getattr(vllm_config, "model_config", None), vllm_config.parallel_config
    features = {
        "speculative decoding": getattr(vllm_config, "speculative_config", None) is not None,
        "LoRA": bool(getattr(vllm_config, "lora_config", None)),
        "enforce_eager": bool(getattr(model, "enforce_eager", False)),
        "tensor parallelism": parallel.tensor_parallel_size > 1,
        "pipeline parallelism": parallel.pipeline_parallel_size > 1,
        "decode context parallelism": getattr(parallel, "decode_context_parallel_size", 1) > 1,
        "a KV connector": getattr(vllm_config, "kv_transfer_config", None) is not None,
        "a multimodal model": bool(getattr(model, "is_multimodal_model", False)),
        "prompt embeddings": bool(getattr(model, "enable_prompt_embeds", False)),
        "an encoder-decoder model": bool(getattr(model, "is_encoder_decoder", False)),
    }
    named = [name for name, on in features.items() if on]
    return f"{', '.join(named)}: steps prepared on the device" if named else None


def _size_host_kv_cache(cache_config) -> bool:
    """On XLA:CPU, size the KV cache in bytes as vLLM's CPU platform does, not as a GPU share;
    True where the size is torchtpu's default (the user chose none).

    There device memory is host memory: vLLM's default, 92% of it free at start-up, fails on any
    host with other processes running, and would be far more than a KV cache needs. A user's
    ``kv_cache_memory_bytes`` is kept; else ``VLLM_CPU_KVCACHE_SPACE`` (GiB), else the smaller of
    4 GiB and half the memory free (which the worker then cuts to what the engine can hold:
    ``fit_host_kv_cache``). ``gpu_memory_utilization`` then only has to pass vLLM's
    start-up check of free memory, so it is lowered to the KV cache's share (for a user's bytes
    too: on a busy host 92% of the memory is never free).
    """
    from torchtpu.runtime import platform

    if platform.platform() != "cpu":
        return False
    import psutil

    memory = psutil.virtual_memory()
    space = os.environ.get(KV_SPACE_ENV, "").strip()
    default = False
    if cache_config.kv_cache_memory_bytes is not None:
        kv_bytes = cache_config.kv_cache_memory_bytes
    elif space:
        try:
            kv_bytes = int(float(space) * (1 << 30))
        except ValueError:
            raise ValueError(f"torchtpu.argument: {KV_SPACE_ENV}={space!r} is not a number of "
                             "GiB") from None
    else:
        kv_bytes = min(DEFAULT_HOST_KV_BYTES, memory.available // 2)
        default = True
    cache_config.kv_cache_memory_bytes = kv_bytes
    cache_config.gpu_memory_utilization = min(cache_config.gpu_memory_utilization,
                                              kv_bytes / memory.total)
    return default


def fit_host_kv_cache(vllm_config, available: int, specs: dict) -> int:
    """The KV cache's bytes, cut to what the engine can hold at once where torchtpu chose them.

    On XLA:CPU a step that writes the cache costs time in the whole cache's size (its scatter
    copies the buffer: bench/RESULTS.md, "rlserve2"), so a default of gigabytes for an engine of
    a few short sequences slows every step; ``max_num_seqs`` requests at ``max_model_len`` each
    (``specs``: the model's layers' KV cache specs), plus the block vLLM keeps unused, is all the
    scheduler can use at once (only prefix caching would keep more). Every layer is counted at
    the largest layer's need, so that models mixing layer kinds (vLLM pools their blocks) get
    no less. A size the user chose (``kv_cache_memory_bytes``, ``VLLM_CPU_KVCACHE_SPACE``) is
    kept.
    """
    extra = getattr(vllm_config, "additional_config", None)
    if not specs or not isinstance(extra, dict) or not extra.get(HOST_KV_FIT):
        return available
    layer = max(spec.max_memory_usage_bytes(vllm_config) + spec.page_size_bytes
                for spec in specs.values())
    return min(available, len(specs) * vllm_config.scheduler_config.max_num_seqs * layer)
