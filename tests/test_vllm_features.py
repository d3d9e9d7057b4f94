"""vLLM's serving features on device "tpu": speculative decoding, structured output (engine and
OpenAI server), FP8 KV cache, refusals.

Each engine runs in a process of its own (vLLM picks its platform once per process) and is
compared with Hugging Face's greedy tokens on CPU, which ``tests/test_vllm.py`` shows equal to
vLLM's own without the feature. vLLM venv only (``python -m torchtpu.integrations.vllm.install``);
skipped elsewhere.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch


def _vllm():
    return pytest.importorskip(
        "vllm", reason="vLLM is not installed: python -m torchtpu.integrations.vllm.install"
    )


def _cpu_kernels():
    """vLLM's C++ versions of the same kernels (its CPU platform's), the reference."""
    _vllm()
    from vllm.platforms.cpu import CpuPlatform

    CpuPlatform.import_kernels()  # the build this CPU's features allow (AVX2 or AVX-512)
    from vllm.utils import cpu_triton_utils

    return cpu_triton_utils


def _drafts(vocab=11, seed=0):
    """Five requests with 3, 0, 2, 3 and 1 drafts (max 3) and the target's greedy tokens:
    request 0's and 4's drafts all match, 2's second is a pad (-1), 3's second differs."""
    g = torch.Generator().manual_seed(seed)
    cu = torch.tensor([3, 0, 2, 3, 1]).cumsum(0).int()
    draft = torch.randint(0, vocab, (int(cu[-1]),), generator=g).int()
    draft[4] = -1  # a padded draft: always rejected
    target = draft.long().clamp(min=0)
    target[4] = 1
    target[6] = (draft[6] + 1) % vocab
    bonus = torch.randint(0, vocab, (5, 1), generator=g)
    return cu, draft, target, bonus, g


@pytest.mark.parametrize("all_greedy", [False, True])
def test_greedy_rejection_matches_vllms_cpu_kernel(all_greedy):
    ref = _cpu_kernels()
    from torchtpu.integrations.vllm import spec_kernels

    cu, draft, target, bonus, _ = _drafts()
    greedy = None if all_greedy else torch.tensor([True, True, False, True, False])
    want = torch.full((5, 4), -1, dtype=torch.int32)
    got = want.clone().tpu()
    ref._rejection_greedy_sample_kernel_impl(want, cu, draft, target, bonus, greedy, 3)
    spec_kernels.rejection_greedy_sample(
        got, cu.tpu(), draft.tpu(), target.tpu(), bonus.tpu(),
        None if greedy is None else greedy.tpu(), 3)
    assert got.cpu().tolist() == want.tolist()
    if all_greedy:  # every case: all accepted and the bonus, none drafted, rejections
        assert want[:, :3].tolist() == [draft[:3].tolist(), [bonus[1, 0], -1, -1],
                                        [draft[3], 1, -1], [draft[5], target[6], -1],
                                        [draft[8], bonus[4, 0], -1]]
        assert want[0, 3] == bonus[0, 0]


@pytest.mark.parametrize("draft_probs", [True, False])
def test_random_rejection_and_recovery_match_vllms_cpu_kernels(draft_probs):
    ref = _cpu_kernels()
    from torchtpu.integrations.vllm import spec_kernels

    vocab = 11
    cu, draft, _, bonus, g = _drafts(vocab)
    n = draft.shape[0]
    target_p = torch.softmax(3 * torch.randn(n, vocab, generator=g), -1)
    draft_p = torch.softmax(3 * torch.randn(n, vocab, generator=g), -1) if draft_probs else None
    # drafts the target likes (accepted) and drafts it does not (rejected, then recovered)
    draft = torch.where(torch.arange(n) % 2 == 0, target_p.argmax(-1).int(), draft)
    uniform = torch.rand(n, dtype=torch.float64, generator=g)
    greedy = torch.tensor([False, True, False, False, False])
    inv_q = torch.rand(5, vocab, generator=g).reciprocal()
    tpu = lambda t: None if t is None else t.tpu()  # noqa: E731

    recovered_want = torch.empty(n, dtype=torch.int32)
    recovered = recovered_want.tpu()
    ref._sample_recovered_tokens_kernel_impl(recovered_want, cu, draft, draft_p, target_p,
                                             inv_q, vocab, 8192, draft_p is None)
    spec_kernels.sample_recovered_tokens(recovered, tpu(cu), tpu(draft), tpu(draft_p),
                                         tpu(target_p), tpu(inv_q), vocab, 8192, draft_p is None)
    assert recovered.cpu().tolist() == recovered_want.tolist()

    want = torch.full((5, 4), -1, dtype=torch.int32)
    got = want.clone().tpu()
    ref._rejection_random_sample_kernel_impl(want, cu, draft, draft_p, target_p, bonus,
                                             recovered_want, uniform, greedy, 3, vocab, None,
                                             draft_p is None)
    spec_kernels.rejection_random_sample(got, tpu(cu), tpu(draft), tpu(draft_p), tpu(target_p),
                                         tpu(bonus), recovered, tpu(uniform), tpu(greedy), 3,
                                         vocab, None, draft_p is None)
    assert got.cpu().tolist() == want.tolist()
    assert any(r[0] != -1 for r in want.tolist())  # some rows were written


def test_expand_and_the_bonus_only_step_match_vllms_cpu_kernels():
    ref = _cpu_kernels()
    from torchtpu.integrations.vllm import spec_kernels

    cu, *_ = _drafts()
    values = torch.tensor([0, 2, 0, 3, 1])
    want = torch.empty(int(cu[-1]), dtype=torch.int64)
    got = want.tpu()
    ref._expand_kernel_impl(want, values, cu, 0, 7)
    spec_kernels.expand(got, values.tpu(), cu.tpu(), 0, 7)
    assert got.cpu().tolist() == want.tolist() == [7, 7, 7, 7, 7, 3, 3, 3, 1]
    # no request has drafts (max_spec_len 0, the profiling run's shape): bonus tokens only
    none = torch.zeros(2, dtype=torch.int32)
    empty = torch.zeros(0, dtype=torch.int32)
    bonus = torch.tensor([[5], [9]])
    want = torch.full((2, 1), -1, dtype=torch.int32)
    got = want.clone().tpu()
    ref._rejection_greedy_sample_kernel_impl(want, none, empty, empty.long(), bonus, None, 0)
    spec_kernels.rejection_greedy_sample(got, none.tpu(), empty.tpu(), empty.long().tpu(),
                                         bonus.tpu(), None, 0)
    assert got.cpu().tolist() == want.tolist() == [[5], [9]]


_ENGINE = r"""
import json, sys
import vllm

