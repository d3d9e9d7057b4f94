"""vLLM's bookkeeping after an async-scheduled step's sampling, with its per-request loop in NumPy.

With async scheduling the sampled tokens stay on the device, and vLLM's GPU runner
(``_bookkeeping_sync``) writes a placeholder (-1) for each request's next token into the input
batch's host arrays and the request's output list, one request at a time: ~0.47 ms of the engine
thread's ~7.5 ms a decode step at 64 requests on XLA:CPU (bench/RESULTS.md, serving17), where
the step is host-bound on the v5e too (4.0 ms a step, 2.49 of device). :func:`async_bookkeeping`
does the same writes as NumPy index writes over the requests at once and leaves only the
output lists' appends to Python, and skips the slice of the hidden states vLLM makes for the
prompt logprobs when no request asks for them (a tpu view is torchtpu's dispatch, in Python).

It serves only what vLLM's async branch does for one token a request without logprobs, NaN
counts or prompt logprobs; anything else returns None and vLLM's own method runs.
``tests/test_vllm_bookkeeping.py`` runs both on the same state and compares every value written
and returned, so a vLLM whose bookkeeping changes fails there.
"""

from __future__ import annotations

import numpy as np
from vllm import envs

PLACEHOLDER = -1  # vLLM's id for a token still on the device


def async_bookkeeping(runner, sampler_output) -> tuple | None:
    """``GPUModelRunner._bookkeeping_sync``'s answer and writes for an async-scheduled step that
    sampled one token a request without logprobs; None where vLLM's own must run."""
    sampled = sampler_output.sampled_token_ids
    if (not runner.use_async_scheduling or envs.VLLM_COMPUTE_NANS_IN_LOGITS
            or sampler_output.logprobs_tensors is not None or runner.num_prompt_logprobs
            or sampled.dim() != 2 or sampled.shape[-1] != 1):
        return None
    batch = runner.input_batch
    num_reqs = batch.num_reqs
    discarded = np.nonzero(runner.discard_request_mask.np[:num_reqs])[0]
    for i in discarded:  # (their random generators step back, as vLLM's do)
        gen = batch.generators.get(int(i))
        if gen is not None:
            gen.set_offset(gen.get_offset() - 4)
    req_ids = batch.req_ids
    # copies, since the batch changes while the engine holds the step's output
    req_ids_copy, index_copy = req_ids.copy(), batch.req_id_to_index.copy()
    invalid = discarded.tolist()
    if batch.prev_sampled_token_ids is None:
        batch.prev_sampled_token_ids = sampled
    rows = np.arange(sampled.shape[0])
    if invalid:
        skip = set(invalid)
        batch.prev_req_id_to_index = {r: i for i, r in enumerate(req_ids) if i not in skip}
        rows = np.delete(rows, discarded[discarded < rows.size])
    else:
        batch.prev_req_id_to_index = {r: i for i, r in enumerate(req_ids)}
    start = batch.num_tokens_no_spec[rows]
    if rows.size and int(start.max()) + 1 > runner.max_model_len:
        raise AssertionError(
            "Sampled token IDs exceed the max model length. Total number of tokens: "
            f"{int(start.max()) + 1} > max_model_len: {runner.max_model_len}")
    batch.token_ids_cpu[rows, start] = PLACEHOLDER
    batch.is_token_ids[rows, start] = True
    batch.num_tokens_no_spec[rows] = start + 1
    requests = runner.requests
    for i in rows.tolist():
        requests[req_ids[i]].output_token_ids.append(PLACEHOLDER)
    # no prompt logprobs asked (checked above): vLLM's dict of them is empty
    return {}, None, None, [], {}, req_ids_copy, index_copy, invalid
