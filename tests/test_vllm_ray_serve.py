"""vLLM on tpu under Ray Serve (``torchtpu/integrations/vllm/ray_serve.py``): 2 replicas on one
host, each driving its own device (XLA:CPU's forced device count standing in for a host's two
chips, Ray's ``TPU`` resource set to 2), OpenAI completions and chat requests over HTTP routed
to both, each answer's greedy tokens equal to Hugging Face's ``generate`` on CPU. One replica's
process is SIGKILLed while requests are in flight: each of those is answered (the ingress sends
those of the lost replica again to the other), the replica's engine process exits with it, Serve
starts a new replica on the freed device and later requests succeed on both. A deployment asking
for more devices than the host has is refused before any replica starts (CI's smoke selection;
the two-replica test is a full one: ~3 min and ~4 GB here, bench/RESULTS.md, "rlserve2"). One
local Ray instance, localhost only, bounded in time, Serve and Ray shut down
after it, also on failure. Needs the vLLM venv with ``pip install -e '.[serve]'``.
"""

import concurrent.futures
import json
import os
import signal
import sys
import time
import urllib.error
import urllib.request

import pytest
import torch

pytest.importorskip("vllm", reason="vLLM is not installed (docs, Serving (vLLM))")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[serve]'")

import ray  # noqa: E402
from ray import serve  # noqa: E402

from torchtpu.integrations.vllm import ray_serve  # noqa: E402
from torchtpu.integrations.vllm.server import free_port  # noqa: E402
from torchtpu.integrations.vllm.tiny import save_tiny_model  # noqa: E402
from torchtpu.testing.conformance import time_limit  # noqa: E402

DEVICES = 2
START_S = 900  # two engines starting side by side (~1 min here at load ~4; 5-11 at 12-22)
REQUEST_S = 120
PROMPTS = ["hello", "tpu serve", "abc"]
# tokens of the requests in flight when a replica is lost (EOS ignored), long enough to be still
# running when it is (at 200, some had finished on it within 0.5 s)
LONG = 480
ENGINE_ARGS = {"max_model_len": 512}
# nothing large travels through Ray's object store here (Ray's default: 30% of the host's memory)
OBJECT_STORE_BYTES = 256 << 20


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("serve") / "model", hidden=64, layers=2)


@pytest.fixture(scope="module")
def local_serve():
    env = {"PYTHONPATH": os.pathsep.join(sys.path), "TORCHTPU_VLLM": "1",
           "TORCHTPU_PLATFORM": "cpu", "JAX_PLATFORMS": "cpu",
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={DEVICES}",
           # each step shape compiles when a request first meets it, not all at start-up
           "TORCHTPU_VLLM_CAPTURE": "lazy"}
    ray.init(num_cpus=4, resources={"TPU": DEVICES}, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": env},
             object_store_memory=OBJECT_STORE_BYTES)
    port = free_port()
    try:
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        yield f"http://127.0.0.1:{port}"
    finally:
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


def _post(url: str, body: dict, timeout: float = REQUEST_S) -> tuple[int, dict | str]:
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def _hf_greedy(model, ids: list[int], n: int, ignore_eos: bool = False) -> list[int]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    pad = hf.config.eos_token_id
    if ignore_eos:  # past EOS, as vLLM's ignore_eos (not suppressing it: min_new_tokens would)
        hf.generation_config.eos_token_id = None
    x = torch.tensor([ids])
    with torch.no_grad():
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                        do_sample=False, pad_token_id=pad)
    return y[0, len(ids):].tolist()


def _expected(model) -> dict:
    """(kind, prompt) -> HF's greedy tokens on CPU."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out = {}
    for p in PROMPTS:
        out["text", p] = _hf_greedy(model, tok(p)["input_ids"], 8)
        chat = tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True, return_dict=False)
        out["chat", p] = _hf_greedy(model, list(chat), 8)
    return out


def _ask(base: str, kind: str, prompt: str, max_tokens: int = 8,
         ignore_eos: bool = False) -> tuple[int, dict | str]:
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": ignore_eos}
    if kind == "chat":
        return _post(f"{base}/v1/chat/completions",
                     {**body, "messages": [{"role": "user", "content": prompt}]})
    return _post(f"{base}/v1/completions", {**body, "prompt": prompt})


def _round(base: str, expected: dict) -> dict:
    """One request of each kind and prompt; every answer checked; pid -> its torchtpu block."""
    seen = {}
    for (kind, prompt), want in expected.items():
        status, out = _ask(base, kind, prompt)
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == want, (kind, prompt, out)
        seen[out["torchtpu"]["pid"]] = out["torchtpu"]
    return seen


def _until_both(base: str, expected: dict, seconds: float, avoid: int | None = None) -> dict:
    """Rounds of requests until two replicas (neither ``avoid``) have answered."""
    seen: dict = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.update({pid: t for pid, t in _round(base, expected).items() if pid != avoid})
        if len(seen) >= DEVICES:
            return seen
    raise AssertionError(f"only {sorted(seen)} answered in {seconds} s")


def _children(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def test_more_replicas_than_devices_is_refused(local_serve, model):
    with pytest.raises(ValueError) as e:
        ray_serve.app(str(model), num_replicas=DEVICES + 1)
    assert str(e.value) == (
        f"torchtpu.device: the Serve deployment asks for {DEVICES + 1} tpu devices "
        f"({DEVICES + 1} replicas of one device each), but this host has {DEVICES}: ask for "
        f"at most {DEVICES} replicas")
    assert not serve.status().applications


@pytest.mark.full  # two engines and their replicas: ~4 GB of host memory, ~3 min here
def test_two_replicas_serve_and_survive_a_lost_one(local_serve, model):
    import psutil
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)

    expected = _expected(model)
    with time_limit(START_S):
        serve.run(ray_serve.app(str(model), num_replicas=DEVICES, engine_args=ENGINE_ARGS),
                  name="vllm", route_prefix="/")
    with time_limit(START_S):
        before = _until_both(local_serve, expected, START_S)
    # each replica drives its own device: Ray's index, and the engine's JAX device
    assert sorted(t["device_index"] for t in before.values()) == list(range(DEVICES)), before
    assert len({t["engine_device"] for t in before.values()}) == DEVICES, before

    victim = min(before)
    engine_processes = _children(victim)
    assert engine_processes, "the replica started no engine process"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        inflight = [pool.submit(_ask, local_serve, "text", p, LONG, True) for p in PROMPTS * 2]
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=REQUEST_S + 30) for f in inflight]
    # every in-flight request is answered: those on the lost replica sent again to another
    assert [status for status, _ in results] == [200] * len(results), results
    assert all(out["torchtpu"]["pid"] != victim for _, out in results), results
    assert any(out["torchtpu"]["retries"] for _, out in results), results
    long = {p: _hf_greedy(model, tok(p)["input_ids"], LONG, ignore_eos=True) for p in PROMPTS}
    assert [out["choices"][0]["token_ids"] for _, out in results] == [
        long[p] for p in PROMPTS * 2]
    # the lost replica's engine process exits with it
    deadline = time.monotonic() + 60
    while any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE
              for p in engine_processes) and time.monotonic() < deadline:
        time.sleep(1)
    assert not [p for p in engine_processes if psutil.pid_exists(p)
                and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    # Serve replaces it on the freed device; later requests succeed on both
    with time_limit(START_S):
        after = _until_both(local_serve, expected, START_S, avoid=victim)
    assert victim not in after
    assert sorted(t["device_index"] for t in after.values()) == list(range(DEVICES)), after
