"""vLLM's worker and model runner on device "tpu": the GPU ones with the device chosen here.

vLLM's GPU worker only knows "cuda" when it picks its device, and its CPU worker calls the
compiled ``_C`` CPU kernels; like vLLM's XPU worker, :class:`TpuWorker` keeps the GPU worker's
scheduling, KV-cache sizing and model loading and replaces only device set-up.
"""

from __future__ import annotations

import contextlib
import dataclasses
import gc
import time

import numpy as np
import torch
from vllm.config import CUDAGraphMode, set_current_vllm_config
from vllm.forward_context import get_forward_context, is_forward_context_available
from vllm.logger import init_logger
from vllm.platforms import current_platform
from vllm.utils.mem_utils import MemorySnapshot
from vllm.utils.torch_utils import set_random_seed
from vllm.v1.worker import gpu_model_runner
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from vllm.v1.worker.gpu_worker import CompilationTimes, Worker, init_worker_distributed_environment
from vllm.v1.worker.utils import request_memory

from torchtpu import metrics, settings
from torchtpu.distributed import solo
from torchtpu.integrations.vllm import preflight, ray_serve
from torchtpu.integrations.vllm.async_output import TpuAsyncOutput
from torchtpu.integrations.vllm.attention import TpuAttentionMetadata, allocate_kv_caches
from torchtpu.integrations.vllm.bookkeeping import async_bookkeeping
from torchtpu.integrations.vllm.communicator import TpuCommunicator
from torchtpu.integrations.vllm.graphs import StepGraphs, bucket
from torchtpu.integrations.vllm.host_steps import HostSteps, prefill_tokens, whole_context
from torchtpu.integrations.vllm.platform import fit_host_kv_cache
from torchtpu.integrations.vllm.sampling import ProgramSampling
from torchtpu.integrations.vllm.stacked import stack_layer_weights
from torchtpu.runtime import platform

log = init_logger(__name__)

# vLLM's dummy sampler run (top-k, top-p and random sampling of max_num_seqs rows) holds at most
# ~10.2 float32 copies of its [rows, vocab] logits at once (vLLM 0.32, its live arrays after each
# op on XLA:CPU, session 41; 7.3 in session 29, the growth not yet explained;
# tests/test_vllm_graphs.py checks the figure still covers it); the profile holds this many
# instead, the rest a margin for a sort's temporaries
SAMPLER_LOGITS_COPIES = 12
# the GPU runner makes its streams and events through torch.cuda
_STREAMS = ("Stream", "current_stream", "default_stream", "stream", "set_stream")


def _route_cuda_names_to_tpu() -> None:
    """Point the CUDA names vLLM's GPU code calls at torch.tpu (worker only); torch.accelerator
    answers for tpu already (``torchtpu/tpu/accelerator.py``)."""
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
    """Route the GPU runner's CUDA names, its KV-cache allocator and its async output to their
    tpu versions."""
    _route_cuda_names_to_tpu()
    gpu_model_runner.allocate_kv_cache = allocate_kv_caches
    gpu_model_runner.AsyncGPUModelRunnerOutput = TpuAsyncOutput


