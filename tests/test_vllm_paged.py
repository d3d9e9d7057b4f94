"""The tpu attention backend's paged path (``paged.py``) against its gathered path.

With ``TORCHTPU_VLLM_PAGED=on`` a layer writes its cache in the ragged paged-attention kernel's
layout (KV heads packed into 128-lane heads where they are narrower) and attends through
``torchtpu::ragged_paged_attention``, which off a TPU computes the kernel's attention densely
in XLA (JAX's Pallas kernel runs in neither of JAX's interpreters: bench/RESULTS.md); its
outputs must be the gathered path's for decodes, prefills, prefix hits and padded requests
in one step; and an engine whose kernel pages are the platform's rule's (``paged.page_size``),
not vLLM's 16 tokens, serves the gathered path's greedy tokens. vLLM venv only; skipped
elsewhere. Seconds; the engines' test (``full``) minutes.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

BS = 4


def _backend():
    pytest.importorskip("vllm", reason="vLLM is not installed: "
                        "python -m torchtpu.integrations.vllm.install")
    from torchtpu.integrations.vllm import attention

    return attention


def _step(attention, monkeypatch, mode, heads, kv_heads, d, kv_cache_dtype="auto"):
    """One mixed step through a fresh layer: (outputs [tokens, heads, d], the cache)."""
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    monkeypatch.setenv("TORCHTPU_VLLM_PAGED", mode)
    gen = torch.Generator().manual_seed(0)
    fp8 = kv_cache_dtype != "auto"  # vLLM's spec for an fp8 cache: one byte an element
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=kv_heads, head_size=d,
                             dtype=torch.uint8 if fp8 else torch.float32)
    cache = attention.new_kv_cache(spec, num_blocks=16, device=torch.device("tpu"),
                                   cache_dtype=kv_cache_dtype)
    impl = attention.TpuAttentionImpl(heads, d, d ** -0.5, kv_heads, None, None, kv_cache_dtype)
    assert impl.paged == (mode == "on")
    # request 0: a prefill of 7 written earlier, now a decode (position 7); request 1: a whole
    # prefill of 6; request 2: a prefix hit (5 cached, 3 new); request 3: padding (no tokens)
    tables = [[3, 9, 1], [0 + 5, 7], [2, 11, 4], []]
    cached, new = [7, 0, 5, 0], [1, 6, 3, 0]
    layer = torch.nn.Module()
    layer._k_scale, layer._v_scale = torch.tensor(0.5).tpu(), torch.tensor(2.0).tpu()
    layer._k_scale_float, layer._v_scale_float = 0.5, 2.0

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
    return out.cpu()[:len(step)], cache


@pytest.mark.parametrize("heads,kv_heads,d", [(4, 2, 64), (2, 1, 128), (8, 4, 32)],
                         ids=["two-heads-packed", "128-wide", "four-heads-packed"])
def test_paged_kernel_path_equals_the_gathered_path(monkeypatch, heads, kv_heads, d):
    attention = _backend()
    paged, paged_cache = _step(attention, monkeypatch, "on", heads, kv_heads, d)
    gathered, gathered_cache = _step(attention, monkeypatch, "off", heads, kv_heads, d)
    torch.testing.assert_close(paged, gathered, rtol=1e-5, atol=1e-5)
    # packed heads lay the cache out differently (the kernel's layout); 128-wide ones do not
    assert torch.equal(paged_cache.cpu(), gathered_cache.cpu()) == (d == 128)


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
def test_an_fp8_cache_whose_float8_pages_tile_takes_the_kernel_with_its_scales(monkeypatch,
                                                                              kv_dtype):
    """Four 64-wide KV heads (Llama-3.2-1B's packing: two 128-lane heads, four float8 head
    rows a token, one 32-bit word of the kernel's): the fp8 cache's storage is float8 itself,
    the kernel's operand with no byte view between (on a TPU a whole-cache copy a layer), and
    the step's outputs are the gathered fp8 path's, the scales (0.5, 2.0) applied inside the
    op."""
    attention = _backend()
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from torchtpu.eager.capture import storage_of

    float8 = (str(attention.FP8_KV_DTYPES[kv_dtype]).removeprefix("torch."), (16 * BS, 4, 128))
    monkeypatch.setenv("TORCHTPU_VLLM_PAGED", "on")
    spec = FullAttentionSpec(block_size=BS, num_kv_heads=4, head_size=64, dtype=torch.uint8)
    fresh = attention.new_kv_cache(spec, 16, torch.device("tpu"), kv_dtype)
    array = storage_of(fresh)._tpu_array
    assert fresh.dtype == torch.uint8 and (str(array.dtype), tuple(array.shape)) == float8
    paged, paged_cache = _step(attention, monkeypatch, "on", 8, 4, 64, kv_dtype)
    gathered, _ = _step(attention, monkeypatch, "off", 8, 4, 64, kv_dtype)
    torch.testing.assert_close(paged, gathered, rtol=1e-5, atol=1e-5)
    # a captured decode step reads and writes the float8 storage as it is: no byte array
    monkeypatch.setenv("TORCHTPU_VLLM_PAGED", "on")
    impl = attention.TpuAttentionImpl(8, 64, 0.125, 4, None, None, kv_dtype)
    layer = torch.nn.Module()
    layer._k_scale, layer._v_scale = torch.tensor(0.5).tpu(), torch.tensor(2.0).tpu()
    layer._k_scale_float, layer._v_scale_float = 0.5, 2.0
    md = attention.TpuAttentionMetadataBuilder(spec, ["layer"], None, torch.device("tpu")) \
        .metadata(2, 2, 1, 9, torch.tensor([0, 1, 2], dtype=torch.int32).tpu(),
                  torch.tensor([9, 3], dtype=torch.int32).tpu(),
                  torch.tensor([[3, 9, 1, 0], [7, 0, 0, 0]], dtype=torch.int32).tpu())
    k, v, q = (torch.randn(2, h, 64).tpu() for h in (4, 4, 8))
    slot_mapping, out = torch.tensor([1 * BS + 0, 7 * BS + 2]).tpu(), torch.zeros(2, 8, 64).tpu()
    graph = torch.tpu.TPUGraph()
    with torch.tpu.graph(graph):
        impl.do_kv_cache_update(layer, k, v, paged_cache, slot_mapping)
        impl.forward(layer, q, None, None, paged_cache, md, out)
    shapes = {(str(a.dtype), tuple(a.shape)) for a in graph._captured._io.arguments()}
    assert float8 in shapes and not {"uint8", "int16"} & {d for d, _ in shapes}, shapes


def test_paged_mode_refuses_heads_it_cannot_pack(monkeypatch):
    _backend()
    from torchtpu.integrations.vllm import paged

    monkeypatch.setenv("TORCHTPU_VLLM_PAGED", "on")
    with pytest.raises(ValueError, match=r"torchtpu\.argument: TORCHTPU_VLLM_PAGED=on.*3 KV "
                                         r"heads of size 64"):
        paged.enabled(64, 3, "auto")
    # Qwen2.5-0.5B's fp8 cache: one combined head, two float8 rows a token, half a word
    with pytest.raises(ValueError, match=r"TORCHTPU_VLLM_PAGED=on.*its float8 pages have 2 "
                                         r"head rows a token .*packs 4 rows a 32-bit word"):
        paged.enabled(64, 2, "fp8")
    assert paged.why_not(64, 2, "auto") is None and paged.why_not(64, 4, "fp8_e5m2") is None
    monkeypatch.setenv("TORCHTPU_VLLM_PAGED", "auto")  # off a TPU: the gathered path
    assert not paged.enabled(64, 2, "auto")
    monkeypatch.setenv("TORCHTPU_VLLM_PAGED", "sometimes")
    with pytest.raises(ValueError, match=r"torchtpu\.config: TORCHTPU_VLLM_PAGED='sometimes'"):
        paged.enabled(64, 2, "auto")


def test_page_size_fits_the_model_length_in_16_pages():
    _backend()
    from torchtpu.integrations.vllm import paged

    # Qwen2.5-0.5B served at 512 + 128 tokens (bench/serving_chip.py): pages of 64, not 16
    assert [paged.page_size(n) for n in (1, 256, 300, 640, 1024, 2048, 4096, 32768)] == \
        [16, 16, 32, 64, 64, 128, 256, 256]
    with pytest.raises(ValueError, match=r"torchtpu\.argument: max_model_len=0"):
        paged.page_size(0)


def test_the_backend_prefers_the_rules_pages_where_the_kernel_serves(monkeypatch, tmp_path):
    """vLLM asks the backend's preferred block size (the engine's config current) when the user
    gave none: the kernel's pages where it serves, vLLM's 16 tokens on the gathered path."""
    attention = _backend()
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model = save_tiny_model(tmp_path / "qwen2", "qwen2", heads=2, kv_heads=2)
    config = VllmConfig(model_config=ModelConfig(model=str(model), max_model_len=512,
                                                 dtype="float32"))
    got = {}
    for mode in ("on", "off"):
        monkeypatch.setenv("TORCHTPU_VLLM_PAGED", mode)
        with set_current_vllm_config(config):
            got[mode] = attention.TpuAttentionBackend.get_preferred_block_size(16)
    assert got == {"on": 32, "off": 16}


# one engine in a process of its own (vLLM picks its platform once a process): its KV block
# size and greedy tokens as one JSON line
_ENGINE = r"""
import json, sys
import vllm

