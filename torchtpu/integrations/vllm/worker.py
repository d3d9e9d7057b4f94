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
import time

import numpy as np
import torch
from vllm.config import CUDAGraphMode
from vllm.distributed.kv_transfer import has_kv_transfer_group
from vllm.forward_context import (
    get_forward_context,
    is_forward_context_available,
    set_forward_context,
)
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import CompilationTimes, Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory

from torchtpu.eager.capture import storage_of
from torchtpu.integrations.vllm.attention import (
    TpuAttentionMetadata,
    TpuAttentionMetadataBuilder,
    allocate_kv_caches,
)
from torchtpu.integrations.vllm.communicator import TpuCommunicator
from torchtpu.integrations.vllm.graphs import HostFeeds, StepGraphs, bucket
from torchtpu.runtime import platform

log = init_logger(__name__)

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
        # a decode step prepared on the host (_prepare_decode_on_host): its fed buffers
        self._fed: HostFeeds | None = None
        self._feeds: tuple | None = None  # (the block table they read, HostFeeds)
        self._fed_reqs = 0
        # (logits [n, V], the array the program left in their storage, tokens [n], padded n)
        self._sampled: tuple | None = None
        self._host_positions = np.zeros(self.max_num_tokens, dtype=np.int64)

    def _decodes_on_host(self, num_scheduled_tokens: np.ndarray) -> bool:
        """Whether this step is plain decodes that the captured program can read from the host:
        one token a request, none of the features whose inputs live only on the device."""
        batch = self.input_batch
        return (self.step_graphs is not None and num_scheduled_tokens.size > 0
                and bool((num_scheduled_tokens == 1).all())
                and self.speculative_config is None and not self.lora_config
                and not self.uses_mrope and not self.enable_prompt_embeds
                and not self.supports_mm_inputs and not self.is_pooling_model
                and self.dcp_world_size == 1 and self.lookback_token_ids is None
                and batch.prev_sampled_token_ids is None
                and self.num_accepted_tokens_event is None
                and len(self.kv_cache_config.kv_cache_groups) == 1
                and len(batch.block_table.block_tables) == 1
                and not self.cache_config.kv_sharing_fast_prefill
                and all(isinstance(g.get_metadata_builder(), TpuAttentionMetadataBuilder)
                        and g.kernel_block_size is None
                        and not isinstance(g.kv_cache_spec, EncoderOnlyAttentionSpec)
                        for g in self.attn_groups[0])
                and not has_kv_transfer_group())

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        self._fed = self._sampled = None
        if self._decodes_on_host(num_scheduled_tokens):
            return self._prepare_decode_on_host()
        return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)

    def _prepare_decode_on_host(self):
        """vLLM's input preparation for a step of decodes, in NumPy on its host buffers only.

        The same values vLLM's ``_prepare_inputs`` computes (its host half, and what its device
        half derives: positions, sequence lengths, slot mapping), left in host arrays that the
        captured forward reads at replay (:class:`HostFeeds`); no device op runs. Padded
        requests query nothing, have length 0 and read block 0; padded tokens write slot -1.
        """
        batch = self.input_batch
        n = batch.num_reqs
        rows = self.arange_np[:n]
        computed = batch.num_computed_tokens_cpu[:n]  # each request's one new token's position
        self.input_ids.np[:n] = batch.token_ids_cpu[rows, computed]
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1:n + 1] = rows + 1
        self.query_start_loc.np[n + 1:] = n
        seq_lens = self.optimistic_seq_lens_cpu.numpy()
        seq_lens[:n] = computed + 1
        seq_lens[n:] = 0
        self._compute_prev_positions(n)
        num_tokens = np.array([self.requests[r].num_tokens for r in batch.req_ids],
                              dtype=np.int64)
        self.discard_request_mask.np[:n] = seq_lens[:n] < num_tokens
        self.num_accepted_tokens.np.fill(1)
        positions = self._host_positions
        positions[:n] = computed
        positions[n:] = 0
        table = batch.block_table[0]
        bs, blocks = table.block_size, table.block_table.np
        slots = table.slot_mapping.np
        slots[:n] = blocks[rows, computed // bs].astype(np.int64) * bs + computed % bs
        slots[n:] = -1

        self._fed_reqs = n
        self._fed = self._host_feeds()
        # a slice, not vLLM's index tensor: the decode rows are the first n, and a view of the
        # hidden states costs no op (vLLM uses the indices for nothing else on these steps)
        return slice(0, n), None, 1

    def _host_feeds(self) -> HostFeeds:
        """The buffers a host-prepared decode step feeds its program, made once per input
        batch; each function reads the current step's values (a replay calls them)."""
        table = self.input_batch.block_table[0]
        if self._feeds is not None and self._feeds[0] is table:
            return self._feeds[1]
        blocks = table.block_table.np
        seq_lens = self.optimistic_seq_lens_cpu.numpy()

        def padded_blocks() -> np.ndarray:  # rows past the step's requests: the null block
            out = blocks.copy()
            out[self._fed_reqs:] = 0
            return out

        fed = HostFeeds()
        fed.add(self.input_ids.gpu, lambda: self.input_ids.np)
        fed.add(self.positions, lambda: self._host_positions)
        fed.add(self.query_start_loc.gpu, lambda: self.query_start_loc.np)
        fed.add(self.seq_lens, lambda: seq_lens)
        fed.add(table.block_table.gpu, padded_blocks)
        fed.add(table.slot_mapping.gpu, lambda: table.slot_mapping.np)
        fed.add(self.is_padding, lambda: np.arange(self.max_num_tokens) >= self._fed_reqs)
        self._feeds = (table, fed)
        return fed

    def capture_decode_steps(self) -> int:
        """Capture, compile and run once every padded decode shape a step can take: each
        request count :func:`bucket` gives up to ``max_num_seqs``, with each context read
        (powers of two of blocks up to ``max_model_len``), so that no request waits for a
        decode program's compile. The dummy steps write only the null block 0. Returns how
        many shapes were captured."""
        if not self._decodes_on_host(np.ones(1, dtype=np.int32)):
            return 0
        table = self.input_batch.block_table[0]
        bs, max_blocks = table.block_size, table.block_table.np.shape[1]
        reqs = sorted({bucket(1 << i, self.max_num_reqs)
                       for i in range(max(1, self.max_num_reqs).bit_length())})
        contexts = sorted({min(1 << i, max_blocks) for i in range(max_blocks.bit_length() + 1)})
        before = self.step_graphs.captures
        for r in reqs:
            for blocks in contexts:
                if len(self.step_graphs._graphs) >= self.step_graphs.max_captures:
                    break
                self._dummy_decode(r, blocks * bs)
        self._fed = self._sampled = None
        return self.step_graphs.captures - before

    def _dummy_decode(self, n: int, seq_len: int) -> None:
        """One decode step of n requests of seq_len tokens, through the host-fed path."""
        self.input_ids.np[:n] = 0
        self.query_start_loc.np[: n + 1] = np.arange(n + 1)
        self.query_start_loc.np[n + 1:] = n
        seq_lens = self.optimistic_seq_lens_cpu.numpy()
        seq_lens[:n], seq_lens[n:] = seq_len, 0
        self._host_positions[:n], self._host_positions[n:] = seq_len - 1, 0
        self.input_batch.block_table[0].slot_mapping.np[:] = -1  # the null block
        self._fed_reqs = n
        self._fed = self._host_feeds()
        mode, desc, _, _, _ = self._determine_batch_execution_and_padding(
            num_tokens=n, num_reqs=n, num_scheduled_tokens_np=np.ones(n, dtype=np.int32),
            max_num_scheduled_tokens=1, allow_microbatching=False)
        tokens = desc.num_tokens
        by_gid, by_layer = self._get_slot_mappings(tokens, desc.num_reqs, n)
        attn_metadata, _ = self._build_attention_metadata(
            num_tokens=n, num_reqs=n, max_query_len=1, num_tokens_padded=tokens,
            num_reqs_padded=desc.num_reqs, slot_mappings=by_gid)
        with set_forward_context(attn_metadata, self.vllm_config, num_tokens=tokens,
                                 cudagraph_runtime_mode=mode, batch_descriptor=desc,
                                 slot_mapping=by_layer):
            self._model_forward(input_ids=self.input_ids.gpu[:tokens],
                                positions=self.positions[:tokens])

    def _get_slot_mappings(self, num_tokens_padded: int, num_reqs_padded: int,
                           num_tokens_unpadded: int, ubatch_slices=None):
        if self._fed is None or ubatch_slices is not None:
            return super()._get_slot_mappings(num_tokens_padded, num_reqs_padded,
                                              num_tokens_unpadded, ubatch_slices)
        # the host slot mapping pads with -1 already: no fill of the device rows
        slots = self.input_batch.block_table[0].slot_mapping.gpu[:num_tokens_padded]
        layers = self.kv_cache_config.kv_cache_groups[0].layer_names
        return {0: slots}, dict.fromkeys(layers, slots)

    def _build_attention_metadata(self, num_tokens: int, num_reqs: int, max_query_len: int,
                                  num_tokens_padded: int | None = None,
                                  num_reqs_padded: int | None = None,
                                  ubatch_slices=None, **kwargs):
        if self._fed is None or ubatch_slices is not None or kwargs.get("use_spec_decode"):
            return super()._build_attention_metadata(
                num_tokens, num_reqs, max_query_len, num_tokens_padded, num_reqs_padded,
                ubatch_slices, **kwargs)
        # one metadata for every layer, over the buffers the program is fed; the fed block
        # table's padded rows are the null block already (no fill of the device rows)
        tokens, reqs = num_tokens_padded or num_tokens, num_reqs_padded or num_reqs
        builder = self.attn_groups[0][0].get_metadata_builder()
        md = builder.metadata(
            tokens, reqs, max_query_len, int(self.optimistic_seq_lens_cpu[:num_reqs].max()),
            self.query_start_loc.gpu[:reqs + 1], self.seq_lens[:reqs],
            self.input_batch.block_table[0].block_table.gpu[:reqs])
        return {name: md for group in self.attn_groups[0] for name in group.layer_names}, None

    def _prepare_padding_mask(self, num_tokens_unpadded: int,
                              num_tokens_padded: int) -> torch.Tensor:
        if self._fed is not None:  # fed: the host mask is the program's input
            return self.is_padding[:num_tokens_padded]
        return super()._prepare_padding_mask(num_tokens_unpadded, num_tokens_padded)

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
        if key is None:
            if self._fed is not None:  # prepared on the host, yet not captured: copy it in
                self._fed.materialize()
            return forward()
        if self._fed is None:
            return self.step_graphs((key, False), forward)
        reqs = ctx_reqs = get_forward_context().batch_descriptor.num_reqs

        def forward_and_sample():
            # the decode rows are the step's first rows: logits and the greedy choice of each
            # padded request, in the program too
            hidden = forward()
            logits = self._model_compute_logits(hidden[:ctx_reqs])
            return hidden, logits, logits.argmax(dim=-1)

        out = self.step_graphs((key, True), forward_and_sample, self._fed)
        if not isinstance(out, tuple):  # ran eagerly (the capture failed)
            return out
        hidden, logits, tokens = out
        n = self._fed_reqs
        self._sampled = (logits[:n], storage_of(logits)._tpu_array, tokens[:n], reqs)
        return hidden

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        # a host-prepared decode step computes its logits and greedy tokens in its program:
        # vLLM's calls after the forward get those (see _captured_logits, _greedy)
        self._model_compute_logits = self.model.compute_logits
        self.model.compute_logits = self._captured_logits
        self._sampler_greedy = self.sampler.greedy_sample
        self.sampler.greedy_sample = self._greedy

    def _captured_logits(self, hidden_states: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        sampled = self._sampled
        if sampled is not None and not args and not kwargs \
                and hidden_states.shape[0] == sampled[0].shape[0]:
            return sampled[0]
        return self._model_compute_logits(hidden_states, *args, **kwargs)

    def _greedy(self, logits: torch.Tensor) -> torch.Tensor:
        """The program's argmax where ``logits`` is the program's, unchanged since (a logits
        processor that wrote it in place rebinds its storage); else vLLM's own."""
        sampled = self._sampled
        if (sampled is not None and logits is sampled[0]
                and storage_of(logits)._tpu_array is sampled[1]):
            return sampled[2]
        return self._sampler_greedy(logits)

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
        # each program when it first runs, and the decode steps' programs here (start-up)
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        start = time.perf_counter()
        captured = self.model_runner.capture_decode_steps()
        if captured:
            log.info("torchtpu: %d decode step shapes captured and compiled in %.1f s",
                     captured, time.perf_counter() - start)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    def _maybe_get_memory_pool_context(self, tag: str):
        # no sleep mode on "tpu": PJRT owns device memory, there is no pool to swap out
        return contextlib.nullcontext()