model, prompts = sys.argv[1], json.loads(sys.argv[2])
options = {"dtype": "float32", **json.loads(sys.argv[3])}
structured = options.pop("structured", None)
llm = vllm.LLM(model=model, max_model_len=256, max_num_seqs=4, max_num_batched_tokens=64,
               gpu_memory_utilization=0.01, kv_cache_memory_bytes=4 << 20,
               disable_log_stats=False, **options)
extra = {}
if structured:
    from vllm.sampling_params import StructuredOutputsParams
    extra["structured_outputs"] = StructuredOutputsParams(json=structured)
params = vllm.SamplingParams(max_tokens=int(sys.argv[4]), temperature=0,
                             ignore_eos=not structured, **extra)
outs = llm.generate(prompts, params, use_tqdm=False)
metrics = {m.name: m.value for m in llm.get_metrics() if hasattr(m, "value")}
print("RESULT " + json.dumps({
    "ids": [list(o.outputs[0].token_ids) for o in outs],
    "text": [o.outputs[0].text for o in outs],
    "metrics": {k: v for k, v in metrics.items() if "spec_decode" in k},
    # each layer's cache tensor: (dtype, bytes, blocks)
    "caches": llm.collective_rpc(lambda worker: [
        (str(t.dtype), t.numel() * t.element_size(), t.shape[0])
        for t in worker.model_runner.kv_caches])[0],
}))
"""


def run_engine(script: str, *args: str, timeout: float = 900):
    """Run ``script`` in a process of its own on the tpu platform: (process, its RESULT json)."""
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", script, *args], env=env, capture_output=True,
                          text=True, timeout=timeout)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    return proc, json.loads(lines[-1][len("RESULT "):]) if lines else None


def _engine(model_dir, prompts, options, max_tokens):
    return run_engine(_ENGINE, model_dir, json.dumps(prompts), json.dumps(options),
                      str(max_tokens))


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory):
    _vllm()
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    return str(save_tiny_model(tmp_path_factory.mktemp("vllm") / "llama", "llama"))


# the tiny random model falls into short loops, which the n-gram proposer finds in its context
SPEC_PROMPTS = ["abcabcabcabcabc", "the quick brown fox jumps over the quick brown fox jumps over"]


def test_ngram_speculation_keeps_the_greedy_tokens(tiny_llama):
    spec = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_max": 3,
            "prompt_lookup_min": 2}
    check_speculation(tiny_llama, spec, "n-gram")


def check_speculation(model: str, spec: dict, name: str) -> None:
    """model's greedy tokens under speculative_config=spec equal HF's, and some drafts were
    accepted and some rejected (both branches ran); the acceptance rate is printed."""
    from test_vllm import _hf_greedy

    proc, got = _engine(model, SPEC_PROMPTS, {"speculative_config": spec}, 24)
    assert got, proc.stderr[-4000:]
    assert got["ids"] == _hf_greedy(model, SPEC_PROMPTS, 24)
    m = got["metrics"]
    drafted = m["vllm:spec_decode_num_draft_tokens"]
    accepted = m["vllm:spec_decode_num_accepted_tokens"]
    assert 0 < accepted < drafted, m
    print(f"{name} acceptance: {accepted:.0f}/{drafted:.0f} = {accepted / drafted:.2f}")


def _config(**parts):
    """A VllmConfig stand-in holding vLLM's own sub-configs (no model needed)."""
    import types

    from vllm.config import CacheConfig, CompilationConfig, ParallelConfig

    base = {"compilation_config": CompilationConfig(), "parallel_config": ParallelConfig(),
            "cache_config": CacheConfig(),
            "scheduler_config": types.SimpleNamespace(async_scheduling=None)}
    return types.SimpleNamespace(**{**base, **parts})


