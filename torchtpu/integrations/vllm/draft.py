"""Draft-model speculative decoding on "tpu": the proposers' input kernels, and tiny drafts.

vLLM's model-based proposers (a draft model, EAGLE, MTP) prepare each drafting step with Triton
kernels of ``vllm.v1.spec_decode.utils``: the next token of each request from its sampled ones,
the token to sample from after rejections, the slots and positions of each autoregressive draft
step, and the draft's inputs copied and expanded from the target's. Triton cannot take "tpu"
tensors; here each is a few batched torch ops over the requests (no loop, no host read), taking
the kernel's arguments in its order (pointers become tensors) and writing its outputs in place.
:func:`register` installs them; ``speculative_config={"method": "draft_model", ...}`` runs on
them (EAGLE and MTP are still refused: not tried).

A draft proposes tokens that the target model then checks; it must share the target's
tokenizer and vocabulary. :func:`save_draft_model` writes the first ``layers`` decoder layers
of a Hugging Face causal LM (its embeddings, final norm and output head kept) with the target's
tokenizer: a shallower copy of the target, which agrees with it on part of its greedy picks, so
both the accepted and the rejected branches of speculation run.
"""

from __future__ import annotations

from pathlib import Path

import torch


def prepare_next_token_padded(sampled_token_ids: torch.Tensor,
                              discard_request_mask: torch.Tensor,
                              backup_next_token_ids: torch.Tensor,
                              next_token_ids: torch.Tensor,
                              valid_sampled_tokens_count: torch.Tensor, vocab_size: int,
                              num_sampled_tokens_per_req: int, num_reqs: int,
                              stride_sampled_token_ids: int = 0,
                              BLOCK_SIZE_TOKENS: int = 0) -> None:  # noqa: N803
    """Each request's last valid sampled token (rejected ones are -1) and how many are valid;
    its backup token where none is, or where the request is discarded (count 0 then)."""
    rows = sampled_token_ids.reshape(-1, sampled_token_ids.shape[-1])
    rows = rows[:num_reqs, :num_sampled_tokens_per_req].long()
    valid = (rows != -1) & (rows < vocab_size)
    count = valid.sum(1)
    offsets = torch.arange(rows.shape[1], device=rows.device)
    last = torch.where(valid, offsets, -1).amax(1).clamp(min=0)
    token = rows.gather(1, last[:, None])[:, 0]
    discard = discard_request_mask[:num_reqs].bool()
    backup = backup_next_token_ids[:num_reqs].long()
    next_token_ids[:num_reqs] = torch.where(discard | (count == 0), backup, token).to(
        next_token_ids.dtype)
    valid_sampled_tokens_count[:num_reqs] = torch.where(discard, 0, count).to(
        valid_sampled_tokens_count.dtype)


def prepare_inputs_padded(cu_num_draft_tokens: torch.Tensor,
                          valid_sampled_tokens_count: torch.Tensor,
                          query_start_loc_gpu: torch.Tensor,
                          token_indices_to_sample: torch.Tensor,
                          num_rejected_tokens_gpu: torch.Tensor, num_reqs: int) -> None:
    """Each request's rejected drafts and the index of the token to sample from: its query's
    last token less the rejected ones (requests without drafts reject none)."""
    cu = cu_num_draft_tokens[:num_reqs].long()
    drafts = cu - torch.cat([cu.new_zeros(1), cu[:-1]])
    rejected = torch.where(drafts > 0, drafts + 1 - valid_sampled_tokens_count[:num_reqs].long(),
                           0)
    last = query_start_loc_gpu[1:num_reqs + 1].long() - 1
    token_indices_to_sample[:num_reqs] = (last - rejected).to(token_indices_to_sample.dtype)
    num_rejected_tokens_gpu[:num_reqs] = rejected.to(num_rejected_tokens_gpu.dtype)


