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


def test_fed_buffers_travel_as_one_transfer_of_the_rows_the_step_reads():
    from torchtpu import metrics

    big = torch.zeros(6, dtype=torch.int64, device="tpu")
    table = torch.zeros(4, 3, dtype=torch.int32, device="tpu")
    mask = torch.zeros(5, dtype=torch.bool, device="tpu")
    small = torch.zeros(3, dtype=torch.int16, device="tpu")
    scale = torch.zeros(2, dtype=torch.float32, device="tpu")
    host = {"big": np.array([7, -1, 2**40 + 7, -(2**35), 2**31, 5], np.int64),
            "table": np.arange(12, dtype=np.int32).reshape(4, 3) - 5,
            "mask": np.array([1, 0, 1, 1, 0], bool), "small": np.array([-300, 2, 9], np.int16),
            "scale": np.array([1.5, -2.25], np.float32)}
    feeds = HostFeeds()
    feeds.add(big, lambda: host["big"], lambda tokens, reqs: tokens)  # reads [:tokens]
    feeds.add(table, lambda: host["table"], lambda tokens, reqs: reqs)
    for t, name in ((mask, "mask"), (small, "small"), (scale, "scale")):
        feeds.add(t, lambda name=name: host[name])
    graphs = StepGraphs()

    def step():  # whole buffers: past the rows the step reads, the program sees zeros
        return (big * 3 + 1, table.sum(0), torch.where(mask, big[:5], -big[:5]),
                small.to(torch.int32) * 2, scale * 2)

    for r in range(3):
        host["big"][0], host["table"][1, 2], host["mask"][4] = r, 10 * r, r % 2 == 1
        host["small"][1], host["scale"][0] = r - 9, r / 4
        before = metrics.snapshot().get("fed_transfers", 0)
        out = graphs("step", step, feeds.step(4, 2))
        assert metrics.snapshot()["fed_transfers"] - before == 1  # five buffers, one transfer
        cpu = {k: torch.from_numpy(v.copy()) for k, v in host.items()}
        cpu["big"][4:] = 0
        cpu["table"][2:] = 0
        want = (cpu["big"] * 3 + 1, cpu["table"].sum(0),
                torch.where(cpu["mask"], cpu["big"][:5], -cpu["big"][:5]),
                cpu["small"].to(torch.int32) * 2, cpu["scale"] * 2)
        for got, expected in zip(out, want):
            torch.testing.assert_close(got.cpu(), expected, rtol=0, atol=0)
    assert (graphs.captures, graphs.replays) == (1, 3)


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

from torchtpu.integrations.vllm import async_output, host_steps

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
copies, host_copy = [0], async_output._HostCopy.__init__
def counted_copy(*args):  # a step's tokens read to the host without waiting (async)
    copies[0] += 1
    host_copy(*args)
async_output._HostCopy.__init__ = counted_copy
params = vllm.SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
rounds = [llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
          for _ in range(2)]
print("RESULT " + json.dumps({
    "async": llm.llm_engine.vllm_config.scheduler_config.async_scheduling, "copies": copies[0],
    "at_start": at_start, "after": runner.step_graphs.captures, "steps": steps,
    "compiles": compiles[0] - compiled_at_start,
    "tokens": [[list(o.outputs[0].token_ids) for o in outs] for outs in rounds]}))
