"""SGLang on device "tpu": the platform plugin's opt-in, the installer, and ``sglang.Engine`` and
SGLang's HTTP server generating the greedy tokens Hugging Face ``generate()`` picks on CPU.

SGLang is an optional extra with its own venv (``python -m torchtpu.integrations.sglang.install``,
.venv-sglang); without it only the registration and installer tests run.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import no_sockets
import pytest
from test_vllm import PROMPTS, _hf_greedy

from torchtpu.integrations import sglang as plugin
from torchtpu.integrations.sglang import install


def test_install_keeps_torch_and_guards_only_torchvisions_two_registrations(tmp_path):
    deps, wheel = install.commands("py", "c.txt")
    assert "torch==2.13.0" in deps and deps[deps.index("-c") + 1] == "c.txt"
    assert "--no-deps" in wheel and "sglang==0.5.23" in wheel
    assert not any(d.startswith(("flashinfer", "sglang-kernel", "torch==2.14")) for d in deps)
    meta = tmp_path / "_meta_registrations.py"
    meta.write_text('@register_meta("roi_align")\ndef a(): ...\n'
                    '@torch.library.register_fake("torchvision::nms")\ndef b(): ...\n'
                    '@torch.library.register_fake("torchvision::qnms")\ndef c(): ...\n')
    assert install.guard_torchvision(meta) == 2
    text = meta.read_text()
    assert text.count("@register_meta(") == 3 and "register_fake" not in text
    assert install.guard_torchvision(meta) == 0  # a second install changes nothing


def _sglang():
    return pytest.importorskip(
        "sglang", reason="SGLang is not installed: python -m torchtpu.integrations.sglang.install"
    )


def _env(setting: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHTPU_SGLANG", "SGLANG_PLATFORM")}
    return {**env, "TORCHTPU_SGLANG": setting}


def test_sglang_resolves_the_tpu_platform_only_when_asked():
    _sglang()
    code = ("from sglang.srt.platforms import current_platform as p; "
            "print(type(p).__module__ + '.' + type(p).__name__, p.device_type)")
    run = lambda setting: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env=_env(setting), capture_output=True, text=True,
        timeout=300, check=True,
    ).stdout.strip().splitlines()[-1]
    assert run("1") == f"{plugin.PLATFORM} tpu"
    assert run("0") == "sglang.srt.platforms.interface.SRTPlatform cpu"  # no CUDA, no CPU engine


# In a process of its own: SGLang resolves its platform once per process. Prints one JSON line.
_GENERATE = r"""
import json, sys
import sglang

model, prompts, prefixed = sys.argv[1], json.loads(sys.argv[2]), json.loads(sys.argv[3])
# nccl_port given: SGLang would bind a TCP socket to pick one (sockets are refused here)
engine = sglang.Engine(model_path=model, device="tpu", dtype="float32", random_seed=0,
                       max_total_tokens=4096, nccl_port=29999,
                       log_level="info")
params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
ids = lambda outs: [o["output_ids"] for o in outs]
batched = engine.generate(prompts, params)
alone = [engine.generate(p, params) for p in prompts]
shared = engine.generate(prefixed[:1], params) + engine.generate(prefixed[1:], params)
print("RESULT " + json.dumps({
    "batched": ids(batched), "alone": ids(alone), "prefixed": ids(shared),
    "cached": [o["meta_info"]["cached_tokens"] for o in shared],
}), flush=True)
engine.shutdown()
"""
PREFIX = "the quick brown fox jumps over the lazy dog; "


def test_engine_greedy_tokens_equal_hf_generate(tmp_path):
    """With every internet socket refused, as on a sandboxed TPU host: the scheduler's groups
    are ``tpu_solo`` groups over a file store (platform.solo_groups), ZMQ runs over ipc://."""
    _sglang()
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))
    prefixed = [PREFIX + "one", PREFIX + "two more", PREFIX + "one"]
    proc = subprocess.run(
        [sys.executable, "-c", _GENERATE, model_dir, json.dumps(PROMPTS), json.dumps(prefixed)],
        env=no_sockets.environment(tmp_path, _env("1")), capture_output=True, text=True,
        timeout=900,
    )
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    # the model ran on device "tpu" (the platform's post-load check logs where it put it)
    assert "torchtpu: SGLang's model is on tpu:0" in proc.stderr, proc.stderr[-4000:]
    want = _hf_greedy(model_dir, PROMPTS)
    assert got["batched"] == want
    assert got["alone"] == want
    assert got["prefixed"] == _hf_greedy(model_dir, prefixed)
    # SGLang's radix cache served the shared prefix to the later requests
    assert min(got["cached"][1:]) >= len(PREFIX) - 1, got["cached"]


