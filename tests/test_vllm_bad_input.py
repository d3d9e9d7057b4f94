"""Bad input to vLLM on device "tpu": each a clear error before the engine starts, or a
per-request rejection while the engine keeps serving the others (issue 38).

- weights larger than the device (``preflight.check_weights_fit``, in the worker before loading),
- a ``max_model_len`` whose KV cache does not fit (vLLM's own start-up check),
- a prompt longer than ``max_model_len`` (vLLM's per-request check at ``add_request``),
- a tokenizer missing from the model directory (``preflight.check_tokenizer``),
- an unsupported quantization method: ``tests/test_vllm_quant.py`` (support.refuse_unsupported).

vLLM venv only; skipped elsewhere. One child process holds the engines (in-process engine,
steps captured lazily), about a minute on a quiet machine.
"""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch


def _vllm():
    pytest.importorskip("vllm", reason="vLLM is not installed: "
                        "python -m torchtpu.integrations.vllm.install")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    _vllm()
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    return save_tiny_model(tmp_path_factory.mktemp("tiny"), "qwen2")


def test_weights_larger_than_the_device_are_refused_naming_both_sizes(tiny):
    from torchtpu.integrations.vllm import preflight

    elements = preflight.checkpoint_elements(tiny)
    model = sum(p.numel() for p in __import__("safetensors.torch").torch.load_file(
        str(tiny / "model.safetensors")).values())
    assert elements == model
    need = 2 * elements  # bfloat16
    preflight.check_weights_fit(tiny, torch.bfloat16, 2 * need, 0.9, "TPU v5 lite")
    with pytest.raises(torch.OutOfMemoryError, match=(
            r"torchtpu\.memory: the model in .* has [0-9,]+ weights, .* GiB in bfloat16, more "
            r"than device 'tpu' \(TPU v5 lite, .* GiB\) can hold at "
            r"gpu_memory_utilization=0\.5 .*quantization='fp8'")):
        preflight.check_weights_fit(tiny, torch.bfloat16, need + 2, 0.5, "TPU v5 lite")


def test_a_model_directory_without_a_tokenizer_is_refused(tiny, tmp_path):
    from types import SimpleNamespace as ns

    from torchtpu.integrations.vllm import preflight

    bare = tmp_path / "bare"
    bare.mkdir()
    for f in ("config.json", "model.safetensors"):
        shutil.copy(tiny / f, bare / f)
    preflight.check_tokenizer(ns(model=str(tiny), tokenizer=str(tiny)))
    preflight.check_tokenizer(ns(model=str(bare), tokenizer=str(bare), skip_tokenizer_init=True))
    with pytest.raises(ValueError, match=r"torchtpu\.argument: the model directory .*bare has no "
                                         r"tokenizer .*tokenizer=DIR, or skip_tokenizer_init"):
        preflight.check_tokenizer(ns(model=str(bare), tokenizer=str(bare)))


_CHILD = r"""
import os, shutil, sys, tempfile
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
os.environ["TORCHTPU_VLLM_CAPTURE"] = "lazy"
import torch
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt

tiny = sys.argv[1]
bare = tempfile.mkdtemp()
for f in ("config.json", "model.safetensors"):
    shutil.copy(os.path.join(tiny, f), bare)

def expect(what, fn, text):
    try:
        fn()
    except Exception as e:
        assert text in str(e), (what, repr(e)[:2000])
        print("REFUSED", what, flush=True)
        return
    raise AssertionError(f"{what}: no error")

expect("tokenizer", lambda: LLM(model=bare, max_model_len=64), "has no tokenizer")
# 64 KiB of KV cache: far from one 512-token request's
expect("kv", lambda: LLM(model=tiny, max_model_len=512, kv_cache_memory_bytes=64 << 10,
                         gpu_memory_utilization=0.01), "max seq len")
real = torch.tpu.get_device_properties
class Small:
    def __init__(self, props):
        self.props = props
    def __getattr__(self, name):
        return 1 << 16 if name == "total_memory" else getattr(self.props, name)
torch.tpu.get_device_properties = lambda *a, **k: Small(real(*a, **k))
expect("weights", lambda: LLM(model=tiny, max_model_len=64, kv_cache_memory_bytes=16 << 20,
                              gpu_memory_utilization=0.01), "torchtpu.memory")
torch.tpu.get_device_properties = real

llm = LLM(model=tiny, max_model_len=64, max_num_seqs=4, kv_cache_memory_bytes=16 << 20,
          gpu_memory_utilization=0.01)
engine = llm.llm_engine
params = SamplingParams(max_tokens=4, temperature=0.0, ignore_eos=True)
engine.add_request("a", TokensPrompt(prompt_token_ids=[1, 2, 3]), params)
expect("long", lambda: engine.add_request("long", TokensPrompt(prompt_token_ids=[5] * 100),
                                          params), "maximum context length is 64")
engine.add_request("b", TokensPrompt(prompt_token_ids=[4, 5]), params)
done = {}
while engine.has_unfinished_requests():
    for out in engine.step():
        if out.finished:
            done[out.request_id] = len(out.outputs[0].token_ids)
print("SERVED", sorted(done.items()), flush=True)
"""


def test_bad_input_is_refused_before_the_engine_or_per_request(tiny):
    run = subprocess.run([sys.executable, "-c", _CHILD, str(tiny)], capture_output=True,
                         text=True, timeout=900)
    out = run.stdout
    assert run.returncode == 0, (out[-2000:], run.stderr[-4000:])
    for what in ("tokenizer", "kv", "weights", "long"):
        assert f"REFUSED {what}" in out, (out[-2000:], run.stderr[-3000:])
    assert "SERVED [('a', 4), ('b', 4)]" in out
