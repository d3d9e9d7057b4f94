"""Captured vLLM decode steps fed from the host (``integrations/vllm/graphs.py``, ``worker.py``).

The first tests need torchtpu only: a captured program reads a fed buffer's host values at every
replay, never the device copy. The last runs ``vllm.LLM`` on device "tpu" (vLLM venv): every step
shape (decodes, chunked prefills mixed with decodes, prefix-cache hits) is captured and compiled
at start-up, no program compiles while generating, each step is one program prepared on the
host, and the greedy tokens equal Hugging Face's.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from torchtpu.integrations.vllm.graphs import HostFeeds, StepGraphs


def test_a_fed_buffer_is_read_from_the_host_at_every_replay():
    table = torch.arange(10.0)
    weights = table.to("tpu")
    index = torch.zeros(8, dtype=torch.int64, device="tpu")  # the device copy stays zeros
    host = np.zeros(8, dtype=np.int64)
    feeds = HostFeeds()
    feeds.add(index, lambda: host)
    graphs = StepGraphs()

    def step():
        return weights[index[:4]] * 2, index.sum()

    for values in ([1, 2, 3, 4], [9, 0, 5, 7], [3, 3, 8, 1]):
        host[:4] = values
        out, total = graphs("decode", step, feeds)
        torch.testing.assert_close(out.cpu(), table[torch.tensor(values)] * 2)
        assert total.item() == sum(values)
    assert (graphs.captures, graphs.replays) == (1, 3)
    assert index.cpu().tolist() == [0] * 8  # the program read the host, not this


def test_materialize_writes_the_host_values_into_the_device_buffer():
    buf = torch.zeros(2, 3, dtype=torch.int32, device="tpu")
    host = np.arange(6, dtype=np.int32).reshape(2, 3)
    feeds = HostFeeds()
    feeds.add(buf, lambda: host)
    feeds.materialize()
    assert buf.cpu().tolist() == host.tolist()


def test_feeds_refuse_a_host_tensor_and_installing_outside_a_capture():
    feeds = HostFeeds()
    with pytest.raises(ValueError, match="lives on 'tpu'"):
        feeds.add(torch.zeros(2), lambda: np.zeros(2))
    with pytest.raises(RuntimeError, match="outside a graph capture"):
        feeds.install()


def test_prefill_buckets_keep_their_padded_attention_within_the_budget():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from torchtpu.integrations.vllm import host_steps

    # the bench's server: every bucket pads to the whole context
    small = host_steps.prefill_grid(2048, 32, 256, heads=2)
    assert len(small) == 41 and (2048, 32) in small and (16, 1) in small
    # a 32-head model, 4096 tokens of context, 256 requests: the buckets whose whole-context
    # attention would pass the budget are left to compile when met
    big = host_steps.prefill_grid(8192, 256, 4096, heads=32)
    assert big and all(r * 32 * min(t, 4096) * 4096 <= host_steps.SCORE_BUDGET for t, r in big)
    assert (8192, 256) not in big and (16, 1) in big
    assert not host_steps.whole_context(8192, 256, 4096, 32)


# In a process of its own (vLLM picks its platform once per process). Prints one JSON line.
# max_num_batched_tokens=64 splits the prompts into chunks and mixes them with decodes; the
# second generate() meets the first's prompts in the prefix cache (context read, fewer tokens).
_SERVE = r"""
import json, sys
import jax
import vllm
from torchtpu.device import launch

from torchtpu.integrations.vllm import host_steps

model, prompts = sys.argv[1], json.loads(sys.argv[2])
if sys.argv[3] != "default":
    host_steps.SCORE_BUDGET = int(sys.argv[3])
compiles = [0]
def on_compile(event, duration, **kwargs):
    if event == "/jax/core/compile/backend_compile_duration":
        compiles[0] += 1
def on_event(event, **kwargs):
    if event == "/jax/compilation_cache/cache_hits":  # a program loaded is compiled too
        compiles[0] += 1
jax.monitoring.register_event_duration_secs_listener(on_compile)
jax.monitoring.register_event_listener(on_event)
llm = vllm.LLM(model=model, dtype=sys.argv[4], max_model_len=128, max_num_seqs=8,
               max_num_batched_tokens=64, gpu_memory_utilization=0.01,
               kv_cache_memory_bytes=4 << 20)
runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
at_start, compiled_at_start = runner.step_graphs.captures, compiles[0]
steps, launched = [], []  # per step: [prepared on the host, a prefill, programs launched]
run, execute, sample = launch.run, runner.execute_model, runner.sample_tokens

def counted_run(label, fn, args):
    launched.append(str(label))
    return run(label, fn, args)

def counted_execute(*args, **kwargs):
    launched.clear()
    return execute(*args, **kwargs)

def counted_sample(*args, **kwargs):  # the step's sampling and bookkeeping: its end
    out = sample(*args, **kwargs)
    steps.append([runner._fed is not None, not runner._fed_decode, len(launched)])
    return out

launch.run = counted_run
runner.execute_model, runner.sample_tokens = counted_execute, counted_sample
params = vllm.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
rounds = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
          for _ in range(2)]
print("RESULT " + json.dumps({
    "at_start": at_start, "after": runner.step_graphs.captures, "steps": steps,
    "compiles": compiles[0] - compiled_at_start,
    "tokens": [[list(o.outputs[0].token_ids) for o in outs] for outs in rounds]}))
"""


@pytest.mark.parametrize("budget,dtype", [
    ("default", "float32"), ("0", "float32"),
    pytest.param("default", "bfloat16", marks=pytest.mark.full)])
def test_every_step_shape_is_compiled_at_start_up_and_runs_as_one_program(tmp_path, budget,
                                                                          dtype):
    """With budget 0 no bucket of steps with prefills pads to the whole context: they pad to
    each step's longest query and context, captured (and compiled) when first met. bfloat16:
    the program's logits are float32 (vLLM's sampler's dtype), else its cast and the sampler's
    ops ran eagerly, 4 programs more a step and compiles after start-up."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from transformers import AutoModelForCausalLM

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))
    # 5 requests (padded to 8), prompts of 3 to 40 tokens: contexts of 1 to 4 blocks
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((3, 9, 17, 30, 40))]
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", _SERVE, model_dir, json.dumps(prompts), budget,
                           dtype],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    # start-up captured every step shape: decodes, 4 request buckets (1, 2, 4, 8) x 4 contexts
    # of 1, 2, 4, 8 blocks (128 tokens), and steps with prefills, 3 token buckets (16, 32, 64)
    # x 4 request buckets; generating captured none and compiled no program at all
    if budget == "default":
        assert got["at_start"] == 16 + 12 and got["after"] == got["at_start"], got
        assert got["compiles"] == 0, got
    else:
        assert got["at_start"] == 16 and got["after"] > got["at_start"], got
    steps = got["steps"]
    # every step was prepared on the host, chunks of prompts mixed with decodes among them
    assert all(fed for fed, _, _ in steps), steps
    assert sum(prefill for _, prefill, _ in steps) >= 3, steps
    # ...and launched one program: inputs, forward, logits, greedy tokens (vLLM's int32
    # column); the tokens' copy to the host is no program (a step that captures launches more)
    if budget == "default":
        assert [n for _, _, n in steps] == [1] * len(steps), steps
    if dtype == "bfloat16":  # HF's float32 tokens part from bfloat16 ones: the rounds agree
        assert got["tokens"][0] == got["tokens"][1], got
        return
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for ids, first, again in zip(prompts, *got["tokens"]):
        want = hf.generate(torch.tensor([ids]), max_new_tokens=12, min_new_tokens=12,
                           do_sample=False)[0, len(ids):].tolist()
        assert first == want and again == want


