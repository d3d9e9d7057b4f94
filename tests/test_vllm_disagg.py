"""Prefill/decode disaggregation on device "tpu": a prefill and a decode ``vllm serve`` behind
vllm-router's prefill/decode mode, the KV handed over by vLLM's ExampleConnector through a local
directory (``routing.disaggregated``).

The router sends each request to the prefill instance, then to the decode instance, which reads
the prompt's KV from the files the prefill wrote (its external prefix-cache hits) instead of
computing it; the tokens equal one plain instance's. Heavy (three vLLM servers on a shared host:
minutes), so full-suite; needs the vLLM venv and ``pip install vllm-router==0.1.17``.
"""

from __future__ import annotations

import statistics
import time

import pytest

from torchtpu.integrations.vllm import routing, server

# longer than a 16-token block each, so whole blocks go through the files; the first request on
# each server compiles its programs, so a warm-up one goes first and is not timed
WARM_UP = "a warm-up request of some length, not timed, which compiles the programs"
PROMPTS = ["the quick brown fox jumps over the lazy dog, twice, and then once more",
           "write a short poem about the sea, a storm and an old lighthouse keeper alone"]
EXTERNAL = ("vllm:external_prefix_cache_queries_total", "vllm:external_prefix_cache_hits_total")


def _complete(url: str, model: str, prompt: str) -> tuple[list[int], float, list[float]]:
    """Greedy completion of ``prompt`` streamed from ``url``: (tokens, TTFT, ITLs) in seconds."""
    body = {"model": model, "prompt": prompt, "max_tokens": 12, "temperature": 0,
            "ignore_eos": True, "return_token_ids": True}
    start = time.perf_counter()
    ids, times = [], []
    for t, event in server.stream(url + "/v1/completions", body, timeout=300):
        new = event["choices"][0].get("token_ids") or []
        if new:
            ids += new
            times.append(t)
    return ids, times[0] - start, [b - a for a, b in zip(times, times[1:])]


def test_disaggregated_refuses_a_bad_role():
    with pytest.raises(ValueError, match="role='both'"):
        routing.kv_transfer_args("both", "/tmp")
    with pytest.raises(ValueError, match="prefill and a decode server"):
        routing.router_command(1, ["http://a"], "round_robin", 1, 2, disaggregated=True)


@pytest.mark.full
def test_prefill_and_decode_instances_behind_the_router_give_one_instances_tokens(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed: "
                        "python -m torchtpu.integrations.vllm.install")
    pytest.importorskip("vllm_router", reason=f"pip install {routing.ROUTER_PIN}")
    from test_vllm_routing import _refused

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model = str(save_tiny_model(tmp_path / "llama", "llama"))
    storage = tmp_path / "kv"
    storage.mkdir()
    with routing.disaggregated(model, str(storage), start_timeout=900) as fleet:
        prefill, decode = fleet.replicas
        _complete(fleet.url, model, WARM_UP)
        before = routing.counters(decode, EXTERNAL)
        split = [_complete(fleet.url, model, p) for p in PROMPTS]
        after = routing.counters(decode, EXTERNAL)
        prefilled = routing.prefix_cache(prefill)
    assert all(_refused(u) for u in (fleet.url, *fleet.replicas))
    with server.serve(model, "tpu") as url:
        _complete(url, model, WARM_UP)
        whole = [_complete(url, model, p) for p in PROMPTS]

    # the prefill wrote each prompt's KV (one folder of layer files per prompt) ...
    folders = [d for d in storage.iterdir() if d.is_dir()]
    assert len(folders) == len(PROMPTS) + 1 and all(any(d.glob("*.safetensors")) for d in folders)
    assert prefilled.queries > 0
    # ... and the decode read whole blocks of it: all of each prompt but its last block
    hits = after[EXTERNAL[1]] - before[EXTERNAL[1]]
    want = sum((len(p) - 2) // 16 * 16 for p in PROMPTS)
    assert hits == want, (before, after, want)
    assert [ids for ids, *_ in split] == [ids for ids, *_ in whole]
    assert all(len(ids) == 12 for ids, *_ in split)
    for name, runs in (("disaggregated", split), ("one instance", whole)):
        ttft = statistics.median(t for _, t, _ in runs)
        itl = statistics.median(x for *_, itls in runs for x in itls)
        print(f"{name}: TTFT {ttft * 1e3:.0f} ms, ITL {itl * 1e3:.0f} ms (medians of "
              f"{len(runs)} requests, one at a time, after a warm-up)")

