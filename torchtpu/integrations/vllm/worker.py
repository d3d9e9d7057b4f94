"""vLLM's worker and model runner on device "tpu": the GPU ones with the device chosen here.

vLLM's GPU worker only knows "cuda" when it picks its device, and its CPU worker calls the
compiled ``_C`` CPU kernels; like vLLM's XPU worker, :class:`TpuWorker` keeps the GPU worker's
scheduling, KV-cache sizing and model loading and replaces only device set-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import gc
import os

import torch
from vllm.config import CUDAGraphMode
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import CompilationTimes, Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory

from torchtpu.integrations.vllm.attention import TpuAttentionMetadata, allocate_kv_caches
from torchtpu.integrations.vllm.communicator import TpuCommunicator
from torchtpu.integrations.vllm.graphs import StepGraphs, bucket
from torchtpu.runtime import platform

# torch.accelerator's memory functions assert on a C++ DeviceAllocator, which a Python backend
# has not got; torch.tpu answers the same questions.
_MEMORY = {
    "memory_stats": "memory_stats",
    "memory_reserved": "memory_reserved",
    "memory_allocated": "memory_allocated",
    "max_memory_allocated": "max_memory_allocated",
    "reset_peak_memory_stats": "reset_peak_memory_stats",
    "get_memory_info": "mem_get_info",
}
# the GPU runner makes its streams and events through torch.cuda
_STREAMS = ("Stream", "current_stream", "default_stream", "stream", "set_stream")


def _route_cuda_names_to_tpu() -> None:
    """Point the accelerator and CUDA names vLLM's GPU code calls at torch.tpu (worker only)."""
    for name, tpu_name in _MEMORY.items():
        setattr(torch.accelerator, name, functools.partial(getattr(torch.tpu, tpu_name)))
    for name in _STREAMS:
        setattr(torch.cuda, name, getattr(torch.tpu, name))

    def event(*args, blocking=None, **kwargs):
        return torch.tpu.Event(*args, **kwargs)

    torch.cuda.Event = event
    # the device-generic torch.Event asks the C++ accelerator hooks, which a Python backend
    # has not got; the runner syncs its speculative-decoding copies on such events. A class,
    # since Dynamo (xgrammar's bitmask kernel is compiled) checks isinstance(x, torch.Event).
    torch.Event = _DeviceEvent


class _DeviceEvent(torch.tpu.Event):
    """``torch.Event(device, *, enable_timing, blocking, interprocess)`` on "tpu"."""

    def __init__(self, device=None, *, enable_timing: bool = False, blocking: bool = False,
                 interprocess: bool = False) -> None:
        super().__init__(enable_timing=enable_timing)


def _tpu_runner_hooks() -> None:
    """Route the GPU runner's CUDA names and its KV-cache allocator to their tpu versions."""
    _route_cuda_names_to_tpu()
    gpu_model_runner.allocate_kv_cache = allocate_kv_caches