"""


@pytest.mark.parametrize("budget,dtype,async_", [
    ("default", "float32", "0"), ("0", "float32", "0"), ("default", "float32", "1"),
    pytest.param("default", "bfloat16", "0", marks=pytest.mark.full)])
def test_every_step_shape_is_compiled_at_start_up_and_runs_as_one_program(tmp_path, budget,
                                                                          dtype, async_):
    """With budget 0 no bucket of steps with prefills pads to the whole context: they pad to
    each step's longest query and context, captured (and compiled) when first met. bfloat16:
    the program's logits are float32 (vLLM's sampler's dtype), else its cast and the sampler's
    ops ran eagerly, 4 programs more a step and compiles after start-up. Async scheduling
    (``TORCHTPU_VLLM_ASYNC=1``): each step is prepared before the last one's tokens reach the
    host, its program reads them on the device (``host_steps.step_input_ids``), and the
    tokens' copy to the host is started, not waited for (``async_output.py``): the same
    steps, one program each, the same tokens."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from transformers import AutoModelForCausalLM

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))
    # 5 requests (padded to 8), prompts of 3 to 40 tokens: contexts of 1 to 4 blocks
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((3, 9, 17, 30, 40))]
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TORCHTPU_VLLM_ASYNC": async_}
    proc = subprocess.run([sys.executable, "-c", _SERVE, model_dir, json.dumps(prompts), budget,
                           dtype],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["async"] is (async_ == "1"), got
    # with async scheduling every step's tokens were copied without a wait
    assert got["copies"] == (len(got["steps"]) if async_ == "1" else 0), got
    # start-up captured every step shape: decodes, 4 request buckets (1, 2, 4, 8) x 4 contexts
    # of 1, 2, 4, 8 blocks (128 tokens), each in two programs (logits and tokens, or the tokens
    # alone: these greedy decodes run those, sampling.py), and steps with prefills, 3 token
    # buckets (16, 32, 64) x 4 request buckets; generating captured none and compiled no
    # program at all
    if budget == "default":
        assert got["at_start"] == 2 * 16 + 12 and got["after"] == got["at_start"], got
        assert got["compiles"] == 0, got
    else:
        assert got["at_start"] == 2 * 16 and got["after"] > got["at_start"], got
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


# In a process of its own: bench/serving_chip.py's load (a warm-up round, then the timed one)
# with lazy capture, so that each step shape compiles when a round first meets it
_LOAD = r"""
import json, random, sys
sys.path.insert(0, sys.argv[2])
import serving_chip, serving_diag, serving_jax
import vllm

config = serving_jax.CONFIGS["tiny"]
counter = serving_diag.CompileCounter()
llm = vllm.LLM(model=sys.argv[1], max_model_len=64, max_num_seqs=16, max_num_batched_tokens=64,
               kv_cache_memory_bytes=8 << 20, seed=0)
runner = serving_diag.runner_of(llm)
rng = random.Random(0)
warm, timed = ([[rng.randrange(config["vocab_size"] - 2) for _ in range(40)] for _ in range(16)]
               for _ in range(2))
run = serving_chip.timed_load(llm, config, warm, timed, 16, counter)
shapes = sorted((k[0].num_tokens, k[0].num_reqs) for k, _ in runner.step_graphs._graphs)
print("RESULT " + json.dumps({"compiles": run["compiles"], "shapes": shapes,
                              "tokens": run["output_tokens"],
                              "replay": serving_diag.replay_time(runner, repeats=2)}))
"""


def test_the_benchmarks_warm_up_meets_every_step_shape_of_its_timed_round(tmp_path):
    """16 requests of 40 tokens, 16 out, prefills chunked 64 tokens a step: the timed round's
    steps hold every running request's decode beside a prefill chunk, up to 16 requests. Its
    warm-up runs the same lengths, so the round compiles nothing. A 4-token warm-up (the chip
    run of session 24: 6 compiles inside the round at 256 requests) ended each request after
    3 decodes, and the round then compiled 7 programs (its steps of 16 requests among them)."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    bench = os.path.join(os.path.dirname(__file__), os.pardir, "bench")
    sys.path.insert(0, bench)
    try:
        import serving_chip
    finally:
        sys.path.remove(bench)
    model_dir = str(serving_chip.make_model("tiny", tmp_path / "tiny"))
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TORCHTPU_VLLM_CAPTURE": "lazy", "TORCHTPU_CACHE_DIR": "off"}
    proc = subprocess.run([sys.executable, "-c", _LOAD, model_dir, bench], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    assert got["tokens"] == 16 * 16, got
    # the round's largest steps: a prefill chunk beside 15 decodes, and 16 decodes
    assert [64, 16] in got["shapes"] and [16, 16] in got["shapes"], got
    assert got["compiles"] == 0, got
    # the chip diagnosis's split of a replay's launch runs here too
    split = got["replay"]["launch_split"]
    # (the fed buffers the step program reads: 7 of the 8 at a decode)
    assert 0 < split["host_fed"] <= 8 < split["arguments"], got["replay"]
    assert all(split[k] > 0 for k in ("arguments_s", "call_s", "store_s", "call_device_fed_s",
                                      "trivial_same_args_s")), split


def test_a_buffers_head_is_one_view_per_bucket_and_reads_the_buffers_writes():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from torchtpu.integrations.vllm.host_steps import HostSteps

    runner = HostSteps()
    runner._views = {}
    buffer = torch.arange(8, dtype=torch.int32, device="tpu")
    head = runner.head_of(buffer, 4)
    assert runner.head_of(buffer, 4) is head  # made once per buffer and bucket
    assert runner.head_of(buffer, 2).shape == (2,)
    buffer.copy_(torch.arange(8, 16, dtype=torch.int32))  # a step writes the whole buffer
    assert head.cpu().tolist() == [8, 9, 10, 11]
    buffer[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.int32)  # ...or its rows
    assert head.cpu().tolist() == [1, 2, 3, 4]
    other = torch.zeros(8, dtype=torch.int32, device="tpu")
    runner._views[(id(other), 4)] = runner._views[(id(buffer), 4)]  # an id reused
    assert runner.head_of(other, 4).cpu().tolist() == [0, 0, 0, 0]


def test_a_steps_key_names_every_layers_slot_tensor():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from torchtpu.integrations.vllm.worker import _slots_key

    a, b = (torch.full((8,), -1, dtype=torch.int64, device="tpu") for _ in range(2))
    layers = ["model.layers.0.attn", "model.layers.1.attn", "model.layers.2.attn"]
    shared = _slots_key(dict.fromkeys(layers, a))  # a host-prepared step: one tensor for all
    assert shared == _slots_key(dict.fromkeys(reversed(layers), a))  # (the dict's order)
    assert shared != _slots_key(dict.fromkeys(layers, b))  # another tensor
    assert shared != _slots_key(dict.fromkeys(layers, a[:4]))  # another length
    assert shared != _slots_key(dict.fromkeys(layers[:2], a))  # another set of layers
    per_layer = {layers[0]: a, layers[1]: b, layers[2]: a}  # vLLM's own, layer by layer
    assert _slots_key(per_layer) != _slots_key({layers[0]: b, layers[1]: a, layers[2]: a})
    assert _slots_key(per_layer) != shared
    assert _slots_key(None) == _slots_key({}) == ()


def test_the_tokens_read_fills_the_cpu_tensor_vllm_holds_in_place():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    import jax.numpy as jnp

    from torchtpu.integrations.vllm.async_output import _HostCopy

    array = jnp.arange(10, dtype=jnp.int32).reshape(10, 1) * 3  # a program's padded tokens
    with torch.inference_mode():  # vLLM makes its CPU tensor so
        into = torch.zeros(4, 1, dtype=torch.int32)
    held = into  # vLLM keeps this very tensor (input_batch.set_async_sampled_token_ids)
    copy = _HostCopy(array, into, offset=2)
    copy.synchronize()
    assert held.tolist() == [[6], [9], [12], [15]] and copy.query()
    copy.synchronize()  # once: a second wait reads nothing again
    assert held.tolist() == [[6], [9], [12], [15]]