# In a process of its own: start-up with lazy capture, the programs it compiled by name; the
# memory vLLM's own dummy sampler run holds at most (its live arrays after each op), beside what
# the profile holds instead; a sampled request after start-up.
_SAMPLER = r"""
import json, logging, sys
import jax
import torch
import vllm
from vllm.v1.worker.gpu_model_runner import GPUModelRunner
from torchtpu.device import launch, memory
from torchtpu.integrations.vllm import worker

names = []
class Names(logging.Handler):
    def emit(self, record):
        if record.getMessage().startswith("Compiling "):
            names.append(record.getMessage().split()[1])
jax.config.update("jax_log_compiles", True)
log = logging.getLogger("jax._src.interpreters.pxla")
log.addHandler(Names()); log.propagate = False
llm = vllm.LLM(model=sys.argv[1], max_model_len=128, max_num_seqs=64,
               kv_cache_memory_bytes=4 << 20)
at_start = list(names)
runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
vocab = llm.llm_engine.model_config.get_vocab_size()
peak, run = [0], launch.run
base = memory._live_bytes()
def counted(label, fn, args):
    out = run(label, fn, args)
    peak[0] = max(peak[0], memory._live_bytes() - base)
    return out
launch.run = counted
hidden = torch.zeros(64, runner.model_config.get_hidden_size(), device=runner.device)
GPUModelRunner._dummy_sampler_run(runner, hidden)
launch.run = run
params = vllm.SamplingParams(max_tokens=6, temperature=0.8, top_p=0.9, top_k=20, seed=1,
                             ignore_eos=True)
out = llm.generate([{"prompt_token_ids": [3, 4, 5]}], params, use_tqdm=False)
print("RESULT " + json.dumps({
    "at_start": at_start, "peak": peak[0], "held": worker.SAMPLER_LOGITS_COPIES * 64 * vocab * 4,
    "tokens": list(out[0].outputs[0].token_ids)}))
"""


def test_start_up_holds_the_samplers_memory_without_compiling_its_ops(tmp_path):
    """The memory profile holds what vLLM's sampler would take at max_num_seqs rows instead of
    running it: its sort, scatter and their checks over [max_num_seqs, vocab] compiled only for
    the profile (no served step has that shape), ~65 s of the v5e's 152-s start-up. The held
    bytes cover the sampler's own peak (measured here, vLLM's dummy run called as vLLM calls
    it), and a sampled request runs after start-up."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TORCHTPU_VLLM_CAPTURE": "lazy"}
    proc = subprocess.run([sys.executable, "-c", _SAMPLER, model_dir], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    sampler_ops = [n for n in got["at_start"] if any(
        op in n for op in ("sort", "scatter", "cumsum", "exponential", "softmax"))]
    assert not sampler_ops, sampler_ops
    assert 0 < got["peak"] <= got["held"], got
    assert len(got["tokens"]) == 6, got


# In a process of its own: a bfloat16 model's captured steps, the argmax over the vocabulary in
# each program that samples (its operand's dtype and shape), by the program's jaxpr.
_ARGMAX = r"""
import json, sys
import jax
import vllm

llm = vllm.LLM(model=sys.argv[1], dtype="bfloat16", max_model_len=128, max_num_seqs=8,
               max_num_batched_tokens=64, kv_cache_memory_bytes=4 << 20)
runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
vocab = llm.llm_engine.model_config.get_vocab_size()

def argmaxes(jaxpr):
    for eqn in jaxpr.eqns:
        if eqn.primitive.name == "argmax":
            yield str(eqn.invars[0].aval.dtype), eqn.invars[0].aval.shape[-1]
        for p in eqn.params.values():
            inner = getattr(p, "jaxpr", p)
            if hasattr(inner, "eqns"):
                yield from argmaxes(inner)

found = []
for (_, samples), entry in runner.step_graphs._graphs.items():
    if samples:
        captured = entry[0]._captured
        avals = [jax.ShapeDtypeStruct(a.shape, a.dtype) for a in captured._io.arguments()]
        jaxpr = jax.make_jaxpr(captured._fn.jitted)(*avals).jaxpr
        found.append([d for d, n in argmaxes(jaxpr) if n == vocab])
print("RESULT " + json.dumps(found))
"""


def test_a_bfloat16_steps_greedy_tokens_are_the_argmax_of_its_bfloat16_logits(tmp_path):
    """The program's float32 logits are an exact cast of the model's bfloat16 ones, so their
    argmax is taken before the cast: XLA then computes it inside the head's fusion instead of
    reading the float32 logits back from HBM (Qwen2.5-0.5B at 256 requests compiled for v5e:
    156 MB a step less; bench/RESULTS.md, serving6). The tokens: the bfloat16 serving test."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.run([sys.executable, "-c", _ARGMAX, model_dir], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    found = json.loads(lines[-1][len("RESULT "):])
    # every sampling program start-up captured: one argmax over the vocabulary, of bfloat16
    assert found and all(f == ["bfloat16"] for f in found), found