class TpuModelRunner(GPUModelRunner):
    """vLLM's GPU model runner, given a "tpu" device, running decode steps' forwards captured.

    Steps are padded the way vLLM pads a step for a full CUDA graph (its FULL runtime mode:
    padded tokens and requests, padded rows of the block table on the null block), to the
    sizes :func:`graphs.bucket` picks; the forward of each padded decode shape is one captured
    program (``graphs.py``), steps with prefills run op by op. ``--enforce-eager`` turns both
    off.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # a tensor-parallel forward holds collectives, which a capture cannot record yet (the
        # group moves their values between processes as each runs): such steps run op by op
        tensor_parallel = self.parallel_config.tensor_parallel_size > 1
        self.step_graphs = (None if self.model_config.enforce_eager or tensor_parallel
                            else StepGraphs())

    def _determine_batch_execution_and_padding(self, num_tokens: int, num_reqs: int, *args,
                                               force_eager: bool = False, **kwargs):
        mode, desc, ubatch, across_dp, stats = super()._determine_batch_execution_and_padding(
            num_tokens, num_reqs, *args, force_eager=force_eager, **kwargs)
        if (self.step_graphs is None or force_eager or ubatch or across_dp is not None
                or mode != CUDAGraphMode.NONE):
            return mode, desc, ubatch, across_dp, stats
        desc = dataclasses.replace(
            desc, num_tokens=bucket(num_tokens, self.max_num_tokens),
            num_reqs=bucket(num_reqs, self.max_num_reqs))
        return CUDAGraphMode.FULL, desc, ubatch, across_dp, stats

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        def forward():
            out = super(TpuModelRunner, self)._model_forward(
                input_ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)
            # the layers' shared layout dies with the forward: alive at the end of a capture,
            # it would be an output the program writes at every replay
            mds = get_forward_context().attn_metadata
            for md in mds.values() if isinstance(mds, dict) else ():
                if isinstance(md, TpuAttentionMetadata):
                    md.forget_layout()
            return out

        key = self._step_key(input_ids, positions, intermediate_tensors, inputs_embeds,
                             model_kwargs)
        return forward() if key is None else self.step_graphs(key, forward)

    def _step_key(self, input_ids, positions, intermediate_tensors, inputs_embeds,
                  model_kwargs):
        """What a captured forward depends on, or None where this step runs eagerly."""
        if self.step_graphs is None or not is_forward_context_available():
            return None
        ctx = get_forward_context()
        if (ctx.cudagraph_runtime_mode != CUDAGraphMode.FULL or not ctx.attn_metadata
                or not isinstance(ctx.attn_metadata, dict) or intermediate_tensors is not None
                or inputs_embeds is not None or model_kwargs
                or not isinstance(input_ids, torch.Tensor)):
            return None
        layouts = set()
        for md in ctx.attn_metadata.values():
            # decode steps only, as vLLM's FULL_DECODE_ONLY: they repeat a few shapes all the
            # time, while steps with prefills come in many and would each compile a program;
            # those run op by op, their padded shapes reusing the per-op programs
            if not isinstance(md, TpuAttentionMetadata) or md.max_query_len != 1:
                return None
            layouts.add((md.num_actual_tokens, md.num_reqs, md.max_query_len, md.context_len,
                         md.query_start_loc.data_ptr(), md.seq_lens.data_ptr(),
                         md.block_table.data_ptr()))
        slots = tuple(sorted((name, t.data_ptr(), t.shape[0])
                             for name, t in (ctx.slot_mapping or {}).items()))
        return (ctx.batch_descriptor, tuple(sorted(layouts)), slots,
                input_ids.data_ptr(), positions.data_ptr(), tuple(positions.shape))


def _claim_local_device(local_rank: int, local_world_size: int) -> None:
    """Make ``tpu:{local_rank}`` this worker process's device, as CUDA's local ranks are.

    torchtpu drives one device per process and learns a process's host-local index from
    torchrun's variables or at init_process_group; vLLM names the device (and sets it) before
    it starts its process groups, so the index is recorded here, and on a host of several
    devices picks which one this process drives.
    """
    if local_world_size > 1:
        os.environ.setdefault("TORCHTPU_LOCAL_DEVICE", str(local_rank))
        platform.set_process_slot(local_rank, local_world_size)


def _groups() -> dict:
    """vLLM's live group coordinators by unique name (tp:0, pp:0, world, ...)."""
    from vllm.distributed import parallel_state

    return {name: ref() for name, ref in parallel_state._groups.items() if ref() is not None}


class TpuWorker(Worker):
    def init_device(self) -> None:
        if self.device_config.device_type != "tpu":
            raise RuntimeError(
                f"torchtpu.device: TpuWorker runs on device 'tpu', not "
                f"{self.device_config.device!r}; "
                "set TORCHTPU_VLLM=0 to use vLLM's own platform"
            )
        _tpu_runner_hooks()
        _claim_local_device(self.local_rank, self.parallel_config.local_world_size)
        self.device = torch.device("tpu", self.local_rank)
        current_platform.set_device(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        init_worker_distributed_environment(
            self.vllm_config,
            self.rank,
            self.distributed_init_method,
            self.local_rank,
            current_platform.dist_backend,
        )
        set_random_seed(self.model_config.seed)
        gc.collect()
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
        self._init_workspace_and_model_runner()

    def communication(self) -> dict[str, dict[str, int]]:
        """The collectives this worker's tpu_dist communicators served, by vLLM group name
        (``llm.collective_rpc("communication")`` asks every worker)."""
        return {name: dict(group.device_communicator.calls)
                for name, group in _groups().items()
                if isinstance(group.device_communicator, TpuCommunicator)}

    def _make_model_runner(self) -> GPUModelRunner:
        return TpuModelRunner(self.vllm_config, self.device)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # the GPU worker's kernel warm-up imports every model's CUDA kernels; torchtpu compiles
        # each program when it first runs
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    def _maybe_get_memory_pool_context(self, tag: str):
        # no sleep mode on "tpu": PJRT owns device memory, there is no pool to swap out
        return contextlib.nullcontext()