def test_server_answers_generate_and_completions_concurrently(tmp_path):
    """SGLang's server on tpu over plain HTTP: four concurrent ``/generate`` requests
    (continuous batching) and an OpenAI ``/v1/completions``, each HF ``generate()``'s tokens.
    The HTTP server listens on localhost only; its scheduler's torch.distributed store (PyTorch's
    TCPStore) listens on every interface, and nothing else does."""
    _sglang()
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlparse

    from transformers import AutoTokenizer

    from torchtpu.integrations.sglang import server
    from torchtpu.integrations.vllm.server import free_port, post
    from torchtpu.integrations.vllm.tiny import save_tiny_model
    from torchtpu.testing import network

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))
    params = {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}
    store = free_port()
    with server.serve(model_dir, args=(*server.SERVE_ARGS, "--nccl-port", str(store))) as url:
        port = urlparse(url).port
        exposed = network.exposed(port)
        reachable = [a for a in network.other_addresses() if not network.refused(a, port)]
        generate = lambda p: post(url + "/generate", {"text": p, "sampling_params": params})  # noqa: E731
        with ThreadPoolExecutor(len(PROMPTS)) as pool:
            native = list(pool.map(generate, PROMPTS))
        completion = post(url + "/v1/completions", {
            "model": model_dir, "prompt": PROMPTS[1], "max_tokens": 8, "temperature": 0,
            "ignore_eos": True})

    assert {p for _, p in exposed} <= {store} and reachable == [], (exposed, store, reachable)
    want = _hf_greedy(model_dir, PROMPTS)
    assert [r["output_ids"] for r in native] == want
    tok = AutoTokenizer.from_pretrained(model_dir)
    assert completion["usage"]["completion_tokens"] == 8
    assert completion["choices"][0]["text"] == tok.decode(want[1])


def test_host_kv_cache_is_sized_in_bytes_and_tokens(tmp_path):
    """On XLA:CPU SGLang's default (a fraction of all memory, allocated at start-up: 11 GiB for
    the tiny Llama here) is replaced by a KV budget: bytes of the model's K and V per token."""
    _sglang()
    from types import SimpleNamespace

    from torchtpu.integrations.sglang import platform
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))  # 2 layers, 1 KV head of 64
    args = lambda dtype, kv="auto": SimpleNamespace(  # noqa: E731
        model_path=model_dir, trust_remote_code=False, dtype=dtype, kv_cache_dtype=kv,
        max_total_tokens=None, attention_backend=None, sampling_backend=None, tp_size=1)
    per_token = 2 * 2 * 1 * 64 * 4
    assert platform.host_kv_tokens(args("float32"), available=2 * 1000 * per_token) == 1000
    assert platform.host_kv_tokens(args("auto", "bfloat16"), available=2000 * per_token) == 2000
    most = platform.DEFAULT_HOST_KV_TOKENS
    assert platform.host_kv_tokens(args("auto"), available=1 << 40) == most
    server_args = args("float32")
    platform.TpuSRTPlatform().apply_server_args_defaults(server_args)
    picked = (server_args.attention_backend, server_args.sampling_backend)
    assert picked == ("torch_native", "pytorch")
    assert 0 < server_args.max_total_tokens <= most


# (server argument, value, words of the refusal): each is refused before any process starts
UNSERVABLE = [("attention_backend", "triton", "--attention-backend triton does not run on"),
              ("decode_attention_backend", "flashinfer", "use torch_native"),
              ("tp_size", 2, "--tp-size 2: SGLang on device tpu runs one process"),
              ("speculative_algorithm", "EAGLE", "--speculative-algorithm EAGLE is not served"),
              ("quantization", "fp8", "--quantization fp8 is not served"),
              ("kv_cache_dtype", "fp8_e4m3", "--kv-cache-dtype fp8_e4m3 is not served")]


@pytest.mark.parametrize(("field", "value", "words"), UNSERVABLE)
def test_what_the_platform_cannot_serve_is_refused_by_name(field, value, words):
    _sglang()
    from types import SimpleNamespace

    from torchtpu.integrations.sglang import platform

    args = SimpleNamespace(attention_backend=None, kv_cache_dtype="auto", tp_size=1)
    platform.refuse_unservable(args)  # the defaults are served
    setattr(args, field, value)
    with pytest.raises(ValueError, match=f"torchtpu.unsupported: .*{words}"):
        platform.refuse_unservable(args)


def test_sglang_refuses_an_unservable_backend_at_start_up(tmp_path):
    """Through SGLang's own argument resolution, in the process that builds the arguments."""
    _sglang()
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))
    code = ("from sglang.srt.server_args import ServerArgs; import sys; "
            "ServerArgs(model_path=sys.argv[1], device='tpu', attention_backend='triton')"
            ".resolve_once()")
    run = subprocess.run([sys.executable, "-c", code, model_dir], env=_env("1"),
                         capture_output=True, text=True, timeout=300)
    assert run.returncode != 0
    assert "torchtpu.unsupported: --attention-backend triton does not run on device tpu" in (
        run.stderr), run.stderr[-3000:]