llm = vllm.LLM(model=sys.argv[1], dtype="float32", max_model_len=512, max_num_seqs=4,
               max_num_batched_tokens=64, gpu_memory_utilization=0.01)
outs = llm.generate(json.loads(sys.argv[2]),
                    vllm.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True,
                                        logprobs=0),
                    use_tqdm=False)
done = [o.outputs[0] for o in outs]
print("RESULT " + json.dumps({
    "block_size": llm.llm_engine.vllm_config.cache_config.block_size,
    "ids": [list(c.token_ids) for c in done],
    "logprobs": [[lp[t].logprob for t, lp in zip(c.token_ids, c.logprobs)] for c in done]}))
"""


@pytest.mark.full  # two engines of their own: ~2.6 min at load 12 (57 s CPU)
def test_paged_engine_takes_the_rules_pages_and_keeps_the_gathered_tokens(tmp_path):
    """max_model_len 512: the kernel's engine pages by 32 tokens (16 a sequence), the gathered
    one by vLLM's 16; prompts of 5 to 70 tokens span 1 to 3 of the larger pages, and both
    engines' greedy tokens and their log-probabilities are equal (XLA:CPU, where the op is the
    kernel's attention in XLA)."""
    _backend()
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    # 64-wide heads, two KV heads: packed into one 128-lane kernel head (Qwen2.5's shape)
    model = str(save_tiny_model(tmp_path / "qwen2", "qwen2", heads=2, kv_heads=2))
    prompts = ["hello", "the quick brown fox jumps over the lazy dog", "b" * 70]
    procs = {mode: subprocess.Popen(
        [sys.executable, "-c", _ENGINE, model, json.dumps(prompts)],
        env={**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
             "TORCHTPU_VLLM_PAGED": mode}, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        text=True) for mode in ("on", "off")}
    got = {}
    for mode, proc in procs.items():
        out, err = proc.communicate(timeout=900)
        lines = [x for x in out.splitlines() if x.startswith("RESULT ")]
        assert proc.returncode == 0 and lines, err[-4000:]
        got[mode] = json.loads(lines[-1][len("RESULT "):])
    assert got["on"]["block_size"] == 32 and got["off"]["block_size"] == 16, got
    assert got["on"]["ids"] == got["off"]["ids"], got
    torch.testing.assert_close(torch.tensor(got["on"]["logprobs"]),
                               torch.tensor(got["off"]["logprobs"]), rtol=1e-4, atol=1e-4)
