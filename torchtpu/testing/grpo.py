"""TRL's GRPO on a tiny Llama made from a config, for tests and benchmarks (no hub).

``run(device, steps, folder)`` trains ``trl.GRPOTrainer`` for ``steps`` steps on "tpu" or "cpu"
with a deterministic reward (the number of distinct characters of a completion, plus its first
character's code over 1000) and greedy generation whose first token is forced per row of the
batch (``FirstTokenByRow``: the completions of one prompt would otherwise be equal, and so
would their rewards, leaving zero advantages and no gradient), SGD (AdamW's first step turns
rounding noise in near-zero gradients into full-size steps of its sign, which no comparison
survives), and prompts of lengths that change from step to step. It returns each step's logged
reward, loss and gradient norm, its wall and process CPU time and how many programs it built or
loaded (``torchtpu.metrics``; ``by_key``: those loaded by torchtpu's key; ``ahead``: of those,
the ones loaded ahead of use, ``cache/warm_ahead.py``), how many programs it ran
(``executions``), how many functions JAX traced (``traced``: programs built, and calls' result
shapes inferred, by tracing; none in a warm process whose programs all load by key), the eager
mode it ran in (``mode``), the frames Dynamo traced in training (``dynamo_frames``), the
colocated engine's step programs captured before and during training (``captures``) and the
trained weights.
``python -m torchtpu.testing.grpo DEVICE STEPS FOLDER [vllm] [nopad] [nowatch] [vllmbatch]
[strict] [model=DIR]`` prints that as JSON from a fresh process (Accelerate keeps one device per
process); ``strict``: ``TORCHTPU_TRL_DEFER=0``, TRL's train in Strict (``integrations/trl.py``;
a flag, not only the variable, so that its command line, and so its list of programs loaded
ahead, is its own);
``nowatch``: no checks after each weight push (they generate with Hugging Face inside the step,
which a timing should not count); ``vllmbatch``: without vLLM, the vLLM runs' batch (one
prompt, two completions a step), to compare with them; ``model=DIR``: the policy (and the
engine's model) from a ``save_pretrained`` directory instead of the tiny Llama, trained in
float32 whatever dtype it was saved in (``bench/grpo.py --model``: a 0.5B-class policy).
"""

from __future__ import annotations

import contextlib
import json
import sys
import time
from pathlib import Path

import torch
from jax import monitoring

from torchtpu import settings

# Colocated vLLM, one prompt (two completions) a step, contexts of at most 32 tokens: the engine
# captures the step shapes a step meets, when it meets them (integrations/trl.py).
VLLM_BATCH = {"per_device_train_batch_size": 2}
VLLM_OPTIONS = {"vllm_mode": "colocate", "vllm_max_model_length": 32, **VLLM_BATCH}
PROMPTS = ["a", "bcd", "hello", "xyz12345", "tpu!", "grpo runs", "qq", "abcdefghij"]


def reward(completions: list, **_) -> list[float]:
    """Distinct characters of each completion, plus its first character's code over 1000."""
    return [len(set(c)) + (ord(c[0]) / 1000 if c else 0.0) for c in completions]


class FirstTokenByRow:
    """A logits processor: the first generated token of batch row r is token (7 r + 70) mod V."""

    def __init__(self) -> None:
        self.first = True

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        if not self.first:
            return scores
        self.first = False
        rows = torch.arange(scores.shape[0], device=scores.device)
        bias = torch.zeros_like(scores)
        bias[rows, (rows * 7 + 70) % scores.shape[1]] = 1000.0
        return scores + bias


def _row_forced(model) -> None:
    """model.generate with a fresh ``FirstTokenByRow`` per call (TRL calls it without one)."""
    from transformers import LogitsProcessorList

    original = model.generate

    def generate(*args, **kwargs):
        kwargs.setdefault("logits_processor", LogitsProcessorList([FirstTokenByRow()]))
        return original(*args, **kwargs)

    model.generate = generate


_TRACED = [0]


def _traced(event: str, seconds: float, **_) -> None:
    if event == "/jax/core/compile/jaxpr_trace_duration":
        _TRACED[0] += 1


monitoring.register_event_duration_secs_listener(_traced)


def _programs() -> tuple[int, int, int, int]:
    """(programs built or loaded so far, of them loaded by torchtpu's key, of those loaded ahead
    of use on the loading thread, programs executed)."""
    from torchtpu import metrics

    snap = metrics.snapshot()
    by_key = snap.get("programs_loaded_by_key", 0)
    return snap.get("executable_compiles", 0) + snap.get("persistent_cache_hits", 0) + by_key, \
        by_key, snap.get("programs_loaded_ahead", 0), snap.get("executions", 0)


