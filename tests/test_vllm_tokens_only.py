"""Tokens-only programs (``integrations/vllm/sampling.py``): an all-greedy decode step without
logprobs or logits processors runs its bucket's program that returns the greedy tokens alone,
never the logits. Every fact that choice reads is changed alone here (the decision function
against vLLM's own metadata and processors), and served requests of each kind get the tokens
HF's greedy ``generate()`` gives on CPU, ties included. vLLM venv only.
"""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

import pytest
import torch


def _metadata(**changes):
    from vllm.v1.sample.logits_processor import LogitsProcessors
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinPLogitsProcessor,
        MinTokensLogitsProcessor,
    )
    from vllm.v1.sample.metadata import SamplingMetadata

    config = type("Config", (), {"scheduler_config": type("S", (), {"max_num_seqs": 4})})()
    procs = LogitsProcessors([MinTokensLogitsProcessor(config, "cpu", False),
                              LogitBiasLogitsProcessor(config, "cpu", False),
                              MinPLogitsProcessor(config, "cpu", False)])
    zeros = torch.zeros(2)
    meta = SamplingMetadata(
        temperature=None, all_greedy=True, all_random=False, top_p=None, top_k=None,
        generators={}, max_num_logprobs=None, no_penalties=True, prompt_token_ids=None,
        frequency_penalties=zeros, presence_penalties=zeros, repetition_penalties=zeros,
        output_token_ids=[[], []], allowed_token_ids_mask=None, bad_words_token_ids={},
        logitsprocs=procs)
    return dataclasses.replace(meta, **changes)


def test_each_fact_that_reads_the_logits_alone_keeps_them():
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from vllm.v1.sample.logits_processor import LogitsProcessor
    from vllm.v1.sample.logits_processor.builtin import (
        LogitBiasLogitsProcessor,
        MinTokensLogitsProcessor,
    )

    from torchtpu.integrations.vllm.sampling import why_logits

    assert why_logits(_metadata(), False) is None  # vLLM's idle built-ins, min-p among them
    cases = {
        "random sampling": (_metadata(all_greedy=False), False),
        "logprobs": (_metadata(max_num_logprobs=0), False),
        "structured output": (_metadata(), True),
        "allowed token ids": (_metadata(allowed_token_ids_mask=torch.zeros(2, 4, dtype=bool)),
                              False),
        "bad words": (_metadata(bad_words_token_ids={0: [[3]]}), False),
        "penalties": (_metadata(no_penalties=False), False),
    }
    for reason, (meta, grammar) in cases.items():
        assert why_logits(meta, grammar) == reason
    assert why_logits(_metadata(logprob_token_ids={0: [5]}), False) == "logprobs"
    # a built-in processor holding a request's state, each alone
    meta = _metadata()
    (min_tokens,) = [p for p in meta.logitsprocs.non_argmax_invariant
                     if type(p) is MinTokensLogitsProcessor]
    min_tokens.min_toks[0] = (4, [], {2}, False)
    assert why_logits(meta, False) == "logits processor MinTokensLogitsProcessor"
    meta = _metadata()
    (bias,) = [p for p in meta.logitsprocs.non_argmax_invariant
               if type(p) is LogitBiasLogitsProcessor]
    bias.biases[1] = {7: 3.0}
    assert why_logits(meta, False) == "logits processor LogitBiasLogitsProcessor"

    class Custom(LogitsProcessor):  # a user's processor: its state is unknown here
        def __init__(self, *args):
            pass

        def is_argmax_invariant(self):
            return False

        def apply(self, logits):
            return logits

        def update_state(self, batch_update):
            pass

    meta = _metadata()
    meta.logitsprocs.non_argmax_invariant.append(Custom())
    assert why_logits(meta, False) == "logits processor Custom"

    class Quiet(MinTokensLogitsProcessor):  # a subclass may apply more than its state says
        pass

    meta = _metadata()
    meta.logitsprocs.non_argmax_invariant[:] = [Quiet(None, "cpu", False)]
    assert why_logits(meta, False) == "logits processor Quiet"
    holder = type("Holder", (), {"has_tracked_requests": lambda self: True})()
    assert why_logits(_metadata(thinking_budget_state_holder=holder), False) == "thinking budget"
    holder.has_tracked_requests = lambda: False
    assert why_logits(_metadata(thinking_budget_state_holder=holder), False) is None
    os.environ["VLLM_COMPUTE_NANS_IN_LOGITS"] = "1"
    try:
        assert why_logits(_metadata(), False) == "NaN counts"
    finally:
        del os.environ["VLLM_COMPUTE_NANS_IN_LOGITS"]


