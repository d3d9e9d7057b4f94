"""The tpu attention backend alone, against attention on CPU: FP8 caches and encoder-only.

``tests/test_vllm.py`` checks the unquantized decoder path (decode, prefix hit, prefill in one
step); these cover the FP8 KV caches (vLLM's per-tensor scales, saturation) and the encoder-only
attention of embedding models. vLLM venv only; skipped elsewhere. A few seconds.
"""

from __future__ import annotations

import pytest
import torch

HEADS, KV_HEADS, D, BS = 4, 2, 16, 4


def _backend():
    pytest.importorskip("vllm", reason="vLLM is not installed: "
                        "python -m torchtpu.integrations.vllm.install")
    from torchtpu.integrations.vllm import attention

    return attention


def _metadata(attention, spec, new, seq, table, causal=True):
    from vllm.v1.attention.backend import CommonAttentionMetadata

    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=starts.tpu(), query_start_loc_cpu=starts,
        seq_lens=torch.tensor(seq, dtype=torch.int32).tpu(), num_reqs=len(new),
        num_actual_tokens=sum(new), max_query_len=max(new), max_seq_len=max(seq),
        block_table_tensor=table.tpu(), slot_mapping=torch.zeros(sum(new)).long().tpu(),
        causal=causal,
    )
    builder = attention.TpuAttentionMetadataBuilder(spec, ["layer"], None, torch.device("tpu"))
    return builder.build(0, common)


def _sdpa(q, k, v, mask):
    """One request's attention on CPU: q [n, heads, d], k and v [s, kv_heads, d]."""
    rep = HEADS // KV_HEADS
    return torch.nn.functional.scaled_dot_product_attention(
        q.transpose(0, 1), k.repeat_interleave(rep, 1).transpose(0, 1),
        v.repeat_interleave(rep, 1).transpose(0, 1), attn_mask=mask,
        scale=D ** -0.5).transpose(0, 1)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_fp8_cache_stores_scaled_float8_and_reads_it_back_scaled(kv_dtype, monkeypatch):
    attention = _backend()
    calls = []  # the gathered path's SDPA operands: keys and values stay one per KV head
    sdpa = torch.nn.functional.scaled_dot_product_attention

    def spy(q, k, v, **kwargs):
        calls.append((q.shape, k.shape, v.shape, kwargs.get("enable_gqa", False)))
        return sdpa(q, k, v, **kwargs)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", spy)
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    fp8 = attention.FP8_KV_DTYPES[kv_dtype]
    # vLLM's spec for an fp8 cache: one byte an element
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=D,
                             dtype=torch.uint8)
    cache = attention.new_kv_cache(spec, num_blocks=8, device=torch.device("tpu"))
    assert cache.element_size() == 1
    impl = attention.TpuAttentionImpl(HEADS, D, D ** -0.5, KV_HEADS, None, None, kv_dtype)
    layer = torch.nn.Module()
    layer._k_scale, layer._v_scale = torch.tensor(0.5).tpu(), torch.tensor(2.0).tpu()
    new, tables = [7, 3], [[5, 2], [6]]  # prefills: two blocks, one block
    k = [torch.randn(n, KV_HEADS, D) for n in new]
    v = [torch.randn(n, KV_HEADS, D) for n in new]
    k[0][3, 1, 5] = 1e6  # past float8's range: saturates, as vLLM's cache kernels do
    q = [torch.randn(n, HEADS, D) for n in new]
    slots = torch.tensor([tables[r][p // BS] * BS + p % BS
                          for r, n in enumerate(new) for p in range(n)])
    impl.do_kv_cache_update(layer, torch.cat(k).tpu(), torch.cat(v).tpu(), cache, slots.tpu())
    table = torch.tensor([[5, 2], [6, 0]], dtype=torch.int32)
    md = _metadata(attention, spec, new, new, table)
    out = torch.empty(sum(new), HEADS, D).tpu()
    impl.forward(layer, torch.cat(q).tpu(), None, None, cache, md, out)
    # each KV head's query heads as one query of group x Q rows; a per-query-head copy of the
    # keys (repeat_interleave or SDPA's enable_gqa) was most of the step's bytes at 64 requests
    group, q_len = HEADS // KV_HEADS, 8
    assert calls == [((2, KV_HEADS, group * q_len, D), (2, KV_HEADS, 8, D),
                      (2, KV_HEADS, 8, D), False)]

    top = torch.finfo(fp8).max

    def stored(x, scale):
        return (x / scale).clamp(-top, top).to(fp8).float() * scale

    want = [_sdpa(q[r], stored(k[r], 0.5), stored(v[r], 2.0),
                  torch.ones(n, n, dtype=torch.bool).tril()) for r, n in enumerate(new)]
    torch.testing.assert_close(out.cpu(), torch.cat(want), rtol=1e-5, atol=1e-5)


def test_encoder_only_attention_sees_its_requests_tokens_both_ways_and_no_cache():
    attention = _backend()
    from vllm.v1.attention.backend import AttentionType
    from vllm.v1.kv_cache_interface import EncoderOnlyAttentionSpec

    spec = EncoderOnlyAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=D,
                                    dtype=torch.float32)
    impl = attention.TpuAttentionImpl(HEADS, D, D ** -0.5, KV_HEADS, None, None, "auto",
                                      attn_type=AttentionType.ENCODER_ONLY)
    new = [5, 1, 3]  # padded to 8 queries a request (the longest, a power of two)
    k, v, q = ([torch.randn(n, h, D) for n in new] for h in (KV_HEADS, KV_HEADS, HEADS))
    md = _metadata(attention, spec, new, new, torch.zeros(3, 1, dtype=torch.int32),
                   causal=False)
    out = torch.empty(sum(new), HEADS, D).tpu()
    empty = torch.tensor([]).tpu()  # the layer's placeholder: encoder-only layers have no cache
    impl.do_kv_cache_update(torch.nn.Module(), torch.cat(k).tpu(), torch.cat(v).tpu(), empty,
                            torch.zeros(sum(new)).long().tpu())
    impl.forward(torch.nn.Module(), torch.cat(q).tpu(), torch.cat(k).tpu(), torch.cat(v).tpu(),
                 empty, md, out)
    want = [_sdpa(q[r], k[r], v[r], None) for r in range(3)]
    torch.testing.assert_close(out.cpu(), torch.cat(want), rtol=1e-5, atol=1e-5)


