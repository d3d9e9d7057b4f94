"""The async step's bookkeeping (``integrations/vllm/bookkeeping.py``) against vLLM's own.

``async_bookkeeping`` replaces the per-request loop of vLLM's ``_bookkeeping_sync`` for an
async-scheduled step of one token a request; here both run on copies of the same runner state
(the fields the method reads and writes, no engine) and every value written and returned must
be equal, discarded requests (a chunked prefill's) and their generators included. No device and
no engine: fast. vLLM venv only.
"""

from __future__ import annotations

import copy
import types

import numpy as np
import pytest

pytest.importorskip("vllm", reason="vLLM is not installed")

import torch  # noqa: E402
from vllm.v1.outputs import SamplerOutput  # noqa: E402
from vllm.v1.worker.gpu_model_runner import GPUModelRunner  # noqa: E402

from torchtpu.integrations.vllm.bookkeeping import async_bookkeeping  # noqa: E402

MAX_LEN = 16


class _Generator:
    """The part of a torch.Generator vLLM's bookkeeping calls (a discarded row steps back)."""

    def __init__(self, offset: int) -> None:
        self.offset = offset

    def get_offset(self) -> int:
        return self.offset

    def set_offset(self, offset: int) -> None:
        self.offset = offset


def _runner(lengths: list[int], discarded: tuple = (), prev=None):
    """A runner's state for a step of len(lengths) requests (lengths: tokens each holds)."""
    n = len(lengths)
    ids = [f"r{i}" for i in range(n)]
    tokens = np.arange(n * MAX_LEN, dtype=np.int32).reshape(n, MAX_LEN)
    batch = types.SimpleNamespace(
        req_ids=ids, req_id_to_index={r: i for i, r in enumerate(ids)}, num_reqs=n,
        generators={i: _Generator(100 + i) for i in range(0, n, 2)},
        token_ids_cpu=tokens, is_token_ids=np.zeros((n, MAX_LEN), dtype=bool),
        num_tokens_no_spec=np.asarray(lengths, dtype=np.int32),
        prev_sampled_token_ids=prev, prev_req_id_to_index=None)
    mask = np.zeros(n + 3, dtype=bool)
    mask[list(discarded)] = True
    runner = types.SimpleNamespace(
        input_batch=batch, discard_request_mask=types.SimpleNamespace(np=mask),
        use_async_scheduling=True, max_model_len=MAX_LEN, num_prompt_logprobs={},
        requests={r: types.SimpleNamespace(output_token_ids=list(range(i))) for i, r in
                  enumerate(ids)})
    runner._get_prompt_logprobs_dict = types.MethodType(
        GPUModelRunner._get_prompt_logprobs_dict, runner)
    return runner


def _state(runner) -> dict:
    b = runner.input_batch
    return {"tokens": b.token_ids_cpu.tolist(), "is_token": b.is_token_ids.tolist(),
            "lengths": b.num_tokens_no_spec.tolist(), "prev_index": b.prev_req_id_to_index,
            "prev_tokens": id(b.prev_sampled_token_ids),
            "generators": {i: g.offset for i, g in b.generators.items()},
            "outputs": {r: s.output_token_ids for r, s in runner.requests.items()}}


def _both(runner, sampled: torch.Tensor):
    ours, theirs = runner, copy.deepcopy(runner)
    theirs._get_prompt_logprobs_dict = types.MethodType(
        GPUModelRunner._get_prompt_logprobs_dict, theirs)
    theirs.input_batch.prev_sampled_token_ids = ours.input_batch.prev_sampled_token_ids
    out = SamplerOutput(sampled_token_ids=sampled, logprobs_tensors=None)
    got = async_bookkeeping(ours, out)
    scheduled = types.SimpleNamespace(num_scheduled_tokens={})
    want = GPUModelRunner._bookkeeping_sync(theirs, scheduled, out, None,
                                            torch.zeros(len(sampled), 4), len(sampled))
    return got, want, ours, theirs


@pytest.mark.parametrize("discarded", [(), (1,), (0, 3, 4)])
@pytest.mark.parametrize("prev", [False, True])
def test_the_async_bookkeeping_writes_and_returns_what_vllms_does(discarded, prev):
    sampled = torch.arange(5, dtype=torch.int32)[:, None]
    held = torch.zeros(5, 1, dtype=torch.int32) if prev else None
    got, want, ours, theirs = _both(_runner([3, 7, 1, 12, 5], discarded, held), sampled)
    assert got == want
    assert _state(ours) == _state(theirs)
    # the state did change: the placeholders are there
    kept = [i for i in range(5) if i not in discarded]
    assert ours.input_batch.num_tokens_no_spec.tolist() == [
        n + (i in kept) for i, n in enumerate([3, 7, 1, 12, 5])]
    assert (ours.input_batch.prev_sampled_token_ids is sampled) is not prev


def test_a_token_past_max_model_len_raises_as_vllms():
    runner = _runner([3, MAX_LEN])
    with pytest.raises(AssertionError, match="exceed the max model length"):
        async_bookkeeping(runner, SamplerOutput(torch.zeros(2, 1, dtype=torch.int32), None))


def test_steps_it_does_not_serve_go_to_vllms():
    tokens = torch.zeros(2, 1, dtype=torch.int32)
    runner = _runner([3, 4])
    assert async_bookkeeping(runner, SamplerOutput(torch.zeros(2, 2, dtype=torch.int32),
                                                   None)) is None  # speculative tokens
    assert async_bookkeeping(runner, SamplerOutput(tokens, object())) is None  # logprobs
    runner.num_prompt_logprobs = {"r0": 1}
    assert async_bookkeeping(runner, SamplerOutput(tokens, None)) is None
    runner.num_prompt_logprobs, runner.use_async_scheduling = {}, False
    assert async_bookkeeping(runner, SamplerOutput(tokens, None)) is None
    assert runner.input_batch.num_tokens_no_spec.tolist() == [3, 4]  # nothing written
