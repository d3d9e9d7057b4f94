"""TRL 1.16's GRPO with vLLM colocated on tpu (``use_vllm=True, vllm_mode="colocate"``).

TRL starts vLLM in the trainer's process, on device "tpu" through torchtpu's platform, and pushes
the policy's weights into it before each step's rollouts. Checked on the tiny Llama of
``torchtpu/testing/grpo.py``: two steps train (finite losses, nonzero gradients); after each
push vLLM's greedy tokens equal the updated policy's ``generate`` on CPU, the policy's own
``generate`` on tpu equals CPU's in its mode, and the push moved no byte through the host (tpu
tensor to tpu tensor: torchtpu's transfer counters, and JAX's transfer guard refusing any
host-to-device transfer in it), with every internet socket refused as on a sandboxed TPU host;
the steps ran in DeferAndFuse, a few hundred programs a step at most, and the engine captured
only the step shapes they met. A push is one ``load_weights`` call on tpu.
Refused when the trainer is built, before the
engine starts (``integrations/trl.py``): an engine share that does not fit beside the policy, and
a policy whose parameters are not the engine's model's (a resized embedding, naming the
parameter and both shapes; a parameter the engine's checkpoint lacks, naming it). vLLM venv
with the rl extra only; skipped elsewhere.
"""

import json
import os
import subprocess
import sys

import no_sockets  # tests/ is on the path (verl installs a package named tests)
import pytest

pytest.importorskip("trl", reason="TRL is not installed: pip install -e '.[rl]'")
pytest.importorskip("vllm", reason="vLLM is not installed (docs, Serving (vLLM))")

# the KV cache is torchtpu's size on XLA:CPU: what the engine holds (2 requests of 32 tokens)
VLLM_ENV = {"TORCHTPU_VLLM": "1"}
OPTIONS = {"vllm_mode": "colocate", "vllm_max_model_length": 32}