# One engine (lazy capture: each program compiles when first met), requests of each kind in
# turn, the tokens-only steps and the logits computed after the choice counted around each.
_SERVE = r"""
import json, sys
import vllm
from torchtpu import metrics

model, cases = sys.argv[1], json.loads(sys.argv[2])
llm = vllm.LLM(model=model, dtype="float32", max_model_len=64, max_num_seqs=4,
               max_num_batched_tokens=64, gpu_memory_utilization=0.01,
               kv_cache_memory_bytes=4 << 20, seed=0)
runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
P = vllm.SamplingParams
prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 12, 9))]
out = {}
for name in cases:
    params = [P(max_tokens=8, temperature=0, ignore_eos=True)] * 3
    if name == "sampled":  # one request samples: every step of the batch keeps its logits
        params = params[:2] + [P(max_tokens=8, temperature=0.8, seed=3, ignore_eos=True)]
    elif name == "logprobs":
        params = params[:2] + [P(max_tokens=8, temperature=0, logprobs=1, ignore_eos=True)]
    elif name in ("bias", "forced"):  # token 9 biased up: the processor must see the logits
        params = params[:2] + [P(max_tokens=8, temperature=0, logit_bias={9: 100.0},
                                 ignore_eos=True)]
    elif name == "min_tokens":
        params = params[:2] + [P(max_tokens=8, temperature=0, min_tokens=8)]
    if name == "forced":  # the choice made wrongly, before the forward: sample_tokens' check
        runner._leaves_logits_out = lambda scheduler_output: runner._fed_decode
    before = metrics.snapshot()
    outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
    after = metrics.snapshot()
    delta = lambda k: after.get(k, 0) - before.get(k, 0)
    out[name] = {"ids": [list(o.outputs[0].token_ids) for o in outs],
                 "logprobs": [len(o.outputs[0].logprobs or []) for o in outs],
                 "tokens_only": delta("vllm_tokens_only_steps"),
                 "computed": delta("vllm_tokens_only_logits_computed")}
# each tokens-only program returns the hidden states and the tokens, no logits
out["programs"] = sorted({(k[1], len(v[1])) for k, v in runner.step_graphs._graphs.items()
                          if k[1]})
print("RESULT " + json.dumps(out))
"""


def _serve(model_dir: str, cases: list[str]) -> dict:
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TORCHTPU_VLLM_CAPTURE": "lazy"}
    proc = subprocess.run([sys.executable, "-c", _SERVE, model_dir, json.dumps(cases)], env=env,
                          capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    return json.loads(lines[-1][len("RESULT "):])


def _hf_greedy(model_dir: str) -> list[list[int]]:
    from transformers import AutoModelForCausalLM

    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((5, 12, 9))]
    return [hf.generate(torch.tensor([p]), max_new_tokens=8, min_new_tokens=8,
                        do_sample=False)[0, len(p):].tolist() for p in prompts]


def test_each_kind_of_request_gets_hf_greedy_tokens_and_only_greedy_steps_drop_logits(tmp_path):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))
    got = _serve(model_dir, ["greedy", "sampled", "logprobs", "bias", "min_tokens", "forced"])
    want = _hf_greedy(model_dir)
    greedy = got["greedy"]
    # all greedy: every decode step (7 a request) ran a tokens-only program
    assert greedy["ids"] == want and greedy["tokens_only"] >= 7, greedy
    assert greedy["computed"] == 0, greedy
    for name in ("sampled", "logprobs", "bias", "min_tokens"):  # a step of each keeps logits
        assert got[name]["tokens_only"] == 0 and got[name]["computed"] == 0, (name, got[name])
        assert got[name]["ids"][:2] == want[:2], (name, got[name])
    assert got["logprobs"]["ids"][2] == want[2] and got["logprobs"]["logprobs"][2] == 8
    assert got["min_tokens"]["ids"][2] == want[2], got["min_tokens"]
    assert got["bias"]["ids"][2] == [9] * 8, got["bias"]
    # chosen wrongly before the forward, the biased request still gets its processor: the
    # logits were computed from the program's hidden rows at sample_tokens
    forced = got["forced"]
    assert forced["ids"][2] == [9] * 8 and forced["ids"][:2] == want[:2], forced
    assert forced["tokens_only"] >= 7 and forced["computed"] >= 7, forced
    assert ["tokens", 2] in got["programs"] and ["logits", 3] in got["programs"], got


def test_greedy_ties_take_the_first_index_as_torch_argmax_on_cpu(tmp_path):
    """Every vocabulary row of the head twice (rows 2k and 2k+1 equal): each logit ties with
    its neighbour, and the tokens-only program's argmax picks the even one, as HF's on CPU."""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from transformers import AutoModelForCausalLM

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "llama", "llama"))
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    with torch.no_grad():
        head = hf.lm_head.weight
        head[1::2] = head[0::2]
    hf.save_pretrained(model_dir)
    want = _hf_greedy(model_dir)
    assert all(t % 2 == 0 for ids in want for t in ids), want
    got = _serve(model_dir, ["greedy"])["greedy"]
    assert got["ids"] == want and got["tokens_only"] >= 7, got


def test_the_switch_takes_0_or_1_and_names_a_bad_value(monkeypatch):
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from torchtpu import settings
    from torchtpu.integrations.vllm.sampling import tokens_only_enabled

    name = settings.VLLM_TOKENS_ONLY.name
    monkeypatch.delenv(name, raising=False)
    assert tokens_only_enabled()
    monkeypatch.setenv(name, "0")
    assert not tokens_only_enabled()
    monkeypatch.setenv(name, "maybe")
    with pytest.raises(ValueError, match="TORCHTPU_VLLM_TOKENS_ONLY='maybe'"):
        tokens_only_enabled()
