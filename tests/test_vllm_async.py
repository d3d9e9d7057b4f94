"""vLLM's async scheduling on device "tpu" (the default): every kind of request a served step
meets gives the sync path's tokens, and its steps stay prepared on the host.

Async scheduling prepares a step before the last one's tokens reach the host: the step's program
reads them on the device (``host_steps.step_input_ids``), tokens sampled outside the program
(random sampling, penalties, logprobs) are kept there by one copy (``worker._keep_sampled``),
and the tokens' copy to the host is started, not waited for (``async_output.py``). Each engine
runs in a process of its own (vLLM picks its platform and scheduling once per process); vLLM
venv only.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

# One engine, one generate() of requests of every kind at once: prompts chunked beside decodes
# (max_num_batched_tokens=32), a KV cache too small for all of them (preemption), greedy,
# repetition penalty, seeded random sampling, n=2, logprobs, and (argv[3]) a stop string.
_CASES = r"""
import json, sys
import torch
import vllm
from vllm.v1.core.sched import scheduler
from torchtpu import metrics
from torchtpu.device import launch

model, stop = sys.argv[1], json.loads(sys.argv[2])
llm = vllm.LLM(model=model, max_model_len=128, max_num_seqs=8, max_num_batched_tokens=32,
               gpu_memory_utilization=0.01, kv_cache_memory_bytes=4 << 20,
               num_gpu_blocks_override=10, seed=0)
runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
preempted, preempt = [0], scheduler.Scheduler._preempt_request
def counted_preempt(*args, **kwargs):
    preempted[0] += 1
    return preempt(*args, **kwargs)
scheduler.Scheduler._preempt_request = counted_preempt
steps, launched = [], [0]
run, execute, sample = launch.run, runner.execute_model, runner.sample_tokens
def counted_run(label, fn, args):
    launched[0] += 1
    return run(label, fn, args)
def counted_execute(*args, **kwargs):
    launched[0] = 0
    return execute(*args, **kwargs)
def counted_sample(*args, **kwargs):
    out = sample(*args, **kwargs)
    steps.append([runner._fed is not None, launched[0]])
    return out
launch.run = counted_run
runner.execute_model, runner.sample_tokens = counted_execute, counted_sample
waits, synchronize = [0], torch.tpu.synchronize
def counted_synchronize(*args, **kwargs):  # the host waiting for the whole device
    waits[0] += 1
    return synchronize(*args, **kwargs)
torch.tpu.synchronize = counted_synchronize
prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((40, 9, 17, 30, 23))]
P = vllm.SamplingParams
params = [P(max_tokens=24, temperature=0, ignore_eos=True),
          P(max_tokens=24, temperature=0, repetition_penalty=1.5, ignore_eos=True),
          P(max_tokens=24, temperature=0.9, top_k=20, top_p=0.9, seed=5, ignore_eos=True),
          P(max_tokens=24, temperature=1.0, n=2, seed=11, ignore_eos=True),
          P(max_tokens=24, temperature=0, logprobs=2, ignore_eos=True)]
if stop:
    prompts.append(prompts[0])
    params.append(P(max_tokens=24, temperature=0, stop=[stop], ignore_eos=True))
before = metrics.snapshot()
outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
after = metrics.snapshot()
print("RESULT " + json.dumps({
    "async": llm.llm_engine.vllm_config.scheduler_config.async_scheduling,
    "steps": steps, "preempted": preempted[0], "device_waits": waits[0],
    "device_steps": after.get("vllm_async_device_steps", 0)
    - before.get("vllm_async_device_steps", 0),
    "copies_waited": after.get("vllm_async_copies_waited", 0)
    - before.get("vllm_async_copies_waited", 0),
    "ids": [[list(c.token_ids) for c in o.outputs] for o in outs],
    "text": [[c.text for c in o.outputs] for o in outs],
    "logprobs": [len(o.outputs[0].logprobs or []) for o in outs]}))
"""


def _run(model: str, mode: str, stop: str | None) -> dict:
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TORCHTPU_VLLM_ASYNC": mode}
    proc = subprocess.run([sys.executable, "-c", _CASES, model, json.dumps(stop)], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _stop_string(text: str) -> str | None:
    """A character of text past its first few (not a partly decoded byte)."""
    return next((c for c in text[3:] if c != "\ufffd" and not c.isspace()), None)


def test_async_steps_give_the_sync_tokens_for_every_kind_of_request(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model = str(save_tiny_model(tmp_path / "llama", "llama"))
    sync = _run(model, "0", None)
    stop = _stop_string(sync["text"][0][0])
    got = _run(model, "", stop)  # the default
    assert sync["async"] is False and got["async"] is True
    # greedy, penalized, seeded random, n=2 and logprobs requests: the sync path's tokens
    assert got["ids"][:5] == sync["ids"], (got["ids"], sync["ids"])
    # the KV cache held too few blocks for every request: some were preempted and recomputed
    assert got["preempted"] > 0 and sync["preempted"] > 0, (got, sync)
    assert got["logprobs"][4] == sync["logprobs"][4] == 24
    # every step was prepared on the host, sampled tokens kept on the device for the next,
    # and the host waited for the whole device only in vLLM's own copy of a step's tokens
    # with logprobs (counted; not before each step's inputs: vLLM's event)
    assert all(fed for fed, _ in got["steps"]) and got["device_steps"] == 0, got["steps"]
    assert 0 < got["device_waits"] == got["copies_waited"] <= 25, got
    if stop is not None:  # the stop string ends the request where it first appears
        text, ids = got["text"][5][0], got["ids"][5][0]
        assert stop not in text and sync["text"][0][0].startswith(text)
        assert ids == sync["ids"][0][0][:len(ids)] and len(ids) < 24