def test_colocated_grpo_pushes_weights_device_to_device(tmp_path):
    # as on a sandboxed TPU host: no internet socket, so neither TRL's port search nor vLLM's
    # external-launcher rendezvous may open one; MASTER_* unset, as a user starting python has it
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT")}
    env = no_sockets.environment(tmp_path, dict(env, PYTHONPATH=os.pathsep.join(sys.path),
                                                **VLLM_ENV))
    proc = subprocess.run([sys.executable, "-m", "torchtpu.testing.grpo", "tpu", "2",
                           str(tmp_path), "vllm"], env=env, capture_output=True, text=True,
                          timeout=1800)
    lines = [x for x in proc.stdout.splitlines() if x.startswith("GRPO_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stderr[-4000:]
    out = json.loads(lines[-1][len("GRPO_RESULT "):])
    assert out["device"].startswith("tpu") and len(out["steps"]) == 2
    for step in out["steps"]:
        assert abs(step["loss"]) < 1e3 and step["grad_norm"] > 0
    assert out["pushes"], "TRL pushed no weights into vLLM"
    # the engine captured no step shape at start-up, only the few its steps met (main: 9 at
    # start-up, integrations/trl.py)
    assert out["captures"][0] == 0 and 0 < out["captures"][1] <= 4, out["captures"]
    # vLLM's sampler asks for the sampled tokens' logprobs (TRL's importance sampling), whose
    # rank count vLLM compiles: run eagerly on tpu, no frame traced in any step
    assert out["dynamo_frames"] == 0, out["dynamo_frames"]
    # TRL's train ran in DeferAndFuse (integrations/trl.py): ~100 programs a step (the checks'
    # own taken out), most of them its host reads' fused ones, where Strict ran ~930
    assert [t["mode"] for t in out["timings"]] == ["defer_and_fuse"] * 2, out["timings"]
    assert all(t["executions"] < 400 for t in out["timings"]), out["timings"]
    for push in out["pushes"]:
        assert push["vllm"] == push["hf"], push
        # the policy's own generate on tpu, after the engine's captured steps ran in this
        # process, equals CPU's in the same mode (training, gradient checkpointing)
        assert push["hf_tpu"] == push["hf_cpu_as_policy"], push
        assert push["host_bytes"] == 0, push
        assert push["host_to_device_refused"] is None, push  # JAX's transfer guard's word


def _trainer(tmp_path, **config):
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from trl import GRPOConfig, GRPOTrainer

    from torchtpu.integrations.vllm.tiny import save_tiny_model
    from torchtpu.testing.grpo import PROMPTS, reward

    folder = save_tiny_model(tmp_path / "model", hidden=64, layers=2)
    model = AutoModelForCausalLM.from_pretrained(folder)
    resize = config.pop("resize", None)
    if resize:
        model.resize_token_embeddings(resize)
    if config.pop("norm_bias", False):  # a parameter the engine's checkpoint has no entry for
        import torch

        model.model.norm.bias = torch.nn.Parameter(torch.zeros(64))
    args = GRPOConfig(output_dir=str(tmp_path / "out"), per_device_train_batch_size=4,
                      num_generations=2, max_completion_length=8, max_steps=1,
                      report_to="none", use_vllm=True, **OPTIONS, **config)
    return GRPOTrainer(model=model, reward_funcs=reward, args=args,
                       train_dataset=Dataset.from_dict({"prompt": PROMPTS}),
                       processing_class=AutoTokenizer.from_pretrained(folder))


@pytest.fixture
def vllm_env(monkeypatch):
    for name, value in VLLM_ENV.items():
        monkeypatch.setenv(name, value)


def test_an_engine_share_that_does_not_fit_is_refused(tmp_path, vllm_env):
    from torchtpu.device import memory_limit

    memory_limit.set_limit(4 << 20)
    try:
        with pytest.raises(ValueError) as e:
            _trainer(tmp_path, vllm_gpu_memory_utilization=0.9)
    finally:
        memory_limit.set_limit(None)
    text = str(e.value)
    assert text.startswith("torchtpu.memory: vllm_gpu_memory_utilization=0.9 gives the "
                           "colocated vLLM engine 3.6 MiB of the device's 4.0 MiB"), text
    assert "lower vllm_gpu_memory_utilization to at most" in text


def test_a_policy_unlike_the_engine_model_is_refused(tmp_path, vllm_env):
    with pytest.raises(ValueError) as e:
        _trainer(tmp_path, resize=330)
    assert str(e.value) == (
        "torchtpu.argument: weight push into vLLM: the policy's parameter "
        "'model.embed_tokens.weight' has shape (330, 64) but the engine's model "
        f"({tmp_path / 'model'}) has (258, 64)"), str(e.value)


def test_a_policy_parameter_the_engine_lacks_is_refused(tmp_path, vllm_env):
    with pytest.raises(ValueError) as e:
        _trainer(tmp_path, norm_bias=True)
    assert str(e.value) == (
        "torchtpu.argument: weight push into vLLM: the policy's parameter 'model.norm.bias' "
        f"(shape (64,)) is not in the engine's model ({tmp_path / 'model'}): the policy and "
        "the engine must be the same model"), str(e.value)


class _Engine:
    """What ``sync_weights`` reaches of a colocated engine: its model's ``load_weights`` (each
    call's names kept) and ``reset_prefix_cache``."""

    def __init__(self) -> None:
        from types import SimpleNamespace

        self.calls: list[list[str]] = []
        self.resets = 0
        model = SimpleNamespace(load_weights=lambda w: self.calls.append([n for n, _ in w]))
        runner = SimpleNamespace(model=model)
        self.llm_engine = SimpleNamespace(model_executor=SimpleNamespace(
            driver_worker=SimpleNamespace(model_runner=runner)))

    def reset_prefix_cache(self) -> None:
        self.resets += 1


@pytest.mark.parametrize("device", ["tpu", "cpu"])
def test_a_colocated_push_is_one_load_weights_call_on_tpu(device):
    # vLLM's loader walks the whole model in every load_weights call: TRL's call per parameter
    # made the push's host time grow with the square of the layers (integrations/trl.py)
    from types import SimpleNamespace

    from trl.generation.vllm_generation import VLLMGeneration

    from torchtpu.integrations import trl as trl_integration

    trl_integration.patch_vllm_generation()
    names = [f"model.layers.{i}.mlp.down_proj.weight" for i in range(5)]
    generation = object.__new__(VLLMGeneration)
    generation.mode, generation.enable_sleep_mode, generation.llm = "colocate", False, _Engine()
    generation.accelerator = SimpleNamespace(device=SimpleNamespace(type=device))
    generation._iter_named_params = lambda: ((n, None) for n in names)
    generation.sync_weights()
    # on tpu every parameter in one call, in order; elsewhere TRL's own loop, a call each
    want = [names] if device == "tpu" else [[n] for n in names]
    assert generation.llm.calls == want and generation.llm.resets == 1
