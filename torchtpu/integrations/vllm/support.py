"""Which of vLLM's features the tpu platform serves; the others are refused at start-up.

vLLM asks a platform to check a config before it builds anything (``check_and_update_config``).
A feature the tpu worker cannot run would otherwise fail later and far from its cause (a worker
that never joins, a Triton kernel launched on a "tpu" tensor, a KV connector reading raw
pointers) or, worse, run with something silently left out. :func:`refuse_unsupported` names the
setting and says what works instead.
"""

from __future__ import annotations

# speculative-decoding methods whose kernels have tpu versions (spec_kernels.py: rejection
# sampling; draft.py: the draft model's input kernels)
SPECULATIVE_METHODS = ("ngram", "draft_model")
# KV-cache dtypes the tpu attention backend stores (attention.py); the fp8 ones as float8 with
# vLLM's per-tensor scales (``k_scale``/``v_scale``), per-token-head ones not
KV_CACHE_DTYPES = ("auto", "float32", "bfloat16", "float16", "fp8", "fp8_e4m3", "fp8_e5m2")
# weight quantization methods whose kernels run on tpu (quant.py): vLLM's online FP8 of a
# bfloat16/float16 checkpoint ("fp8" there means "fp8_per_tensor") and its per-channel form
QUANTIZATION_METHODS = ("fp8", "fp8_per_tensor", "fp8_per_channel")
# KV connectors the tpu worker serves: vLLM's offloading to host memory, with the copy worker of
# offload.py (kv_offloading_size asks for it), and its ExampleConnector, which hands a prompt's KV
# from a prefill instance to a decode instance through files (routing.disaggregated); the RDMA
# ones (NIXL, Mooncake, ...) read raw device pointers
KV_CONNECTORS = ("OffloadingConnector", "ExampleConnector")
OFFLOAD_SPEC = {"spec_name": "TpuHostOffloadingSpec",
                "spec_module_path": "torchtpu.integrations.vllm.offload"}


def _refuse(what: str, instead: str) -> None:
    raise NotImplementedError(f"torchtpu.unsupported: vLLM on device 'tpu' has no {what} yet; "
                              f"instead, {instead}")


def _refuse_parallelism(parallel) -> None:
    """Tensor parallelism on one host through vLLM's multiprocessing executor (one worker
    process per device, collectives over tpu_dist: communicator.py); no other parallelism."""
    replicas = ("serve replicas behind vllm-router: python -m "
                "torchtpu.integrations.vllm.routing MODEL --replicas N")
    for name in ("pipeline_parallel_size", "data_parallel_size",
                 "prefill_context_parallel_size", "decode_context_parallel_size"):
        size = getattr(parallel, name, 1)
        if size != 1:
            _refuse(f"{name}={size}", f"use tensor_parallel_size, or {replicas}")
    if getattr(parallel, "enable_expert_parallel", False):
        _refuse("expert parallelism (enable_expert_parallel)", "leave it off")
    if getattr(parallel, "tensor_parallel_size", 1) == 1:
        return
    if getattr(parallel, "nnodes", 1) != 1:
        _refuse(f"tensor parallelism across hosts (nnodes={parallel.nnodes})",
                f"keep tensor_parallel_size within one host, or {replicas}")
    backend = getattr(parallel, "distributed_executor_backend", None)
    if backend not in (None, "mp"):
        _refuse(f"tensor parallelism with distributed_executor_backend={backend!r}",
                "leave it unset (vLLM's multiprocessing executor, 'mp')")


def _refuse_kv_transfer(cache, transfer) -> None:
    """KV offload to host memory (offload.py) and the connectors of KV_CONNECTORS only."""
    import vllm.envs as envs

    if getattr(cache, "kv_offloading_size", None) is not None:
        backend = getattr(cache, "kv_offloading_backend", "native")
        if backend != "native":
            _refuse(f"kv_offloading_backend={backend!r}",
                    "use kv_offloading_backend='native' (host memory of this process)")
        if envs.VLLM_USE_SIMPLE_KV_OFFLOAD:
            _refuse("KV offloading with VLLM_USE_SIMPLE_KV_OFFLOAD=1 (SimpleCPUOffloadConnector)",
                    "unset it: vLLM's OffloadingConnector copies through the tpu worker")
    if transfer is None or transfer.kv_connector is None:
        return
    if transfer.kv_connector not in KV_CONNECTORS:
        _refuse(f"KV connector {transfer.kv_connector!r} (kv_transfer_config)",
                f"use kv_connector={' or '.join(map(repr, KV_CONNECTORS))}, or serve whole "
                "requests on each replica (python -m torchtpu.integrations.vllm.routing)")
    spec = transfer.kv_connector_extra_config.get("spec_name", OFFLOAD_SPEC["spec_name"])
    if transfer.kv_connector == "OffloadingConnector" and spec != OFFLOAD_SPEC["spec_name"]:
        _refuse(f"KV offloading spec {spec!r} (a CUDA copy engine)",
                "leave spec_name unset: the tpu spec copies blocks to host memory")


def configure_kv_transfer(vllm_config) -> None:
    """Name the tpu offloading spec (offload.py) in vLLM's OffloadingConnector config, asked for
    by name or through ``kv_offloading_size``. The platform's check runs before vLLM turns
    ``kv_offloading_size`` into a connector config, which keeps the extra config it finds."""
    cache = vllm_config.cache_config
    native = getattr(cache, "kv_offloading_size", None) is not None
    transfer = getattr(vllm_config, "kv_transfer_config", None)
    if transfer is None and native:
        from vllm.config import KVTransferConfig

        transfer = vllm_config.kv_transfer_config = KVTransferConfig()
    if transfer is not None and (native or transfer.kv_connector == "OffloadingConnector"):
        for key, value in OFFLOAD_SPEC.items():
            transfer.kv_connector_extra_config.setdefault(key, value)


def refuse_unsupported(vllm_config) -> None:
    """Raise naming the first setting in ``vllm_config`` that device "tpu" cannot serve."""
    parallel = getattr(vllm_config, "parallel_config", None)
    if parallel is not None:
        _refuse_parallelism(parallel)
    model = getattr(vllm_config, "model_config", None)
    quantization = getattr(model, "quantization", None)
    if quantization and quantization not in QUANTIZATION_METHODS:
        _refuse(f"quantization method {quantization!r}",
                f"use quantization={' or '.join(map(repr, QUANTIZATION_METHODS))} (FP8 weights), "
                "or serve an unquantized checkpoint (dtype float32, bfloat16 or float16)")
    cache = getattr(vllm_config, "cache_config", None)
    dtype = getattr(cache, "cache_dtype", "auto")
    if dtype not in KV_CACHE_DTYPES:
        _refuse(f"kv_cache_dtype={dtype!r}",
                f"use one of {', '.join(KV_CACHE_DTYPES)} (auto: the model's dtype)")
    _refuse_kv_transfer(cache, getattr(vllm_config, "kv_transfer_config", None))
    spec = getattr(vllm_config, "speculative_config", None)
    method = getattr(spec, "method", None)
    if method is not None and method not in SPECULATIVE_METHODS:
        # EAGLE / MTP drafts read the target's hidden states and share its embeddings: not
        # tried on tpu yet (their input kernels are draft.py's, as the draft model's)
        _refuse(f"speculative decoding method {method!r}",
                "use speculative_config={'method': 'ngram', 'num_speculative_tokens': k, "
                "'prompt_lookup_max': n} or {'method': 'draft_model', 'model': DRAFT_DIR, "
                "'num_speculative_tokens': k}")