def test_an_fp8_decode_step_is_one_program_reading_and_writing_flat_byte_rows(monkeypatch):
    """A decode step over an fp8 cache, captured (as the model runner captures every step),
    replays as one program with no CPU fallback, and that program reads and writes the cache's
    storage as it is: ``[slots, kv_heads * 2 * head_size]`` bytes in 16-bit words. On a TPU an
    8-bit cache's entry layout is not its scatter's, and the step copied the whole cache into
    that layout and back at every layer (the chip's 72 ms step at batch 8)."""
    attention = _backend()
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from torchtpu import metrics
    from torchtpu.device import launch
    from torchtpu.eager.capture import storage_of

    spec = FullAttentionSpec(block_size=BS, num_kv_heads=KV_HEADS, head_size=D,
                             dtype=torch.uint8)
    cache = attention.new_kv_cache(spec, num_blocks=8, device=torch.device("tpu"))
    assert cache.dtype == torch.uint8  # vLLM's view: bytes
    words = (8 * BS, KV_HEADS * D)  # the storage: the same bytes as int16, a flat row a slot
    array = storage_of(cache)._tpu_array
    assert (str(array.dtype), tuple(array.shape)) == ("int16", words)
    impl = attention.TpuAttentionImpl(HEADS, D, D ** -0.5, KV_HEADS, None, None, "fp8")
    layer = torch.nn.Module()
    layer._k_scale, layer._v_scale = torch.tensor(0.5).tpu(), torch.tensor(2.0).tpu()
    # two requests of 5 and 2 tokens already cached, one new token each (slots 5*4+1, 6*4+2)
    table = torch.tensor([[3, 5], [6, 0]], dtype=torch.int32)
    seq = [6, 3]
    md = _metadata(attention, spec, [1, 1], seq, table)
    past_k, past_v = torch.randn(8 * BS, KV_HEADS, D), torch.randn(8 * BS, KV_HEADS, D)
    impl.do_kv_cache_update(layer, past_k.tpu(), past_v.tpu(), cache,
                            torch.arange(8 * BS).tpu())
    k, v, q = (torch.randn(2, h, D).tpu() for h in (KV_HEADS, KV_HEADS, HEADS))
    slot_mapping = torch.tensor([5 * BS + 1, 6 * BS + 2]).tpu()
    out = torch.zeros(2, HEADS, D).tpu()

    def step():
        impl.do_kv_cache_update(layer, k, v, cache, slot_mapping)
        impl.forward(layer, q, None, None, cache, md, out)
        md.forget_layout()
        return out

    want = step().cpu()  # eagerly, op by op
    graph = torch.tpu.TPUGraph()
    with torch.tpu.graph(graph):
        step()
    shapes = {(str(a.dtype), tuple(a.shape)) for a in graph._captured._io.arguments()}
    assert ("int16", words) in shapes, shapes
    assert not any(dtype == "uint8" for dtype, _ in shapes), shapes
    launched, run = [], launch.run
    monkeypatch.setattr(launch, "run", lambda label, fn, args: launched.append(label) or
                        run(label, fn, args))
    before = sum(metrics.snapshot()["cpu_fallbacks"].values())
    out.zero_()
    launched.clear()
    graph.replay()
    assert len(launched) == 1, launched
    assert sum(metrics.snapshot()["cpu_fallbacks"].values()) == before
    torch.testing.assert_close(out.cpu(), want)
