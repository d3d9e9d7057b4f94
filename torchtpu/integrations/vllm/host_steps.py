"""vLLM steps prepared on the host and the shape buckets they are captured in.

vLLM's GPU runner prepares a step half on the host and half on the device (positions, sequence
lengths and the slot mapping are computed by device ops); on "tpu" each of those ops would be a
program launch of its own outside the step's captured program. :class:`HostSteps` (a mixin of
the tpu model runner) prepares every step vLLM schedules without speculation, LoRA, multimodal
inputs, prompt logprobs or a KV connector in NumPy alone, on vLLM's host buffers, as vLLM's CPU
platform does; the captured program reads those buffers as inputs of its own at replay
(:class:`graphs.HostFeeds`).

A step's program is keyed by its bucket: decode steps (one token a request) by padded requests
and context blocks, steps with prefills (prompt chunks, prefix-cache hits, prefills mixed with
decodes) by padded tokens and requests only, their queries padded to the shorter of the tokens
and ``max_model_len`` and their context read whole (``max_model_len``), as long as that padded
attention stays within :data:`SCORE_BUDGET`. So the buckets are few and known from
``max_num_batched_tokens``, ``max_num_seqs`` and ``max_model_len``: the worker captures and
compiles every one of them at start-up (:meth:`HostSteps.capture_steps`), and no request waits
for a compile. (Buckets past the budget pad to the step's longest query and context instead,
compiled when first met.)
"""

from __future__ import annotations

import numpy as np
import torch
from vllm.distributed.kv_transfer import has_kv_transfer_group
from vllm.forward_context import set_forward_context
from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

from torchtpu.integrations.vllm.attention import TpuAttentionMetadataBuilder
from torchtpu.integrations.vllm.graphs import HostFeeds, bucket

# the fewest tokens a step with prefills is padded to: short prompts share one program
MIN_PREFILL_TOKENS = 16


def prefill_tokens(n: int, limit: int) -> int:
    """The padded token count of a step with prefills of n tokens (at most ``limit``)."""
    return bucket(max(n, min(MIN_PREFILL_TOKENS, limit)), limit)


def _powers(limit: int) -> list[int]:
    """Every bucket :func:`bucket` gives for 1..limit."""
    return sorted({bucket(1 << i, limit) for i in range(max(1, limit).bit_length())})


# the most attention scores (requests x heads x queries x context) a step with prefills pads to
# for its bucket of tokens and requests alone: 128 MiB of float32 scores a layer. Larger buckets
# (many requests, long contexts) pad their queries and context to the step's own longest, each
# such shape compiled when a step first meets it.
SCORE_BUDGET = 1 << 25


def whole_context(tokens: int, reqs: int, max_len: int, heads: int) -> bool:
    """Whether a step with prefills of this bucket pads its queries to min(tokens, max_len) and
    reads the whole context (``max_len``) within :data:`SCORE_BUDGET`."""
    return reqs * heads * min(tokens, max_len) * max_len <= SCORE_BUDGET


def prefill_grid(max_tokens: int, max_reqs: int, max_len: int,
                 heads: int = 1) -> list[tuple[int, int]]:
    """Every (padded tokens, padded requests) a step with prefills can take, requests r of at
    most ``max_len`` tokens each, r <= tokens <= ``max_tokens``, that :func:`whole_context`
    keeps to its bucket."""
    grid = []
    for reqs in _powers(max_reqs):
        for tokens in sorted({prefill_tokens(t, max_tokens) for t in _powers(max_tokens)}):
            # reachable: some step of at most reqs requests pads to this many tokens
            smallest = tokens // 2 + 1 if tokens > MIN_PREFILL_TOKENS else 1
            if (tokens >= reqs and smallest <= reqs * max_len
                    and whole_context(tokens, reqs, max_len, heads)):
                grid.append((tokens, reqs))
    return grid


