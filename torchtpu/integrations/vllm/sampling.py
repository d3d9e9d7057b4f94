"""A host-prepared step's sampled tokens: the program's greedy tokens handed to vLLM's sampler,
and the decode steps whose program leaves the logits out.

Each host-prepared step's program computes the logits of its sampled rows and their greedy
tokens (``worker._model_forward``). vLLM's calls after the forward get those: its
``compute_logits`` returns the program's logits and its sampler takes the program's tokens
where every request is greedy without logprobs and no logits processor changed the logits
(:class:`ProgramSampling`).

Where nothing but the argmax will read the logits (:func:`why_logits` says None), a decode
step runs a second program of its bucket that returns the tokens alone: the float32 logits are
then neither written nor kept (at 64 requests of Qwen2.5-0.5B, [64, 151,936] float32 = 39 MB a
step of HBM writes). That is decided before the forward, from the sampling metadata and the
scheduler's output, and every fact the decision read is checked again at ``sample_tokens``
(the grammar's bitmask there, the metadata): if one no longer holds, the logits are computed
from the program's hidden rows and vLLM's sampler runs on them as on any step.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import torch
from vllm import envs
from vllm.v1.outputs import SamplerOutput
from vllm.v1.sample.logits_processor.builtin import (
    LogitBiasLogitsProcessor,
    MinTokensLogitsProcessor,
)

from torchtpu import metrics, settings
from torchtpu.eager.capture import storage_of


# "1" (default): an all-greedy decode step without logprobs or logits processors runs its
# bucket's tokens-only program, both variants of each decode bucket compiled at start-up; "0":
# every step writes its logits (half the decode compiles at start-up)
def tokens_only_enabled() -> bool:
    """Whether decode steps may run their tokens-only programs (``TORCHTPU_VLLM_TOKENS_ONLY``)."""
    return settings.VLLM_TOKENS_ONLY.get()


# vLLM's built-in processors that can change an argmax, each with the state that is empty when
# it leaves the logits as they are (its ``apply`` returns them untouched then)
_IDLE_WHEN_EMPTY = {MinTokensLogitsProcessor: "min_toks", LogitBiasLogitsProcessor: "biases"}


def why_logits(meta, grammar: bool) -> str | None:
    """What of this step's sampling reads its logits beyond their argmax, or None where the
    program's greedy tokens are vLLM's sampler's answer: each fact vLLM's ``Sampler.forward``
    and the runner's ``sample_tokens`` branch on for greedy requests. ``meta``: the input
    batch's ``SamplingMetadata``; ``grammar``: a structured-output request is scheduled."""
    if not meta.all_greedy:
        return "random sampling"
    if meta.max_num_logprobs is not None or meta.logprob_token_ids:
        return "logprobs"
    if grammar:
        return "structured output"
    if meta.allowed_token_ids_mask is not None:
        return "allowed token ids"
    if meta.bad_words_token_ids:
        return "bad words"
    if not meta.no_penalties:
        return "penalties"
    for processor in meta.logitsprocs.non_argmax_invariant:
        state = _IDLE_WHEN_EMPTY.get(type(processor))
        if state is None or getattr(processor, state):
            return f"logits processor {type(processor).__name__}"
    holder = meta.thinking_budget_state_holder
    if holder is not None and holder.has_tracked_requests():
        return "thinking budget"
    if envs.VLLM_COMPUTE_NANS_IN_LOGITS:
        return "NaN counts"
    return None


@dataclasses.dataclass
class ProgramSample:
    """What a host-prepared step's program sampled, cut to the step's ``n`` requests."""

    n: int
    hidden: torch.Tensor  # the program's sampled rows' hidden states [padded requests, hidden]
    logits: torch.Tensor | None  # float32 [n, vocab]; None: the program left them out
    logits_array: object  # the array the program left in the logits' storage (None: no logits)
    tokens: torch.Tensor  # greedy tokens [n, 1] int32 (vLLM's sampler's column)
    padded: torch.Tensor  # the program's tokens of every padded request


