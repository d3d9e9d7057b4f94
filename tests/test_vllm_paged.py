"""The tpu attention backend's paged path (``paged.py``) against its gathered path.

With ``TORCHTPU_VLLM_PAGED=on`` a layer writes its cache in the ragged paged-attention kernel's
layout (KV heads packed into 128-lane heads where they are narrower) and attends through
``torchtpu::ragged_paged_attention``, which off a TPU computes the kernel's attention densely
in XLA (JAX's Pallas kernel runs in neither of JAX's interpreters: bench/RESULTS.md); its
outputs must be the gathered path's for decodes, prefills, prefix hits and padded requests
in one step. vLLM venv only; skipped elsewhere. A few seconds.
"""

from __future__ import annotations

import pytest
import torch

BS = 4


def _backend():
    pytest.importorskip("vllm", reason="vLLM is not installed: "
                        "python -m torchtpu.integrations.vllm.install")
    from torchtpu.integrations.vllm import attention

    return attention


def _step(attention, monkeypatch, mode, heads, kv_heads, d):
    """One mixed step through a fresh layer: (outputs [tokens, heads, d], the cache)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    monkeypatch.setenv("TORCHTPU_VLLM_PAGED", mode)
    gen = torch.Generator().manual_seed(0)
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=kv_heads, head_size=d,
                             dtype=torch.float32)
    cache = attention.new_kv_cache(spec, num_blocks=16, device=torch.device("tpu"))
    impl = attention.TpuAttentionImpl(heads, d, d ** -0.5, kv_heads, None, None, "auto")
    assert impl.paged == (mode == "on")
    # request 0: a prefill of 7 written earlier, now a decode (position 7); request 1: a whole
    # prefill of 6; request 2: a prefix hit (5 cached, 3 new); request 3: padding (no tokens)
    tables = [[3, 9, 1], [0 + 5, 7], [2, 11, 4], []]
    cached, new = [7, 0, 5, 0], [1, 6, 3, 0]
    layer = torch.nn.Module()

    def slots(r, positions):
        return [tables[r][p // BS] * BS + p % BS for p in positions]

    earlier = [r for r in range(4) if cached[r]]
    before = [s for r in earlier for s in slots(r, range(cached[r]))]
    n0 = len(before)
    impl.do_kv_cache_update(layer, torch.randn(n0, kv_heads, d, generator=gen).tpu(),
                            torch.randn(n0, kv_heads, d, generator=gen).tpu(), cache,
                            torch.tensor(before).tpu())
    step = [s for r in range(4) for s in slots(r, range(cached[r], cached[r] + new[r]))]
    tokens = len(step) + 2  # two padded tokens: slot -1
    impl.do_kv_cache_update(layer, torch.randn(tokens, kv_heads, d, generator=gen).tpu(),
                            torch.randn(tokens, kv_heads, d, generator=gen).tpu(), cache,
                            torch.tensor(step + [-1, -1]).tpu())
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    seq = torch.tensor([c + n for c, n in zip(cached, new)], dtype=torch.int32)
    table = torch.zeros(4, 4, dtype=torch.int32)
    for r, pages in enumerate(tables):
        table[r, :len(pages)] = torch.tensor(pages, dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts.tpu(), query_start_loc_cpu=starts, seq_lens=seq.tpu(),
        num_reqs=4, num_actual_tokens=tokens, max_query_len=max(new),
        max_seq_len=int(seq.max()), block_table_tensor=table.tpu(),
        slot_mapping=torch.zeros(tokens).long().tpu(), causal=True)
    builder = attention.TpuAttentionMetadataBuilder(spec, ["layer"], None, torch.device("tpu"))
    md = builder.build(0, common)
    out = torch.zeros(tokens, heads, d).tpu()
    impl.forward(layer, torch.randn(tokens, heads, d, generator=gen).tpu(), None, None, cache,
                 md, out)
    return out.cpu()[:len(step)], cache.cpu()


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 64), (2, 1, 128), (8, 4, 32)],
                         ids=["two-heads-packed", "128-wide", "four-heads-packed"])
def test_paged_kernel_path_equals_the_gathered_path(monkeypatch, heads, kv_heads, d):
    attention = _backend()
    paged, paged_cache = _step(attention, monkeypatch, "on", heads, kv_heads, d)
    gathered, gathered_cache = _step(attention, monkeypatch, "off", heads, kv_heads, d)
    torch.testing.assert_close(paged, gathered, rtol=1e-5, atol=1e-5)
    # packed heads lay the cache out differently (the kernel's layout); 128-wide ones do not
    assert torch.equal(paged_cache, gathered_cache) == (d == 128)


def test_paged_mode_refuses_heads_it_cannot_pack(monkeypatch):
    _backend()
    from torchtpu.integrations.vllm import paged

    monkeypatch.setenv("TORCHTPU_VLLM_PAGED", "on")
    with pytest.raises(ValueError, match=r"torchtpu\.argument: TORCHTPU_VLLM_PAGED=on.*3 KV "
                                         r"heads of size 64"):
        paged.enabled(64, 3, "auto")
    monkeypatch.setenv("TORCHTPU_VLLM_PAGED", "auto")  # off a TPU: the gathered path
    assert not paged.enabled(64, 2, "auto")
    monkeypatch.setenv("TORCHTPU_VLLM_PAGED", "sometimes")
    with pytest.raises(ValueError, match=r"torchtpu\.config: TORCHTPU_VLLM_PAGED='sometimes'"):
        paged.enabled(64, 2, "auto")