def step_slot_mapping_metadata(positions: torch.Tensor, block_table: torch.Tensor,
                               block_table_stride: int, seq_lens: torch.Tensor,
                               out_clamped_positions: torch.Tensor,
                               out_slot_mapping: torch.Tensor, block_size: int,
                               max_model_len: int, n_blocks_per_req: int, PAD_ID: int,  # noqa: N803
                               batch_size: int | None = None) -> None:
    """One autoregressive draft step: positions + 1 (0 past the model's length, whose slot is
    the pad id and whose length restarts at 1), their cache slots, lengths + 1; slots of the
    padded requests past ``batch_size`` get the pad id."""
    b = positions.shape[0] if batch_size is None else batch_size
    new = positions[:b].long() + 1
    over = new >= max_model_len
    clamped = torch.where(over, 0, new)
    block = (clamped // block_size).clamp(max=n_blocks_per_req - 1)
    ids = block_table[:b].long().gather(1, block[:, None])[:, 0]
    slot = torch.where(over, PAD_ID, ids * block_size + clamped % block_size)
    lens = torch.where(over, 1, seq_lens[:b].long() + 1).clamp(max=max_model_len)
    out_clamped_positions[:b] = clamped.to(out_clamped_positions.dtype)
    out_slot_mapping[:b] = slot.to(out_slot_mapping.dtype)
    out_slot_mapping[b:] = PAD_ID
    seq_lens[:b] = lens.to(seq_lens.dtype)


def copy_and_expand_inputs(target_token_ids_ptr: torch.Tensor,
                           target_positions_ptr: torch.Tensor, next_token_ids_ptr: torch.Tensor,
                           out_input_ids_ptr: torch.Tensor, out_positions_ptr: torch.Tensor,
                           out_is_rejected_token_mask_ptr: torch.Tensor,
                           out_is_masked_token_mask_ptr: torch.Tensor,
                           out_new_token_indices_ptr: torch.Tensor,
                           out_hidden_state_mapping_ptr: torch.Tensor,
                           query_start_loc_ptr: torch.Tensor, query_end_loc_ptr: torch.Tensor,
                           padding_token_id: int, parallel_drafting_token_id: int,
                           total_input_tokens: int, num_padding_slots_per_request: int,
                           shift_input_ids: bool, BLOCK_SIZE_TOKENS: int = 0,  # noqa: N803
                           BLOCK_SIZE_REQS: int = 0) -> None:  # noqa: N803
    """The draft's inputs from the target's: per request its valid tokens (shifted by one
    when ``shift_input_ids``), the bonus token, ``num_padding_slots_per_request - 1`` parallel
    drafting slots, then its rejected slots (padding id, position 0); positions count on from
    the request's first; the indices of its new (bonus and parallel) tokens; and, shifted,
    where each target token's hidden state goes."""
    dev = target_token_ids_ptr.device
    p, shift, t = num_padding_slots_per_request, int(bool(shift_input_ids)), total_input_tokens
    r = query_end_loc_ptr.shape[0]
    starts = query_start_loc_ptr[:r + 1].long()
    ends = query_end_loc_ptr[:r].long()
    req = torch.arange(r, device=dev)
    valid = ends - starts[:-1] + 1 - shift  # [R]
    out_start = starts[:-1] + req * (p - shift)  # [R]
    n = t + r * (p - shift)  # every request's outputs, back to back
    o = torch.arange(n, device=dev)
    of = torch.searchsorted(out_start, o, right=True) - 1  # request of each output
    j = o - out_start[of]
    nv = valid[of]
    rejected = j >= nv + p
    parallel = (j > nv) & (j < nv + p)
    source = (starts[:-1][of] + shift + j).clamp(max=t - 1)
    ids = torch.where(j < nv, target_token_ids_ptr.long()[source], 0)
    ids = torch.where(j == nv, next_token_ids_ptr.long()[of], ids)
    ids = torch.where(parallel, parallel_drafting_token_id, ids)
    ids = torch.where(rejected, padding_token_id, ids)
    first = target_positions_ptr.long()[starts[:-1].clamp(max=t - 1)][of]
    out_input_ids_ptr[:n] = ids.to(out_input_ids_ptr.dtype)
    out_positions_ptr[:n] = torch.where(rejected, 0, first + j).to(out_positions_ptr.dtype)
    out_is_rejected_token_mask_ptr[:n] = rejected
    out_is_masked_token_mask_ptr[:n] = parallel
    new = out_start[:, None] + valid[:, None] + torch.arange(p, device=dev)  # [R, P]
    out_new_token_indices_ptr[:r * p] = new.reshape(-1).to(out_new_token_indices_ptr.dtype)
    if shift:
        i = torch.arange(t, device=dev)
        ri = torch.searchsorted(starts[1:], i, right=True).clamp(max=r - 1)
        out_hidden_state_mapping_ptr[:t] = (out_start[ri] + i - starts[ri]).to(
            out_hidden_state_mapping_ptr.dtype)


OVERRIDES = {
    "vllm.v1.spec_decode.utils.eagle_prepare_next_token_padded_kernel": prepare_next_token_padded,
    "vllm.v1.spec_decode.utils.eagle_prepare_inputs_padded_kernel": prepare_inputs_padded,
    "vllm.v1.spec_decode.utils.eagle_step_slot_mapping_metadata_kernel":
        step_slot_mapping_metadata,
    "vllm.v1.spec_decode.utils.copy_and_expand_eagle_inputs_kernel": copy_and_expand_inputs,
}


def register() -> None:
    """Point vLLM's proposer input kernels at these (each worker, before its model is built)."""
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels(OVERRIDES)


def save_draft_model(target: str | Path, path: str | Path, layers: int = 1) -> Path:
    """Write ``target``'s first ``layers`` decoder layers and tokenizer to ``path``."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    model = AutoModelForCausalLM.from_pretrained(target, dtype=torch.float32)
    total = model.config.num_hidden_layers
    if not 1 <= layers <= total:
        raise ValueError(f"torchtpu.argument: layers={layers} is not within 1..{total} (the "
                         "target's decoder layers)")
    model.model.layers = model.model.layers[:layers]
    model.config.num_hidden_layers = layers
    if getattr(model.config, "layer_types", None):
        model.config.layer_types = model.config.layer_types[:layers]
    path = Path(path)
    model.save_pretrained(path)
    AutoTokenizer.from_pretrained(target).save_pretrained(path)
    return path