def _checked(pushes: list) -> int:
    """Programs the checks after the pushes ran (``_watch_pushes``): not the steps'."""
    return sum(p["executions"] for p in pushes)


def _dynamo_frames() -> int:
    """Frames Dynamo has traced in this process so far."""
    from torch._dynamo.utils import counters

    return counters["frames"]["total"]


def _captures(trainer) -> int | None:
    """Step programs the colocated vLLM engine has captured so far (None without one)."""
    generation = getattr(trainer, "vllm_generation", None)
    llm = getattr(generation, "llm", None)
    if llm is None:
        return None
    runner = llm.llm_engine.model_executor.driver_worker.model_runner
    graphs = getattr(runner, "step_graphs", None)
    return None if graphs is None else graphs.captures


def run(device: str, steps: int, folder: str | Path, *, use_vllm: bool = False,
        options: dict | None = None, pad: int | str | None = "auto", watch: bool = True,
        model_dir: str | Path | None = None) -> dict:
    """Train and report (see the module doc)."""
    from datasets import Dataset
    from transformers import AutoModelForCausalLM, AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    folder = Path(folder)
    if model_dir is None:
        model_dir = folder / "model"
        if not (model_dir / "config.json").exists():
            save_tiny_model(model_dir, hidden=64, layers=2, heads=2, kv_heads=1)
    timings: list[dict] = []
    pushes: list[dict] = []  # what ``_watch_pushes`` saw

    class Clock(TrainerCallback):
        def on_step_begin(self, *args, **kwargs) -> None:
            self.mode = torch.tpu.eager_mode.value if device == "tpu" else None
            self.start, self.cpu, self.programs = time.perf_counter(), time.process_time(), \
                _programs()
            self.checked = _checked(pushes)
            self.traced = _TRACED[0]

        def on_step_end(self, args, state, *rest, **kwargs) -> None:
            programs, by_key, ahead, executions = _programs()
            timings.append({"seconds": time.perf_counter() - self.start,
                            "cpu_seconds": time.process_time() - self.cpu,
                            "programs": programs - self.programs[0],
                            "by_key": by_key - self.programs[1],
                            "ahead": ahead - self.programs[2],
                            "executions": executions - self.programs[3]
                            - (_checked(pushes) - self.checked),
                            "traced": _TRACED[0] - self.traced, "mode": self.mode})

    settings = dict(
        output_dir=str(folder / "out"), per_device_train_batch_size=4, num_generations=2,
        max_completion_length=8, max_steps=steps, learning_rate=0.05, optim="sgd",
        logging_steps=1, report_to="none", save_strategy="no", seed=0, shuffle_dataset=False,
        use_cpu=device == "cpu", bf16=False,
        # vLLM samples (its engine's seeded generator), so that a group's completions differ
        generation_kwargs={} if use_vllm else {"do_sample": False},
        dataloader_num_workers=0, use_vllm=use_vllm, pad_to_multiple_of=pad)
    config = GRPOConfig(**{**settings, **(options or {})})
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32)
    if not use_vllm:
        _row_forced(model)
    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    trainer = GRPOTrainer(model=model, reward_funcs=reward, args=config,
                          train_dataset=Dataset.from_dict({"prompt": PROMPTS * steps}),
                          processing_class=tokenizer, callbacks=[Clock()])
    if use_vllm and watch:
        _watch_pushes(trainer, tokenizer, pushes)
    frames = _dynamo_frames()
    captures = _captures(trainer)
    trainer.train()
    logs = [h for h in trainer.state.log_history if "reward" in h]
    return {
        "device": str(next(trainer.model.parameters()).device),
        "pad_to_multiple_of": config.pad_to_multiple_of,
        "steps": [{"reward": h["reward"], "loss": h["loss"], "grad_norm": h.get("grad_norm")}
                  for h in logs],
        "timings": timings,
        "dynamo_frames": _dynamo_frames() - frames,
        # the engine's captured step programs: before training (start-up), and in training
        "captures": None if captures is None else [captures, _captures(trainer) - captures],
        "pushes": pushes,
        "weights": {k: v.detach().cpu().flatten()[:64].tolist()
                    for k, v in trainer.model.state_dict().items()},
    }