class HostSteps:
    """The tpu model runner's steps prepared in NumPy and fed to their captured programs."""

    def _init_host_steps(self) -> None:
        self._fed: HostFeeds | None = None  # this step's feeds, if prepared on the host
        self._fed_decode = False  # ...and whether it is decodes only
        self._feeds: tuple | None = None  # (the block table they read, HostFeeds)
        self._fed_reqs = self._fed_tokens = 0
        # query heads of one attention layer on this worker (the padded attention's size)
        self._attention_heads = self.model_config.get_num_attention_heads(self.parallel_config)
        self._req_rows = np.zeros(0, dtype=np.int64)  # each step token's request
        self._host_positions = np.zeros(self.max_num_tokens, dtype=np.int64)
        # the hidden-state row each request's next token is sampled from
        self._host_sample_rows = np.zeros(self.max_num_reqs, dtype=np.int64)
        self._sample_rows = torch.zeros(self.max_num_reqs, dtype=torch.int64,
                                        device=self.device)
        # Async scheduling: a step is prepared before the last one's tokens reach the host.
        # Each host-prepared program writes its greedy tokens into ``_last_tokens``; the next
        # one reads a token's id there where ``_prev_index`` (host-fed, a token's row in the
        # last step, -1 for an id on the host) says so (``step_input_ids``).
        self._last_tokens = torch.zeros(self.max_num_reqs, 1, dtype=torch.int32,
                                        device=self.device)
        self._host_prev_index = np.full(self.max_num_tokens, -1, dtype=np.int64)
        self._prev_index = torch.full((self.max_num_tokens,), -1, dtype=torch.int64,
                                      device=self.device)
        self._last_sampled = None  # the tokens the last host-prepared step's program sampled
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._layers: tuple | None = None  # (attention groups, their layers' names)

    def _host_steps_configured(self) -> bool:
        """Whether this runner's configuration lets its steps be prepared on the host (known
        once the model is built; each step's own conditions: ``_steps_on_host``)."""
        return (self.step_graphs is not None
                and self.speculative_config is None and not self.lora_config
                and not self.uses_mrope and not self.enable_prompt_embeds
                and not self.supports_mm_inputs and not self.is_pooling_model
                and not self.model_config.is_encoder_decoder
                and self.parallel_config.pipeline_parallel_size == 1
                and self.dcp_world_size == 1 and self.lookback_token_ids is None
                and not self.cache_config.kv_sharing_fast_prefill
                and not has_kv_transfer_group())

    def _steps_on_host(self) -> bool:
        """Whether this step can be prepared on the host: captured steps, none of the features
        whose inputs live only on the device."""
        batch = self.input_batch
        return (self._host_steps_configured()
                and (batch.prev_sampled_token_ids is None
                     or batch.prev_sampled_token_ids is self._last_sampled)
                and self.num_accepted_tokens_event is None
                and not self.num_prompt_logprobs
                and len(self.kv_cache_config.kv_cache_groups) == 1
                and len(batch.block_table.block_tables) == 1
                and all(isinstance(g.get_metadata_builder(), TpuAttentionMetadataBuilder)
                        and g.kernel_block_size is None
                        and not isinstance(g.kv_cache_spec, EncoderOnlyAttentionSpec)
                        for g in self.attn_groups[0]))

    def _prepare_on_host(self, num_scheduled_tokens: np.ndarray):
        """vLLM's input preparation of this step, in NumPy on its host buffers only.

        The values vLLM's ``_prepare_inputs`` computes (its host half, and what its device half
        derives: positions, sequence lengths, slot mapping, the rows to sample), left in host
        arrays that the captured forward reads at replay (:class:`HostFeeds`); no device op
        runs. Returns ``_prepare_inputs``'s answer: the program hands vLLM the hidden states of
        the sampled rows, first, so the rows to sample are the first ``num_reqs``.
        """
        batch = self.input_batch
        n = batch.num_reqs
        computed = batch.num_computed_tokens_cpu[:n]
        self._fill_host_step(num_scheduled_tokens, computed)
        tokens = int(num_scheduled_tokens.sum())
        rows, positions = self._req_rows[:tokens], self._host_positions[:tokens]
        self.input_ids.np[:tokens] = batch.token_ids_cpu[rows, positions]
        self._compute_prev_positions(n)
        # (with async scheduling) each request the last step sampled for: its token, the last
        # of its ids this step, is in that step's row of ``_last_tokens``
        prev = self.prev_positions.np[:n]
        self._host_prev_index.fill(-1)
        held = np.nonzero(prev >= 0)[0]
        self._host_prev_index[self.query_start_loc.np[1:n + 1][held] - 1] = prev[held]
        num_tokens = np.array([self.requests[r].num_tokens for r in batch.req_ids],
                              dtype=np.int64)
        seq_lens = self.optimistic_seq_lens_cpu.numpy()
        self.discard_request_mask.np[:n] = seq_lens[:n] < num_tokens
        self.num_accepted_tokens.np.fill(1)
        return slice(0, n), None, 1

    def _fill_host_step(self, counts: np.ndarray, computed: np.ndarray) -> None:
        """Host buffers of a step whose requests get ``counts`` tokens after ``computed`` ones:
        query starts, sequence lengths, positions, slot mapping, rows to sample. Padded
        requests query nothing, have length 0 and read block 0; padded tokens write slot -1."""
        n, tokens = len(counts), int(counts.sum())
        ends = np.cumsum(counts)
        rows = np.repeat(self.arange_np[:n], counts)
        self._req_rows = rows
        positions = self._host_positions
        positions[:tokens] = computed[rows] + self.arange_np[:tokens] - (ends - counts)[rows]
        positions[tokens:] = 0
        self.input_ids.np[tokens:] = 0
        self.query_start_loc.np[0] = 0
        self.query_start_loc.np[1:n + 1] = ends
        self.query_start_loc.np[n + 1:] = tokens
        seq_lens = self.optimistic_seq_lens_cpu.numpy()
        seq_lens[:n] = computed + counts
        seq_lens[n:] = 0
        table = self.input_batch.block_table[0]
        bs, blocks, slots = table.block_size, table.block_table.np, table.slot_mapping.np
        pos = positions[:tokens]
        slots[:tokens] = blocks[rows, pos // bs].astype(np.int64) * bs + pos % bs
        slots[tokens:] = -1
        self._host_sample_rows[:n] = ends - 1
        self._host_sample_rows[n:] = 0
        self._fed_reqs, self._fed_tokens = n, tokens
        self._fed_decode = bool((counts == 1).all())
        self._fed = self._host_feeds()

    def _host_feeds(self) -> HostFeeds:
        """The buffers a host-prepared step feeds its program, made once per input batch; each
        function reads the current step's values (a replay calls them)."""
        table = self.input_batch.block_table[0]
        if self._feeds is not None and self._feeds[0] is table:
            return self._feeds[1]
        blocks = table.block_table.np
        seq_lens = self.optimistic_seq_lens_cpu.numpy()
        padded = np.zeros_like(blocks)
        filled = [0]  # rows of ``padded`` holding a request's blocks

        def padded_blocks() -> np.ndarray:  # rows past the step's requests: the null block
            n = self._fed_reqs
            padded[:n] = blocks[:n]
            padded[n:filled[0]] = 0
            filled[0] = n
            return padded

        # the rows a step's program reads: its padded tokens' or requests' (+1: query starts)
        tokens, reqs, starts = (lambda t, r: t), (lambda t, r: r), (lambda t, r: r + 1)
        fed = HostFeeds()
        fed.add(self.input_ids.gpu, lambda: self.input_ids.np, tokens)
        fed.add(self.positions, lambda: self._host_positions, tokens)
        fed.add(self.query_start_loc.gpu, lambda: self.query_start_loc.np, starts)
        fed.add(self.seq_lens, lambda: seq_lens, reqs)
        fed.add(table.block_table.gpu, padded_blocks, reqs)
        fed.add(table.slot_mapping.gpu, lambda: table.slot_mapping.np, tokens)
        fed.add(self.is_padding, lambda: self.arange_np[:self.max_num_tokens] >= self._fed_tokens,
                tokens)
        fed.add(self._sample_rows, lambda: self._host_sample_rows, reqs)
        fed.add(self._prev_index, lambda: self._host_prev_index, tokens)
        self._feeds = (table, fed)
        return fed

    def head_of(self, buffer: torch.Tensor, n: int) -> torch.Tensor:
        """``buffer[:n]`` of a persistent tpu buffer, made once per buffer and bucket: a tpu
        view costs the engine thread ~0.03 ms (torchtpu's dispatch, in Python), and a step
        took a handful of them (the slot mapping, the attention metadata's three, the inputs')
        at every step of the same few buckets. The view shares the buffer's storage, so it
        reads what the step wrote there."""
        key = (id(buffer), n)
        got = self._views.get(key)
        if got is None or got[0] is not buffer:  # a new buffer under a reused id
            got = self._views[key] = (buffer, buffer[:n])
        return got[1]

    def _attention_layers(self) -> tuple[str, ...]:
        """The attention layers' names (of the first KV-cache group), made once per list of
        groups (vLLM makes a new one when it sets its KV caches up again)."""
        groups = self.attn_groups[0]
        if self._layers is None or self._layers[0] is not groups:
            self._layers = (groups, tuple(name for g in groups for name in g.layer_names))
        return self._layers[1]

    def step_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """A host-prepared step's token ids: the host's, and the last step's sampled tokens
        (still on the device, with async scheduling) where ``_prev_index`` points to them."""
        prev = self._prev_index[:input_ids.shape[0]]
        last = self._last_tokens.view(-1)[prev.clamp(min=0)].to(input_ids.dtype)
        return torch.where(prev >= 0, last, input_ids)

    def keep_tokens(self, tokens: torch.Tensor) -> None:
        """Keep a host-prepared step's greedy tokens (``[padded requests, 1]``) for the next
        step's ``step_input_ids``."""
        self._last_tokens[:tokens.shape[0]].copy_(tokens)

    def _context_tokens(self) -> int:
        """The longest context a request can read: the block table's width, in tokens."""
        table = self.input_batch.block_table[0]
        return table.block_table.np.shape[1] * table.block_size

    def capture_steps(self) -> tuple[int, int]:
        """Capture, compile and run once every padded step shape: decodes (each request
        bucket up to ``max_num_seqs`` x each context read, powers of two of blocks up to
        ``max_model_len``), each in its two programs (logits and tokens, or the tokens alone:
        ``sampling.py``), and steps with prefills (:func:`prefill_grid`), so that no request
        waits for a compile. The dummy steps write only the null block 0. Returns how many
        decode and prefill programs were captured."""
        if not self._steps_on_host():
            return 0, 0
        table = self.input_batch.block_table[0]
        bs, max_blocks = table.block_size, table.block_table.np.shape[1]
        graphs, max_len = self.step_graphs, self._context_tokens()
        contexts = sorted({min(1 << i, max_blocks) for i in range(max_blocks.bit_length() + 1)})
        heads = self._attention_heads
        if self.attn_groups[0][0].get_metadata_builder().paged:
            # the kernel reads pages: no context buckets, and no padded scores to budget
            contexts, heads = [max_blocks], 0
        grid = prefill_grid(self.max_num_tokens, self.max_num_reqs, max_len, heads)
        # room for every bucket: one dropped would compile again on a request's path
        variants = (False, True) if self._tokens_programs else (False,)
        shapes = len(_powers(self.max_num_reqs)) * len(contexts) * len(variants) + len(grid)
        graphs.max_captures = max(graphs.max_captures, 2 * shapes)
        before = graphs.captures
        for r in _powers(self.max_num_reqs):
            for blocks in contexts:
                for tokens_only in variants:
                    self._dummy_step(np.ones(r, dtype=np.int64), blocks * bs, tokens_only)
        decodes = graphs.captures - before
        for tokens, reqs in grid:
            tokens = min(tokens, reqs * max_len)  # a step this large pads to the bucket
            counts = np.full(reqs, tokens // reqs, dtype=np.int64)
            counts[: tokens % reqs] += 1
            self._dummy_step(counts, max_len)
        self._fed = self._sampled = None
        self._tokens_only = False
        return decodes, graphs.captures - before - decodes

    def _dummy_step(self, counts: np.ndarray, seq_len: int, tokens_only: bool = False) -> None:
        """One step of ``counts`` new tokens a request ending at ``seq_len``, host-fed (its
        program the tokens-only one if asked)."""
        n, tokens = len(counts), int(counts.sum())
        table = self.input_batch.block_table[0]
        self._fill_host_step(counts, np.full(n, seq_len, dtype=np.int64) - counts)
        self._tokens_only = tokens_only
        self.input_ids.np[:tokens] = 0
        table.slot_mapping.np[:] = -1  # the null block
        mode, desc, _, _, _ = self._determine_batch_execution_and_padding(
            num_tokens=tokens, num_reqs=n, num_scheduled_tokens_np=counts.astype(np.int32),
            max_num_scheduled_tokens=int(counts.max()), allow_microbatching=False)
        by_gid, by_layer = self._get_slot_mappings(desc.num_tokens, desc.num_reqs, tokens)
        attn_metadata, _ = self._build_attention_metadata(
            num_tokens=tokens, num_reqs=n, max_query_len=int(counts.max()),
            num_tokens_padded=desc.num_tokens, num_reqs_padded=desc.num_reqs,
            slot_mappings=by_gid)
        with set_forward_context(attn_metadata, self.vllm_config, num_tokens=desc.num_tokens,
                                 cudagraph_runtime_mode=mode, batch_descriptor=desc,
                                 slot_mapping=by_layer):
            self._model_forward(input_ids=self.input_ids.gpu[:desc.num_tokens],
                                positions=self.positions[:desc.num_tokens])
