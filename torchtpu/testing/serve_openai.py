"""Serving engines under Ray Serve on tpu, for tests: one local Ray and Serve, OpenAI requests,
Hugging Face's greedy tokens on CPU to compare them with (``tests/test_*_ray_serve.py``).

:func:`local_serve` starts Ray with ``devices`` tpu devices on XLA:CPU's forced device count
(Ray's ``TPU`` resource) and Serve's HTTP proxy on localhost, and shuts both down when the block
exits, on failure too. :func:`ask` sends one completions or chat request; :func:`expected` is
HF's greedy answer to each; :func:`until_replicas` sends rounds until enough replicas answered.
"""

from __future__ import annotations

import contextlib
import json
import os
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator

from torchtpu import settings
from torchtpu.integrations.vllm.server import free_port

# nothing large travels through Ray's object store here (Ray's default: 30% of the host's memory)
OBJECT_STORE_BYTES = 256 << 20
REQUEST_S = 120


@contextlib.contextmanager
def local_serve(devices: int, env: dict[str, str] | None = None) -> Iterator[str]:
    """Yield the base URL of Serve's HTTP proxy on a local Ray of ``devices`` tpu devices;
    ``env``: more variables for every Ray worker."""
    import ray
    from ray import serve

    env = {"PYTHONPATH": os.pathsep.join(sys.path), "JAX_PLATFORMS": "cpu",
           **settings.child_env({settings.PLATFORM: "cpu"}),
           "XLA_FLAGS": f"--xla_force_host_platform_device_count={devices}", **(env or {})}
    ray.init(num_cpus=4, resources={"TPU": devices}, include_dashboard=False,
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


def refuses_more_replicas_than_devices(app, model, devices: int) -> None:
    """``app`` (an engine's ``ray_serve.app``) asked for one replica more than the host's
    ``devices`` raises torchtpu's error naming both counts, and no application starts."""
    import pytest
    from ray import serve

    with pytest.raises(ValueError) as e:
        app(str(model), num_replicas=devices + 1)
    assert str(e.value) == (
        f"torchtpu.device: the Serve deployment asks for {devices + 1} tpu devices "
        f"({devices + 1} replicas of one device each), but this host has {devices}: ask for "
        f"at most {devices} replicas")
    assert not serve.status().applications


def post(url: str, body: dict, timeout: float = REQUEST_S) -> tuple[int, dict | str]:
    """(HTTP status, JSON answer or error text) of POSTing ``body``."""
    request = urllib.request.Request(url, json.dumps(body).encode(),
                                     {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(request, timeout=timeout) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode(errors="replace")


def hf_greedy(model, ids: list[int], n: int, ignore_eos: bool = False) -> list[int]:
    """Hugging Face ``generate``'s ``n`` greedy tokens after ``ids`` on CPU."""
    import torch
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model).eval()
    pad = hf.config.eos_token_id
    if ignore_eos:  # on past EOS as ignore_eos does (min_new_tokens would suppress EOS)
        hf.generation_config.eos_token_id = None
    x = torch.tensor([ids])
    with torch.no_grad():
        y = hf.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=n,
                        do_sample=False, pad_token_id=pad)
    return y[0, len(ids):].tolist()


def expected(model, prompts: list[str]) -> dict:
    """(kind, prompt) -> HF's 8 greedy tokens on CPU, for completions ("text") and chat."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(model)
    out = {}
    for p in prompts:
        out["text", p] = hf_greedy(model, tok(p)["input_ids"], 8)
        chat = tok.apply_chat_template([{"role": "user", "content": p}],
                                       add_generation_prompt=True, return_dict=False)
        out["chat", p] = hf_greedy(model, list(chat), 8)
    return out


def ask(base: str, kind: str, prompt: str, max_tokens: int = 8,
        ignore_eos: bool = False) -> tuple[int, dict | str]:
    """One greedy OpenAI request ("text": completions, "chat": chat completions)."""
    body = {"model": "tiny", "max_tokens": max_tokens, "temperature": 0,
            "return_token_ids": True, "ignore_eos": ignore_eos}
    if kind == "chat":
        return post(f"{base}/v1/chat/completions",
                    {**body, "messages": [{"role": "user", "content": prompt}]})
    return post(f"{base}/v1/completions", {**body, "prompt": prompt})


def one_round(base: str, want: dict) -> dict:
    """One request of each (kind, prompt) of ``want`` (:func:`expected`), every answer checked
    against it; returns pid -> the answering replica's ``torchtpu`` block."""
    seen = {}
    for (kind, prompt), tokens in want.items():
        status, out = ask(base, kind, prompt)
        assert status == 200, out
        assert out["choices"][0]["token_ids"] == tokens, (kind, prompt, out)
        seen[out["torchtpu"]["pid"]] = out["torchtpu"]
    return seen


def until_replicas(base: str, want: dict, replicas: int, seconds: float,
                   avoid: int | None = None) -> dict:
    """Rounds of requests until ``replicas`` replicas (none of them ``avoid``) have answered."""
    seen: dict = {}
    deadline = time.monotonic() + seconds
    while time.monotonic() < deadline:
        seen.update({pid: t for pid, t in one_round(base, want).items() if pid != avoid})
        if len(seen) >= replicas:
            return seen
    raise AssertionError(f"only {sorted(seen)} answered in {seconds} s")


def _engine_processes(pid: int) -> list[int]:
    import psutil

    return [c.pid for c in psutil.Process(pid).children(recursive=True)]


def _running(pids: list[int]) -> list[int]:
    import psutil

    alive = []
    for p in pids:
        with contextlib.suppress(psutil.NoSuchProcess):
            if psutil.Process(p).status() != psutil.STATUS_ZOMBIE:
                alive.append(p)
    return alive


def survive_a_lost_replica(base: str, model, prompts: list[str], before: dict, tokens: int,
                           replicas: int, start_s: float) -> dict:
    """SIGKILL the replica of ``before`` (pid -> ``torchtpu`` block, :func:`until_replicas`)
    with the lowest pid while two greedy requests of each prompt (``tokens`` each, EOS ignored)
    are in flight; check that every one is answered with HF's tokens (those on the lost replica
    sent again to another), that the replica's engine processes exit with it, and that Serve's
    new replica and the others answer again. Returns the replicas answering after."""
    import concurrent.futures
    import signal

    from transformers import AutoTokenizer

    victim = min(before)
    engine = _engine_processes(victim)
    assert engine, "the replica started no engine process"
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        inflight = [pool.submit(ask, base, "text", p, tokens, True) for p in prompts * 2]
        time.sleep(0.5)
        os.kill(victim, signal.SIGKILL)
        results = [f.result(timeout=REQUEST_S + 30) for f in inflight]
    # every in-flight request is answered: those on the lost replica sent again to another
    assert [status for status, _ in results] == [200] * len(results), results
    assert all(out["torchtpu"]["pid"] != victim for _, out in results), results
    assert any(out["torchtpu"]["retries"] for _, out in results), results
    tok = AutoTokenizer.from_pretrained(model)
    long = {p: hf_greedy(model, tok(p)["input_ids"], tokens, ignore_eos=True) for p in prompts}
    assert [out["choices"][0]["token_ids"] for _, out in results] == [
        long[p] for p in prompts * 2]
    # the lost replica's engine processes exit with it
    deadline = time.monotonic() + 60
    while _running(engine) and time.monotonic() < deadline:
        time.sleep(1)
    assert not _running(engine), engine
    # Serve replaces it; later requests succeed on every replica
    after = until_replicas(base, expected(model, prompts), replicas, start_s, avoid=victim)
    assert victim not in after
    return after