class ProgramSampling:
    """The tpu model runner's sampling of host-prepared steps from their programs' outputs."""

    def _init_program_sampling(self) -> None:
        self._sampled: ProgramSample | None = None
        self._tokens_programs = tokens_only_enabled()
        self._tokens_only = False  # whether this step runs its bucket's tokens-only program

    def _leaves_logits_out(self, scheduler_output) -> bool:
        """Whether this host-prepared step may run its tokens-only program (decided before its
        forward; :meth:`sample_tokens` checks the same facts again)."""
        return (self._tokens_programs and self._fed_decode
                and why_logits(self.input_batch.sampling_metadata,
                               scheduler_output.has_structured_output_requests) is None)

    def _program_sampled(self, out: tuple, n: int) -> torch.Tensor:
        """Keep what the step's program returned ((hidden, logits, tokens), or (hidden,
        tokens) for a tokens-only program) for vLLM's calls after the forward; returns the
        hidden states."""
        hidden, *logits, tokens = out
        kept = logits[0][:n] if logits else None
        array = storage_of(logits[0])._tpu_array if logits else None
        if not logits:
            metrics.count("vllm_tokens_only_steps")
        self._sampled = ProgramSample(n, hidden, kept, array, tokens[:n], tokens)
        return hidden

    def _captured_logits(self, hidden_states: torch.Tensor, *args, **kwargs):
        sampled = self._sampled
        if sampled is not None and not args and not kwargs \
                and hidden_states.shape[0] == sampled.n:
            return sampled.logits  # None for a tokens-only program (see sample_tokens)
        return self._model_compute_logits(hidden_states, *args, **kwargs)

    def sample_tokens(self, grammar_output):
        sampled, state = self._sampled, self.execute_model_state
        if (sampled is not None and sampled.logits is None and state is not None
                and (grammar_output is not None or why_logits(
                    self.input_batch.sampling_metadata,
                    state.scheduler_output.has_structured_output_requests) is not None)):
            # a fact the step's tokens-only program was chosen on no longer holds: its logits,
            # from the program's hidden rows, for vLLM's sampler
            metrics.count("vllm_tokens_only_logits_computed")
            with torch.inference_mode():
                logits = self._model_compute_logits(sampled.hidden[:sampled.n]).float()
            sampled.logits, sampled.logits_array = logits, storage_of(logits)._tpu_array
            self.execute_model_state = state._replace(logits=logits)
        return super().sample_tokens(grammar_output)

    def _sample(self, logits, spec_decode_metadata):
        """vLLM's sampler where every request samples greedily without logprobs, with the
        program's greedy tokens (already vLLM's int32 column) where no logits processor changed
        the program's logits (a processor that writes them in place rebinds their storage)."""
        sampled = self._sampled
        meta = self.input_batch.sampling_metadata
        if (sampled is not None and spec_decode_metadata is None and logits is None
                and sampled.logits is None):
            # a tokens-only program: sample_tokens found nothing that reads the logits
            self.input_batch.update_async_output_token_ids()
            tokens = self._last_sampled = sampled.tokens
            return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)
        if (sampled is None or spec_decode_metadata is not None or logits is not sampled.logits
                or logits.dtype != torch.float32 or not meta.all_greedy
                or meta.max_num_logprobs is not None or meta.logprob_token_ids):
            # vLLM compiles its sampler's small helpers (the logprobs' rank count, top-k/top-p)
            # with the platform's simple backend; on tpu that backend runs the ops eagerly all
            # the same, so Dynamo's trace of them (~0.3 s in each new process, a third of a warm
            # GRPO first step's CPU: bench/RESULTS.md, rl7) bought nothing
            with torch.compiler.set_stance("force_eager"):
                out = super()._sample(logits, spec_decode_metadata)
            if sampled is not None and spec_decode_metadata is None:
                self._keep_sampled(out.sampled_token_ids)
            return out
        self.input_batch.update_async_output_token_ids()
        processed = self.sampler.apply_logits_processors(logits, meta, False)
        if processed is logits and storage_of(logits)._tpu_array is sampled.logits_array:
            tokens = self._last_sampled = sampled.tokens
        else:  # the rest of Sampler.forward for greedy requests without logprobs
            tokens = self.sampler.greedy_sample(processed).to(torch.int32)[:, None]
            self._keep_sampled(tokens)
        return SamplerOutput(sampled_token_ids=tokens, logprobs_tensors=None)

    def _keep_sampled(self, tokens: torch.Tensor) -> None:
        """With async scheduling, a host-prepared step's tokens sampled outside its program
        (random sampling, logprobs, a grammar's mask): kept where the next step's program
        reads the last tokens (one copy), so that it too is prepared on the host."""
        if self.use_async_scheduling and tokens.dim() == 2 and tokens.shape[1] == 1:
            self.keep_tokens(tokens)
            self._last_sampled = tokens

    def _to_list(self, sampled_token_ids: torch.Tensor) -> list[list[int]]:
        # the program's tokens: its whole padded array read to the host, cut there
        sampled = self._sampled
        if sampled is not None and sampled_token_ids is sampled.tokens:
            n = sampled_token_ids.shape[0]
            padded = np.asarray(storage_of(sampled.padded)._tpu_array).reshape(-1)
            return padded[:n, None].tolist()
        return super()._to_list(sampled_token_ids)