def test_features_the_platform_cannot_serve_are_refused_by_name():
    _vllm()
    from vllm.config import CacheConfig, ParallelConfig

    from torchtpu.integrations.vllm.platform import TpuPlatform

    ns = __import__("types").SimpleNamespace
    refused = {
        "pipeline_parallel_size=2": _config(
            parallel_config=ParallelConfig(pipeline_parallel_size=2)),
        "data_parallel_size=2": _config(parallel_config=ParallelConfig(data_parallel_size=2)),
        r"tensor parallelism across hosts \(nnodes=2\)": _config(
            parallel_config=ParallelConfig(tensor_parallel_size=2, nnodes=2)),
        # (vLLM's ParallelConfig imports Ray to check that name; this venv has none)
        "tensor parallelism with distributed_executor_backend='ray'": _config(
            parallel_config=ns(tensor_parallel_size=2, distributed_executor_backend="ray")),
        "quantization method 'awq'": _config(model_config=ns(quantization="awq")),
        "kv_cache_dtype='fp8_per_token_head'": _config(
            cache_config=CacheConfig(cache_dtype="fp8_per_token_head")),
        "kv_offloading_backend='lmcache'": _config(cache_config=CacheConfig(
            kv_offloading_size=1.0, kv_offloading_backend="lmcache")),
        "KV connector": _config(kv_transfer_config=ns(kv_connector="NixlConnector")),
        "method 'eagle'": _config(speculative_config=ns(method="eagle")),
    }
    for what, config in refused.items():
        with pytest.raises(NotImplementedError, match="torchtpu.unsupported: .*" + what) as e:
            TpuPlatform.check_and_update_config(config)
        assert "yet; instead, " in str(e.value), e.value  # and says what works
    for dtype in ("bfloat16", "fp8"):
        served = _config(speculative_config=ns(method="ngram"),
                         cache_config=CacheConfig(cache_dtype=dtype))
        TpuPlatform.check_and_update_config(served)
    # KV offload to host memory is served (tests/test_vllm_offload.py), with the tpu copy worker
    offload = _config(cache_config=CacheConfig(kv_offloading_size=1.0), kv_transfer_config=None)
    TpuPlatform.check_and_update_config(offload)
    extra = offload.kv_transfer_config.kv_connector_extra_config
    assert extra["spec_module_path"] == "torchtpu.integrations.vllm.offload", extra
    # tensor parallelism on one host is served (tests/test_vllm_tp.py)
    TpuPlatform.check_and_update_config(
        _config(parallel_config=ParallelConfig(tensor_parallel_size=2)))


def test_llm_refuses_pipeline_parallel_before_it_starts_an_engine(tiny_llama):
    code = ("import vllm, sys\n"
            "try:\n"
            f"    vllm.LLM(model={tiny_llama!r}, pipeline_parallel_size=2)\n"
            "except NotImplementedError as e:\n"
            "    print('REFUSED', e); sys.exit(0)\n"
            "sys.exit(3)\n")
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True,
                          text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "pipeline_parallel_size=2" in proc.stdout and "vllm-router" in proc.stdout


# bounded output (no free whitespace, closed properties): every request ends by itself
SCHEMA = {"type": "object", "properties": {"ok": {"type": "boolean"},
                                           "color": {"enum": ["red", "green", "blue"]}},
          "required": ["ok", "color"], "additionalProperties": False}


def _hf_constrained(model_dir, prompts, schema, max_new_tokens):
    """HF ``generate()``'s greedy tokens under xgrammar's mask for ``schema``, on CPU, compiled
    as vLLM's xgrammar backend compiles it with ``disable_any_whitespace``; a prompt is text or
    token ids."""
    import xgrammar as xgr
    import xgrammar.contrib.hf
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    info = xgr.TokenizerInfo.from_huggingface(
        tok, vocab_size=AutoConfig.from_pretrained(model_dir).vocab_size)
    grammar = xgr.GrammarCompiler(info).compile_json_schema(
        json.dumps(schema), any_whitespace=False, separators=(",", ":"))
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for prompt in prompts:
        ids = tok(prompt).input_ids if isinstance(prompt, str) else prompt
        gen = model.generate(torch.tensor([ids]), max_new_tokens=max_new_tokens,
                             do_sample=False,
                             logits_processor=[xgrammar.contrib.hf.LogitsProcessor(grammar)])
        out.append(gen[0, len(ids):].tolist())
    return out


