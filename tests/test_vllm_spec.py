"""The input kernels of vLLM's model-based speculative proposers (draft model, EAGLE, MTP) on
"tpu" (``integrations/vllm/draft.py``) against vLLM's CPU platform's C++ versions of the same
Triton kernels. vLLM venv only; skipped elsewhere.
"""

from __future__ import annotations

import pytest
import torch
from test_vllm_features import _cpu_kernels


def _tpu(*tensors):
    return [t.tpu() for t in tensors]


def test_next_token_and_inputs_to_sample_match_vllms_cpu_kernels():
    ref = _cpu_kernels()
    from torchtpu.integrations.vllm import draft

    vocab, width = 50, 4
    # requests: all accepted, none accepted, one accepted, discarded, an out-of-vocab pad
    sampled = torch.tensor([[3, 4, 5, 6], [-1, -1, -1, -1], [7, -1, -1, -1], [8, 9, -1, -1],
                            [10, 11, vocab, -1]], dtype=torch.int32)
    discard = torch.tensor([False, False, False, True, False])
    backup = torch.tensor([40, 41, 42, 43, 44], dtype=torch.int32)
    outs = [torch.full((5,), -7, dtype=torch.int32) for _ in range(2)]
    want = [o.clone() for o in outs]
    ref._eagle_prepare_next_token_padded_kernel_impl(sampled, discard, backup, *want, vocab,
                                                     width, 5)
    got = _tpu(*outs)
    draft.prepare_next_token_padded(*_tpu(sampled, discard, backup), *got, vocab, width, 5)
    assert [g.cpu().tolist() for g in got] == [w.tolist() for w in want]
    assert want[0].tolist() == [6, 41, 7, 43, 11] and want[1].tolist() == [4, 0, 1, 0, 2]

    cu = torch.tensor([3, 3, 6, 9, 12], dtype=torch.int32)  # request 1 drafted nothing
    starts = torch.tensor([0, 4, 5, 9, 13, 17], dtype=torch.int32)
    valid = torch.tensor([4, 0, 1, 0, 2], dtype=torch.int32)  # the counts above
    outs = [torch.full((5,), -7, dtype=torch.int32) for _ in range(2)]
    want = [o.clone() for o in outs]
    ref._eagle_prepare_inputs_padded_kernel_impl(cu, valid, starts, *want, 5)
    got = _tpu(*outs)
    draft.prepare_inputs_padded(*_tpu(cu, valid, starts), *got, 5)
    assert [g.cpu().tolist() for g in got] == [w.tolist() for w in want]
    assert want[1].tolist() == [0, 0, 3, 4, 2]


def test_draft_step_slots_match_vllms_cpu_kernel():
    ref = _cpu_kernels()
    from torchtpu.integrations.vllm import draft

    block_size, max_len, batch, padded = 4, 16, 3, 5
    positions = torch.tensor([2, 7, 15])  # the last steps past the model's length
    table = torch.tensor([[5, 6, 7, 8], [1, 2, 3, 4], [9, 10, 11, 12]], dtype=torch.int32)
    lens = torch.tensor([3, 8, 16], dtype=torch.int32)
    outs = [torch.full((batch,), -7), torch.full((padded,), -7)]
    want = [o.clone() for o in outs]
    want_lens = lens.clone()
    ref._eagle_step_slot_mapping_metadata_kernel_impl(positions, table, 4, want_lens, want[0],
                                                      want[1][:batch], block_size, max_len, 4,
                                                      -1, batch)
    want[1][batch:] = -1  # the Triton kernel's padded programs
    got_lens, *got = _tpu(lens, *outs)
    draft.step_slot_mapping_metadata(*_tpu(positions, table), 4, got_lens, *got, block_size,
                                     max_len, 4, -1, batch)
    assert [g.cpu().tolist() for g in got] == [w.tolist() for w in want]
    assert got_lens.cpu().tolist() == want_lens.tolist() == [4, 9, 1]
    assert want[1].tolist() == [5 * 4 + 3, 3 * 4 + 0, -1, -1, -1]


@pytest.mark.parametrize("shift", [True, False])
def test_draft_inputs_copied_and_expanded_match_vllms_cpu_kernel(shift):
    ref = _cpu_kernels()
    from torchtpu.integrations.vllm import draft

    g = torch.Generator().manual_seed(0)
    # three requests: a 5-token prefill, a decode with 2 of 3 drafts rejected, one with none
    starts = torch.tensor([0, 5, 9, 12], dtype=torch.int32)
    ends = torch.tensor([4, 6, 11], dtype=torch.int32)
    t, pad = 12, 3
    ids = torch.randint(0, 100, (t,), generator=g)
    pos = torch.cat([torch.arange(5), torch.arange(20, 24), torch.arange(7, 10)])
    nxt = torch.tensor([101, 102, 103])
    n = t + 3 * (pad - int(shift))
    outs = [torch.full((n + 2,), -7), torch.full((n + 2,), -7),
            torch.zeros(n + 2, dtype=torch.bool), torch.zeros(n + 2, dtype=torch.bool),
            torch.full((3 * pad,), -7, dtype=torch.int32), torch.full((t,), -7, dtype=torch.int32)]
    want = [o.clone() for o in outs]
    ref._copy_and_expand_eagle_inputs_kernel_impl(ids, pos, nxt, *want, starts, ends, 0, 99, t,
                                                  pad, shift)
    got = _tpu(*outs)
    draft.copy_and_expand_inputs(*_tpu(ids, pos, nxt), *got, *_tpu(starts, ends), 0, 99, t,
                                 pad, shift)
    for name, a, b in zip(("ids", "positions", "rejected", "masked", "new", "hidden"), got, want):
        assert a.cpu().tolist() == b.tolist(), name
    assert want[2].any() and want[3].any()  # both the rejected and the parallel slots


@pytest.mark.full  # an engine of its own: minutes
def test_draft_model_speculation_keeps_the_greedy_tokens(tmp_path):
    """A 1-layer draft cut from the 2-layer tiny Llama proposes 3 tokens a step: the target's
    greedy tokens are HF's (= no speculation, tests/test_vllm.py), some drafts accepted."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from test_vllm_features import check_speculation

    from torchtpu.integrations.vllm.draft import save_draft_model
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    target = str(save_tiny_model(tmp_path / "target", "llama"))
    drafter = str(save_draft_model(target, tmp_path / "draft", layers=1))
    check_speculation(target, {"method": "draft_model", "model": drafter,
                               "num_speculative_tokens": 3}, "draft-model")