class TpuModelRunner(ProgramSampling, HostSteps, GPUModelRunner):
    """vLLM's GPU model runner, given a "tpu" device, running each step's forward captured.

    Steps are padded the way vLLM pads a step for a full CUDA graph (its FULL runtime mode:
    padded tokens and requests, padded rows of the block table on the null block), to the
    buckets ``host_steps.py`` picks, prepared on the host and fed to one captured program per
    bucket (``graphs.py``), which also computes the logits and greedy tokens of the sampled
    rows (or, for an all-greedy decode step, the tokens alone: ``sampling.py``). Steps the
    host cannot prepare (speculation, LoRA, multimodal, ...) run decodes captured and prefills
    op by op; ``--enforce-eager`` runs everything op by op.
    """

    def __init__(self, *args, **kwargs) -> None:
        super().__init__(*args, **kwargs)
        # a tensor-parallel forward holds collectives, which a capture cannot record yet (the
        # group moves their values between processes as each runs): such steps run op by op
        tensor_parallel = self.parallel_config.tensor_parallel_size > 1
        self.step_graphs = (None if self.model_config.enforce_eager or tensor_parallel
                            else StepGraphs())
        self._init_host_steps()
        # With async scheduling vLLM waits on this event before preparing a step, so that the
        # last step's copies from its CPU buffers are done before it rewrites them. torchtpu's
        # copies to the device read the host when called (kernels.copy_, the packed feeds), so
        # there is nothing to wait for; a tpu event waits for the whole device, here the last
        # step's program, and would keep the host from preparing a step while the device runs.
        self.prepare_inputs_event = None
        self._init_program_sampling()

    def initialize_kv_cache(self, *args, **kwargs) -> None:
        # the allocator (attention.allocate_kv_caches) reads the kv_cache_dtype from the current
        # config: an fp8 cache's float8 (e4m3 or e5m2), which vLLM's spec does not say
        with set_current_vllm_config(self.vllm_config):
            super().initialize_kv_cache(*args, **kwargs)

    def _prepare_inputs(self, scheduler_output, num_scheduled_tokens: np.ndarray):
        self._fed = self._sampled = None
        self._tokens_only = False
        if num_scheduled_tokens.size and self._steps_on_host():
            prepared = self._prepare_on_host(num_scheduled_tokens)
            self._tokens_only = self._leaves_logits_out(scheduler_output)
            return prepared
        if self.input_batch.prev_sampled_token_ids is not None:
            # async scheduling where the host cannot prepare the step (prompt logprobs, say):
            # vLLM's preparation, which reads the last tokens on the device op by op
            metrics.count("vllm_async_device_steps")
        return super()._prepare_inputs(scheduler_output, num_scheduled_tokens)

    def _preprocess(self, scheduler_output, num_input_tokens: int, intermediate_tensors=None):
        if self._fed is None:
            return super()._preprocess(scheduler_output, num_input_tokens, intermediate_tensors)
        # vLLM's text-only first-rank answer, without its zeroing of the padded positions on
        # the device: the fed host positions pad with 0 already
        return (self.head_of(self.input_ids.gpu, num_input_tokens), None,
                self.head_of(self.positions, num_input_tokens),
                None, self._init_model_kwargs(), None)

    def _get_slot_mappings(self, num_tokens_padded: int, num_reqs_padded: int,
                           num_tokens_unpadded: int, ubatch_slices=None):
        if self._fed is None or ubatch_slices is not None:
            return super()._get_slot_mappings(num_tokens_padded, num_reqs_padded,
                                              num_tokens_unpadded, ubatch_slices)
        # the host slot mapping pads with -1 already: no fill of the device rows
        slots = self.head_of(self.input_batch.block_table[0].slot_mapping.gpu, num_tokens_padded)
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
        max_len = self._context_tokens()
        if self._fed_decode or not whole_context(tokens, reqs, max_len, self._attention_heads):
            # bucketed by the longest query and context read
            seq_len = int(self.optimistic_seq_lens_cpu.numpy()[:num_reqs].max())
        else:  # by tokens and requests only: queries as long as they can be, context whole
            seq_len, max_query_len = max_len, min(tokens, max_len)
        builder = self.attn_groups[0][0].get_metadata_builder()
        md = builder.metadata(
            tokens, reqs, max_query_len, seq_len, self.head_of(self.query_start_loc.gpu, reqs + 1),
            self.head_of(self.seq_lens, reqs),
            self.head_of(self.input_batch.block_table[0].block_table.gpu, reqs))
        return dict.fromkeys(self._attention_layers(), md), None

    def _prepare_padding_mask(self, num_tokens_unpadded: int,
                              num_tokens_padded: int) -> torch.Tensor:
        if self._fed is not None:  # fed: the host mask is the program's input
            return self.head_of(self.is_padding, num_tokens_padded)
        return super()._prepare_padding_mask(num_tokens_unpadded, num_tokens_padded)

    def _determine_batch_execution_and_padding(self, num_tokens: int, num_reqs: int, *args,
                                               force_eager: bool = False, **kwargs):
        mode, desc, ubatch, across_dp, stats = super()._determine_batch_execution_and_padding(
            num_tokens, num_reqs, *args, force_eager=force_eager, **kwargs)
        if (self.step_graphs is None or force_eager or ubatch or across_dp is not None
                or mode != CUDAGraphMode.NONE):
            return mode, desc, ubatch, across_dp, stats
        fed_prefill = self._fed is not None and not self._fed_decode
        desc = dataclasses.replace(
            desc, num_tokens=(prefill_tokens(num_tokens, self.max_num_tokens) if fed_prefill
                              else bucket(num_tokens, self.max_num_tokens)),
            num_reqs=bucket(num_reqs, self.max_num_reqs))
        return CUDAGraphMode.FULL, desc, ubatch, across_dp, stats

    def _model_forward(self, input_ids=None, positions=None, intermediate_tensors=None,
                       inputs_embeds=None, **model_kwargs):
        def forward(ids=input_ids):
            out = super(TpuModelRunner, self)._model_forward(
                ids, positions, intermediate_tensors, inputs_embeds, **model_kwargs)
            # the layers' shared layout dies with the forward: alive at the end of a capture,
            # it would be an output the program writes at every replay
            mds = get_forward_context().attn_metadata
            for md in mds.values() if isinstance(mds, dict) else ():
                if isinstance(md, TpuAttentionMetadata):
                    md.forget_layout()
            return out

        key = self._step_key(input_ids, positions, intermediate_tensors, inputs_embeds,
                             model_kwargs)
        fed = self._fed
        if fed is None:
            return forward() if key is None else self.step_graphs((key, False), forward)
        reqs = get_forward_context().batch_descriptor.num_reqs
        tokens_only = self._tokens_only

        def forward_and_sample():
            # the sampled rows' hidden states, logits and greedy tokens (vLLM's sampler's
            # int32 column), in the program too; a tokens-only program leaves the logits out
            hidden = forward(self.step_input_ids(input_ids))[self._sample_rows[:reqs]]
            # float32, as vLLM's sampler casts them first: a bfloat16 model's logits would
            # otherwise take that cast and the sampler's ops eagerly, programs of their own
            # (and compiles) at every step. The greedy tokens are the argmax of the logits
            # before that exact cast (the same token): XLA then takes it inside the head's
            # fusion instead of reading the float32 logits back (156 MB a step at 256
            # requests of Qwen2.5-0.5B; bench/RESULTS.md, serving6)
            raw = self._model_compute_logits(hidden)
            tokens = raw.argmax(dim=-1).to(torch.int32)[:, None]
            self.keep_tokens(tokens)
            return (hidden, tokens) if tokens_only else (hidden, raw.float(), tokens)

        if key is None:  # prepared on the host, yet not captured: copy it in
            fed.materialize()
            out = forward_and_sample()
        else:
            out = self.step_graphs((key, "tokens" if tokens_only else "logits"),
                                   forward_and_sample, fed.step(input_ids.shape[0], reqs))
        return self._program_sampled(out, self._fed_reqs)

    def _bookkeeping_sync(self, scheduler_output, sampler_output, logits, hidden_states,
                          num_scheduled_tokens: int):
        # an async step's placeholders written for all requests at once (bookkeeping.py)
        out = async_bookkeeping(self, sampler_output)
        if out is not None:
            return out
        return super()._bookkeeping_sync(scheduler_output, sampler_output, logits,
                                         hidden_states, num_scheduled_tokens)

    def _dummy_sampler_run(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """The memory vLLM's sampler takes at ``max_num_seqs`` rows, held through the memory
        profile instead of running the sampler: its ops over [max_num_seqs, vocab] (top-k and
        top-p's sort, scatter and their index checks, random sampling) are programs of a shape
        no served step runs again (a step samples its own requests' rows), compiled only for
        the profile: on the v5e ~35 compiles, ~65 s of a 152-s start-up (sort 21 s, the
        scatter's index check 33 s, the scatter 11 s). Speculative decoding's rejection sampler
        runs as vLLM runs it."""
        if self.speculative_config is not None:
            return super()._dummy_sampler_run(hidden_states)
        rows, vocab = hidden_states.shape[0], self.model_config.get_vocab_size()
        return torch.zeros(SAMPLER_LOGITS_COPIES * rows * vocab, dtype=torch.float32,
                           device=self.device)

    def load_model(self, *args, **kwargs) -> None:
        super().load_model(*args, **kwargs)
        # Only where every step can be captured: a step run op by op would read each layer's
        # weight as a view of its own offset, a program per layer instead of one for all.
        # which kinds of per-layer weight go in one storage each (stacked.py): "vectors"
        # (default: norms and biases, no device cost), "1" (all: on the v5e, session 27,
        # Qwen2.5-0.5B, batch 1's decode step 1.90 -> 1.83 ms from fewer launch arguments, but
        # batch 64's 4.35 -> 4.85 ms: XLA no longer prefetches a layer's weight matrices), "0"
        stack = settings.VLLM_STACK.get()
        if self._host_steps_configured() and stack != "0":
            log.info("torchtpu: the layers' weights stacked (%s), %d storages fewer", stack,
                     stack_layer_weights(self.model, vectors_only=stack == "vectors"))
        # a host-prepared step computes its logits and greedy tokens in its program: vLLM's
        # calls after the forward get those (sampling.py)
        self._model_compute_logits = self.model.compute_logits
        self.model.compute_logits = self._captured_logits

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
        # each distinct metadata once: a host-prepared step's layers share one (24 layers'
        # data_ptr calls were ~0.1 ms of the engine thread a step)
        for md in {id(md): md for md in ctx.attn_metadata.values()}.values():
            # steps with prefills are captured only when prepared on the host (bucketed by
            # tokens and requests alone); else they come in many shapes, each of which would
            # compile a program: those run op by op, their padded shapes reusing per-op programs
            if not isinstance(md, TpuAttentionMetadata) or (md.max_query_len != 1
                                                            and self._fed is None):
                return None
            layouts.add((md.num_actual_tokens, md.num_reqs, md.max_query_len, md.context_len,
                         md.query_start_loc.data_ptr(), md.seq_lens.data_ptr(),
                         md.block_table.data_ptr()))
        return (ctx.batch_descriptor, tuple(sorted(layouts)), _slots_key(ctx.slot_mapping),
                input_ids.data_ptr(), positions.data_ptr(), tuple(positions.shape))


def _slots_key(slot_mapping: dict | None) -> tuple:
    """What a step's slot mappings (layer name -> slots tensor) give its program: each layer's
    tensor's address and length; where every layer has one tensor (a host-prepared step),
    the layers' names and that tensor's."""
    slot_mapping = slot_mapping or {}
    distinct = {id(t): t for t in slot_mapping.values()}
    if len(distinct) == 1:
        (t,) = distinct.values()
        return (frozenset(slot_mapping), t.data_ptr(), t.shape[0])
    return tuple(sorted((name, t.data_ptr(), t.shape[0]) for name, t in slot_mapping.items()))


def _claim_local_device(local_rank: int, local_world_size: int) -> None:
    """Make ``tpu:{local_rank}`` this worker process's device, as CUDA's local ranks are.

    torchtpu drives one device per process and learns a process's host-local index from
    torchrun's variables or at init_process_group; vLLM names the device (and sets it) before
    it starts its process groups, so the index is recorded here, and on a host of several
    devices picks which one this process drives.
    """
    if local_world_size > 1:
        if not settings.LOCAL_DEVICE.is_set():
            settings.LOCAL_DEVICE.export(local_rank)
        platform.set_process_slot(local_rank, local_world_size)


def _solo_init_method(init_method: str, world_size: int) -> str:
    """A process alone needs no TCP rendezvous: vLLM's external launcher (TRL's colocated
    engine) rendezvouses through ``env://``, a TCP store on MASTER_PORT, which a machine refusing
    internet sockets cannot open; at world size 1 a file store does the same job anywhere."""
    if world_size == 1 and init_method == "env://":
        from vllm.utils.network_utils import get_file_store_init_method

        return get_file_store_init_method()
    return init_method


@contextlib.contextmanager
def _solo_cpu_groups(world_size: int):
    """At world size 1, vLLM's gloo groups (one beside each device group, for host-side
    coordination) are ``tpu_solo`` groups: gloo opens a TCP device even for a group of one,
    which a machine refusing internet sockets (a sandboxed TPU host) cannot; vLLM's own
    rendezvous there is a file store already (its uniprocess executor)."""
    if world_size != 1:
        yield
        return
    new_group = torch.distributed.new_group

    def solo_if_gloo(*args, backend=None, **kwargs):
        if backend == "gloo":
            backend = solo.BACKEND
        return new_group(*args, backend=backend, **kwargs)

    torch.distributed.new_group = solo_if_gloo
    try:
        yield
    finally:
        torch.distributed.new_group = new_group


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
        ray_serve.watch_parent()
        _claim_local_device(self.local_rank, self.parallel_config.local_world_size)
        self.device = torch.device("tpu", self.local_rank)
        current_platform.set_device(self.device)
        current_platform.check_if_supports_dtype(self.model_config.dtype)
        world = self.parallel_config.world_size_across_dp
        with _solo_cpu_groups(world):
            init_worker_distributed_environment(
                self.vllm_config,
                self.rank,
                _solo_init_method(self.distributed_init_method, world),
                self.local_rank,
                current_platform.dist_backend,
            )
        set_random_seed(self.model_config.seed)
        gc.collect()
        self.init_snapshot = MemorySnapshot(device=self.device)
        self.requested_memory = request_memory(self.init_snapshot, self.cache_config)
        self._init_workspace_and_model_runner()

    def jax_device(self) -> str:
        """The JAX device this worker's "tpu" is (``collective_rpc("jax_device")``)."""
        return str(platform.local_device())

    def communication(self) -> dict[str, dict[str, int]]:
        """The collectives this worker's tpu_dist communicators served, by vLLM group name
        (``llm.collective_rpc("communication")`` asks every worker)."""
        return {name: dict(group.device_communicator.calls)
                for name, group in _groups().items()
                if isinstance(group.device_communicator, TpuCommunicator)}

    def load_model(self, *args, **kwargs) -> None:
        # weights larger than the device fail part way through the load: say so before it
        # (on XLA:CPU the share vLLM asks for is the KV cache's, platform.py: the whole memory)
        share = (1.0 if platform.platform() == "cpu"
                 else self.cache_config.gpu_memory_utilization)
        preflight.check_weights_fit(
            self.model_config.model, self.model_config.dtype,
            torch.tpu.get_device_properties(self.device).total_memory, share,
            torch.tpu.get_device_name(self.device))
        super().load_model(*args, **kwargs)

    def determine_available_memory(self) -> int:
        return fit_host_kv_cache(self.vllm_config, super().determine_available_memory(),
                                 self.get_kv_cache_spec())

    def _make_model_runner(self) -> GPUModelRunner:
        return TpuModelRunner(self.vllm_config, self.device)

    def compile_or_warm_up_model(self) -> CompilationTimes:
        # the GPU worker's kernel warm-up imports every model's CUDA kernels; torchtpu compiles
        # each program when it first runs, and the decode steps' programs here (start-up)
        set_random_seed(self.model_config.seed, self.parallel_config.data_parallel_index)
        start = time.perf_counter()
        capture = settings.VLLM_CAPTURE.get()
        # lazy: each step shape compiles when a step first meets it (fewer compiles in all,
        # where a workload meets few shapes; requests then wait for them)
        decodes, prefills = self.model_runner.capture_steps() if capture == "startup" else (0, 0)
        if decodes or prefills:
            log.info("torchtpu: %d decode and %d prefill step programs captured and compiled in "
                     "%.1f s", decodes, prefills, time.perf_counter() - start)
        return CompilationTimes(
            language_model=self.compilation_config.compilation_time,
            encoder=self.compilation_config.encoder_compilation_time,
        )

    def _maybe_get_memory_pool_context(self, tag: str):
        # no sleep mode on "tpu": PJRT owns device memory, there is no pool to swap out
        return contextlib.nullcontext()