def test_json_schema_structured_output_is_valid_and_equals_hf_under_the_same_grammar(
        tiny_llama):
    import jsonschema

    prompts = ["give me json: ", "hello"]
    options = {"structured": SCHEMA,
               "structured_outputs_config": {"backend": "xgrammar",
                                             "disable_any_whitespace": True}}
    proc, got = _engine(tiny_llama, prompts, options, 40)
    assert got, proc.stderr[-4000:]
    for text in got["text"]:
        jsonschema.validate(json.loads(text), SCHEMA)
    assert got["ids"] == _hf_constrained(tiny_llama, prompts, SCHEMA, 40)


def _agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens two greedy runs share."""
    return next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))


FP8_PROMPTS = ["hello world", "the quick brown fox jumps over", "abcabcabc"]


@pytest.mark.full  # engines of their own: minutes
def test_fp8_kv_cache_halves_kv_memory_and_keeps_the_greedy_tokens(tiny_llama):
    """bfloat16 model: kv_cache_dtype="fp8" against the same run with the model's dtype."""
    runs = {}
    for kv in ("auto", "fp8"):
        proc, runs[kv] = _engine(tiny_llama, FP8_PROMPTS,
                                 {"dtype": "bfloat16", "kv_cache_dtype": kv}, 32)
        assert runs[kv], proc.stderr[-4000:]
    (base_dtype, base_bytes, base_blocks), = set(map(tuple, runs["auto"]["caches"]))
    (fp8_dtype, fp8_bytes, fp8_blocks), = set(map(tuple, runs["fp8"]["caches"]))
    assert (base_dtype, fp8_dtype) == ("torch.bfloat16", "torch.uint8")  # vLLM's fp8 spec
    # half the bytes a block: the same KV budget holds twice the blocks
    assert fp8_bytes / fp8_blocks == base_bytes / base_blocks / 2
    assert fp8_blocks >= 2 * base_blocks - 1
    shared = [_agreement(a, b) for a, b in zip(runs["auto"]["ids"], runs["fp8"]["ids"])]
    print(f"fp8 KV cache: leading greedy tokens equal to bfloat16's: {shared} of 32")
    assert min(shared) >= 8, shared


@pytest.mark.full  # engines of their own: minutes
def test_openai_server_json_schema_and_named_tool_call_are_valid_and_equal_hf(tiny_llama):
    """``vllm serve`` on tpu, three concurrent chat requests: two with a JSON-schema
    ``response_format``, one calling a named tool whose parameters are that schema. Each answer
    is valid for the schema and the tokens HF picks under the same grammar."""
    from concurrent.futures import ThreadPoolExecutor

    import jsonschema

    from torchtpu.integrations.vllm import server

    guided = json.dumps({"backend": "xgrammar", "disable_any_whitespace": True})
    greedy = {"model": tiny_llama, "max_tokens": 40, "temperature": 0, "return_token_ids": True}
    as_json = {"response_format": {"type": "json_schema",
                                   "json_schema": {"name": "answer", "schema": SCHEMA}}}
    tool = {"tools": [{"type": "function", "function": {
                "name": "paint", "description": "paint it", "parameters": SCHEMA}}],
            "tool_choice": {"type": "function", "function": {"name": "paint"}}}
    bodies = [{**greedy, **extra, "messages": [{"role": "user", "content": text}]}
              for text, extra in [("give me json", as_json), ("hi", as_json), ("paint", tool)]]
    # a parser that takes named tool calls as plain JSON (hermes', say, as its own tags)
    parser = ("--enable-auto-tool-choice", "--tool-call-parser", "pythonic")
    with server.serve(tiny_llama, "tpu",
                      args=(*server.SERVE_ARGS, "--structured-outputs-config", guided,
                            *parser)) as url:
        with ThreadPoolExecutor(len(bodies)) as pool:
            answers = list(pool.map(
                lambda body: server.post(url + "/v1/chat/completions", body), bodies))
    texts = [a["choices"][0]["message"]["content"] for a in answers[:2]]
    (call,) = answers[2]["choices"][0]["message"]["tool_calls"]
    assert call["function"]["name"] == "paint"
    for text in [*texts, call["function"]["arguments"]]:
        jsonschema.validate(json.loads(text), SCHEMA)
    want = _hf_constrained(tiny_llama, [a["prompt_token_ids"] for a in answers], SCHEMA, 40)
    assert [a["choices"][0]["token_ids"] for a in answers] == want