def _watch_pushes(trainer, tokenizer, seen: list) -> None:
    """Into ``seen``, after each weight push into the colocated vLLM engine: its greedy tokens on
    fixed prompts (in the trainer's eager mode), those of Hugging Face ``generate`` on CPU with
    the policy's weights as pushed (``hf``, eval mode), on tpu with the policy itself
    (``hf_tpu``, in Strict) and on CPU in the policy's own mode (``hf_cpu_as_policy``: training,
    gradient checkpointing), the bytes the push moved through the host (``torchtpu.metrics``,
    counted before the CPU copy is made), and the programs these checks ran (``executions``,
    taken out of the step's).

    ``hf_tpu`` is compared with ``hf_cpu_as_policy``, not with ``hf``: Transformers 5.19 (the
    vLLM venv's, capped by vLLM) drops the KV cache inside checkpointed layers in training mode
    even under ``no_grad``, while ``generate`` still feeds them only the newest token, so the
    policy's own greedy tokens after the first are not eval mode's, on CPU as on tpu (5.24
    keeps the cache when no gradient is recorded).
    """
    import jax
    from transformers import AutoModelForCausalLM
    from vllm import SamplingParams

    from torchtpu import metrics

    reference = AutoModelForCausalLM.from_pretrained(trainer.model.name_or_path).eval()
    policy = trainer.accelerator.unwrap_model(trainer.model)

    generation = trainer.vllm_generation
    push = generation.sync_weights
    prompts = [tokenizer(p)["input_ids"] for p in ("hello", "grpo")]

    def sync_weights() -> None:
        before = metrics.snapshot()
        refused = None
        try:  # JAX itself refuses any host-to-device transfer inside the push
            with jax.transfer_guard_host_to_device("disallow_explicit"):
                push()
                torch.tpu.synchronize()  # (what DeferAndFuse recorded of it runs here)
        except Exception as e:
            if "Disallowed host-to-device transfer" not in str(e):
                raise
            refused = str(e)[:300]
            push()
        after = metrics.snapshot()
        host = sum(after.get(k, 0) - before.get(k, 0)
                   for k in ("host_to_device_bytes", "device_to_host_bytes"))
        checks = metrics.snapshot().get("executions", 0)
        outs = generation.llm.generate([{"prompt_token_ids": p} for p in prompts],
                                       SamplingParams(temperature=0, max_tokens=8),
                                       use_tqdm=False)
        # Transformers' generate in Strict, as a user's own beside training would run:
        # DeferAndFuse would fuse a program per generated length (integrations/trl.py)
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER):
            reference.load_state_dict({k: v.cpu() for k, v in policy.state_dict().items()})
            hf = _greedy(reference, prompts, tokenizer)
            if policy.is_gradient_checkpointing and not reference.is_gradient_checkpointing:
                reference.gradient_checkpointing_enable()  # (the trainer turns it on in train())
            reference.train(policy.training)
            as_policy = _greedy(reference, prompts, tokenizer)
            reference.eval()
            hf_tpu = _greedy(policy, prompts, tokenizer)
        seen.append({"step": trainer.state.global_step, "host_bytes": host,
                     "host_to_device_refused": refused,
                     "vllm": [list(o.outputs[0].token_ids) for o in outs], "hf": hf,
                     "hf_tpu": hf_tpu, "hf_cpu_as_policy": as_policy,
                     "executions": metrics.snapshot().get("executions", 0) - checks})

    generation.sync_weights = sync_weights


def _greedy(model, prompts: list, tokenizer) -> list[list[int]]:
    device = next(model.parameters()).device
    out = []
    with torch.no_grad():
        for ids in prompts:
            x = torch.tensor([ids], device=device)
            y = model.generate(x, attention_mask=torch.ones_like(x), max_new_tokens=8,
                               do_sample=False, pad_token_id=tokenizer.eos_token_id)
            out.append(y[0, len(ids):].tolist())
    return out


if __name__ == "__main__":
    device, steps, folder = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    vllm = "vllm" in sys.argv[4:]
    flags = sys.argv[4:]
    model_dir = next((f[len("model="):] for f in flags if f.startswith("model=")), None)
    options = VLLM_OPTIONS if vllm else VLLM_BATCH if "vllmbatch" in flags else None
    with settings.TRL_DEFER.overridden(False) if "strict" in flags else contextlib.nullcontext():
        out = run(device, steps, folder, use_vllm=vllm, options=options,
                  pad=None if "nopad" in flags else "auto", watch="nowatch" not in flags,
                  model_dir=model_dir)
    print("GRPO_RESULT " + json.dumps(out))
