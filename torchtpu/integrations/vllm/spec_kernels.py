"""vLLM's rejection-sampling Triton kernels (speculative decoding) as torch ops on "tpu".

A step with draft tokens (n-gram, EAGLE, a draft model) scores every draft position with the
target model and keeps each request's longest accepted run of drafts plus one token of the
target's own: the first rejected position gets the target's token (greedy) or a token resampled
from the residual distribution (random), a request whose drafts were all accepted gets its bonus
token. vLLM writes those loops as one Triton program per request; here each is a few batched
ops over ``[requests, max_spec_len]``, so they run on the device (and inside a captured step).
Each function takes the Triton kernel's arguments by name (``kernels.register`` installs them)
and writes its outputs in place, leaving every slot it does not write untouched, as the
kernels do (vLLM pre-fills the output with its placeholder id).
"""

from __future__ import annotations

import torch


def _request_of_token(cu_num_tokens: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """The request each of ``num_tokens`` tokens belongs to, from inclusive cumulative counts."""
    token = torch.arange(num_tokens, device=cu_num_tokens.device, dtype=cu_num_tokens.dtype)
    request = torch.searchsorted(cu_num_tokens, token, right=True)
    return request.clamp(max=max(cu_num_tokens.shape[0] - 1, 0))


def _draft_positions(cu_num_draft_tokens: torch.Tensor, max_spec_len: int, num_tokens: int):
    """(flat index [R, S], valid [R, S], drafts per request [R]); an invalid position's index
    is ``num_tokens``, the zero row :func:`_at` appends."""
    cu = cu_num_draft_tokens.long()
    counts = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
    pos = torch.arange(max_spec_len, device=cu.device)
    valid = pos < counts[:, None]
    index = torch.where(valid, cu[:, None] - counts[:, None] + pos, num_tokens)
    return index, valid, counts


def _at(src: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``src[index]`` where ``index`` may be ``len(src)``: that reads a row of zeros."""
    return torch.cat([src, src.new_zeros((1, *src.shape[1:]))])[index]


def _write_accepted(output: torch.Tensor, tokens: torch.Tensor, accepted: torch.Tensor,
                    valid: torch.Tensor, counts: torch.Tensor, bonus: torch.Tensor,
                    rows: torch.Tensor) -> None:
    """Write each row's tokens up to and including its first rejection, and its bonus token
    after them if none was rejected; only ``rows`` (a [R] bool) are written."""
    ok = (accepted | ~valid).long()
    column = (ok.shape[0], 1)
    # a position is written while every draft before it was accepted
    before_ok = torch.cat([ok.new_ones(column), ok[:, :-1]], dim=1).cumprod(dim=1) > 0
    write = valid & before_ok & rows[:, None]
    all_ok = ok.prod(dim=1) > 0
    cols = torch.arange(output.shape[1], device=output.device)
    put_bonus = (cols == counts[:, None]) & (all_ok & rows)[:, None]
    # the bonus column past the last draft: never a draft's token
    written = torch.cat([write, write.new_zeros(column)], dim=1)
    padded = torch.cat([tokens, tokens.new_zeros(column)], dim=1)
    new = torch.where(written, padded.to(output.dtype), output)
    new = torch.where(put_bonus, bonus.reshape(-1, 1).to(output.dtype), new)
    output.copy_(new)


def rejection_greedy_sample(output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr,
                            target_argmax_ptr, bonus_token_ids_ptr, is_greedy_ptr, max_spec_len,
                            uniform_probs_ptr=None, synthetic_conditional_rates_ptr=None,
                            SYNTHETIC_MODE: bool = False) -> None:  # noqa: N803
    """Greedy rows: drafts accepted while they equal the target's argmax."""
    out = output_token_ids_ptr
    index, valid, counts = _draft_positions(cu_num_draft_tokens_ptr, out.shape[1] - 1,
                                            draft_token_ids_ptr.shape[0])
    draft = _at(draft_token_ids_ptr.long(), index)
    target = _at(target_argmax_ptr.long(), index)
    if SYNTHETIC_MODE:
        rate = synthetic_conditional_rates_ptr[: index.shape[1]]
        accepted = (_at(uniform_probs_ptr, index) < rate) & (draft >= 0)
        tokens = torch.where(accepted, draft, target)
    else:
        accepted = draft == target
        tokens = target
    rows = (torch.ones_like(counts, dtype=torch.bool) if is_greedy_ptr is None
            else is_greedy_ptr.bool())
    _write_accepted(out, tokens, accepted, valid, counts, bonus_token_ids_ptr, rows)


def rejection_random_sample(output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr,
                            draft_probs_ptr, target_probs_ptr, bonus_token_ids_ptr,
                            recovered_token_ids_ptr, uniform_probs_ptr, is_greedy_ptr,
                            max_spec_len, vocab_size, synthetic_conditional_rates_ptr=None,
                            NO_DRAFT_PROBS: bool = False,  # noqa: N803
                            SYNTHETIC_MODE: bool = False) -> None:  # noqa: N803
    """Random rows: a draft is accepted with probability min(1, target / draft)."""
    out = output_token_ids_ptr
    index, valid, counts = _draft_positions(cu_num_draft_tokens_ptr, out.shape[1] - 1,
                                            draft_token_ids_ptr.shape[0])
    draft = _at(draft_token_ids_ptr.long(), index)
    u = _at(uniform_probs_ptr, index)
    if SYNTHETIC_MODE:
        accepted = u < synthetic_conditional_rates_ptr[: index.shape[1]]
    else:
        picked = draft.clamp(min=0)[..., None]
        target_p = _at(target_probs_ptr, index).gather(-1, picked)[..., 0].to(u.dtype)
        if NO_DRAFT_PROBS or draft_probs_ptr is None:
            draft_p = torch.ones_like(target_p)
        else:
            draft_p = _at(draft_probs_ptr, index).gather(-1, picked)[..., 0].to(u.dtype)
        # a zero draft probability would divide by zero: rejected, as the kernel does
        accepted = (draft_p > 0) & (target_p / torch.where(draft_p > 0, draft_p, 1) >= u)
    accepted = accepted & (draft >= 0)  # -1 pads a request's drafts: rejected
    tokens = torch.where(accepted, draft, _at(recovered_token_ids_ptr.long(), index))
    _write_accepted(out, tokens, accepted, valid, counts, bonus_token_ids_ptr,
                    ~is_greedy_ptr.bool())


def expand(output_ptr, input_ptr, cu_num_tokens_ptr, replace_from, replace_to,
           MAX_NUM_TOKENS: int = 0) -> None:  # noqa: N803
    """Each request's value repeated over its tokens (``replace_from`` becomes ``replace_to``)."""
    values = torch.where(input_ptr == replace_from,
                         torch.full_like(input_ptr, replace_to), input_ptr)
    n = output_ptr.shape[0]
    if n:
        output_ptr.copy_(values[_request_of_token(cu_num_tokens_ptr, n)])


def sample_recovered_tokens(output_token_ids_ptr, cu_num_draft_tokens_ptr, draft_token_ids_ptr,
                            draft_probs_ptr, target_probs_ptr, inv_q_ptr, vocab_size,
                            BLOCK_SIZE: int = 0, NO_DRAFT_PROBS: bool = False,  # noqa: N803
                            USE_FP64_GUMBEL: bool = False) -> None:  # noqa: N803
    """The token each draft position falls back to: argmax of the residual distribution
    (target minus draft, or the target without the draft token) over the request's noise."""
    n = output_token_ids_ptr.shape[0]
    if n == 0:
        return
    request = _request_of_token(cu_num_draft_tokens_ptr, n)
    target = target_probs_ptr[:n]
    if NO_DRAFT_PROBS or draft_probs_ptr is None:
        vocab = torch.arange(target.shape[1], device=target.device)
        residual = torch.where(vocab == draft_token_ids_ptr[:n].long()[:, None],
                               torch.zeros_like(target), target)
    else:
        residual = (target - draft_probs_ptr[:n]).clamp(min=0)
    score = residual.to(inv_q_ptr.dtype) * inv_q_ptr[request]
    output_token_ids_ptr.copy_(score.argmax(dim=-1).to(output_token_ids_ptr.dtype))


# vLLM's qualified kernel names (vllm.triton_utils.dispatcher) -> the versions here
OVERRIDES = {
    "vllm.v1.sample.rejection_sampler.rejection_greedy_sample_kernel": rejection_greedy_sample,
    "vllm.v1.sample.rejection_sampler.rejection_random_sample_kernel": rejection_random_sample,
    "vllm.v1.sample.rejection_sampler.expand_kernel": expand,
    "vllm.v1.sample.rejection_sampler.sample_recovered_tokens_kernel": sample_recovered_tokens,
}
