"""verl's GRPO on a tiny Llama made from a config, on device "tpu", for tests and benchmarks.

``run(folder, steps)`` writes a tiny Llama and its byte-level tokenizer
(``integrations/vllm/tiny.py``), a parquet of prompts in verl's data layout, and runs verl's own
entry point, ``python -m verl.trainer.main_ppo``, with ``algorithm.adv_estimator=grpo``: its Ray
single controller on one node of one tpu device (Ray's ``TPU`` resource declared by
``ray.init``), the FSDP actor and its vLLM rollout server colocated on that device. The reward
(:func:`compute_score`, verl's ``custom_reward_function``) is deterministic: the number of
distinct characters of a response over 8. It returns each step's metrics as verl's console
logger prints them (``step:N - name:value - ...``). ``python -m torchtpu.testing.verl_grpo
FOLDER STEPS`` prints them as JSON.

Kept small for a shared CPU: 2 prompts a step, 4 responses each of at most 8 tokens, a 1 GB
object store, float32 throughout (XLA:CPU has no fast bf16), no validation, no checkpoints.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from torchtpu import settings

PROMPTS = ["a", "bcd", "hello", "xyz12345", "tpu!", "grpo runs", "qq", "abcdefghij"]
STEP_LINE = re.compile(r"step:(\d+) - (.*)$")


def compute_score(data_source, solution_str: str, ground_truth, extra_info=None) -> float:
    """Distinct characters of a response over 8 (verl's custom reward signature)."""
    return len(set(solution_str)) / 8.0


def prepare(folder: str | Path) -> Path:
    """The tiny model and the data files under ``folder`` (kept if already there)."""
    import pandas as pd

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    folder = Path(folder)
    if not (folder / "model" / "config.json").exists():
        save_tiny_model(folder / "model", hidden=64, layers=2, heads=2, kv_heads=1)
    rows = [{"data_source": "torchtpu", "prompt": [{"role": "user", "content": p}],
             "ability": "chars", "reward_model": {"style": "rule", "ground_truth": ""},
             "extra_info": {"index": i}} for i, p in enumerate(PROMPTS)]
    pd.DataFrame(rows).to_parquet(folder / "train.parquet")
    return folder


def overrides(folder: str | Path, steps: int, ray_dir: str | Path) -> list[str]:
    """verl's Hydra overrides for the run (see the module doc); Ray's session under ray_dir."""
    folder = Path(folder)
    actor = "actor_rollout_ref.actor"
    rollout = "actor_rollout_ref.rollout"
    return [
        "algorithm.adv_estimator=grpo", "algorithm.use_kl_in_reward=False",
        f"data.train_files={folder / 'train.parquet'}",
        f"data.val_files={folder / 'train.parquet'}",
        "data.train_batch_size=2", "data.max_prompt_length=32", "data.max_response_length=8",
        "data.dataloader_num_workers=0", "data.shuffle=False",
        f"actor_rollout_ref.model.path={folder / 'model'}",
        "actor_rollout_ref.model.use_remove_padding=False",
        "actor_rollout_ref.model.enable_gradient_checkpointing=False",
        # verl defaults to FlashAttention 2 (a CUDA package); SDPA is torchtpu's attention
        "+actor_rollout_ref.model.override_config.attn_implementation=sdpa",
        f"{actor}.optim.lr=0.01", f"{actor}.ppo_mini_batch_size=2",
        f"{actor}.ppo_micro_batch_size_per_gpu=8", f"{actor}.use_kl_loss=False",
        f"{actor}.entropy_coeff=0", f"{actor}.fsdp_config.dtype=float32",
        f"{actor}.fsdp_config.use_torch_compile=False", f"{actor}.use_torch_compile=False",
        f"{rollout}.name=vllm", f"{rollout}.n=4", f"{rollout}.tensor_model_parallel_size=1",
        f"{rollout}.gpu_memory_utilization=0.05", f"{rollout}.max_model_len=64",
        f"{rollout}.max_num_seqs=8", f"{rollout}.max_num_batched_tokens=256",
        f"{rollout}.dtype=float32", f"{rollout}.enforce_eager=True",
        f"{rollout}.log_prob_micro_batch_size_per_gpu=8", f"{rollout}.free_cache_engine=False",
        # vLLM's sleep mode frees and restores CUDA memory pools; torchtpu's platform has none
        f"++{rollout}.enable_sleep_mode=False",
        f"{rollout}.agent.num_workers=1",
        f"reward.custom_reward_function.path={__file__}",
        "reward.custom_reward_function.name=compute_score",
        "trainer.logger=[console]", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.device=tpu", "trainer.val_before_train=False", "trainer.test_freq=-1",
        "trainer.save_freq=-1", f"trainer.total_training_steps={steps}",
        f"trainer.default_local_dir={folder / 'checkpoints'}",
        "transfer_queue.backend.SimpleStorage.num_data_storage_units=1", "reward.num_workers=1",
        "+ray_kwargs.ray_init.resources={TPU:1}", "+ray_kwargs.ray_init.num_cpus=8",
        f"+ray_kwargs.ray_init._temp_dir={ray_dir}",
        "+ray_kwargs.ray_init.object_store_memory=1000000000",
        "+ray_kwargs.ray_init.include_dashboard=False",
    ]


def parse(output: str) -> list[dict]:
    """Each ``step:N - name:value - ...`` line of verl's console logger as a dict."""
    steps = []
    for line in output.splitlines():
        found = STEP_LINE.search(line)
        if not found:
            continue
        metrics = {"step": int(found.group(1))}
        for item in found.group(2).split(" - "):
            name, _, value = item.rpartition(":")
            try:
                metrics[name.strip()] = float(value)
            except ValueError:
                continue
        steps.append(metrics)
    return steps


def run(folder: str | Path, steps: int, *, timeout: float = 1500, extra: list[str] = ()) -> dict:
    """Run verl's GRPO (see the module doc); the output is kept in ``folder/verl.log``."""
    folder = prepare(folder)
    import torchtpu

    # this torchtpu in the driver and in every Ray worker (an editable install may name another)
    root = str(Path(torchtpu.__file__).resolve().parents[1])
    path = os.pathsep.join(p for p in (root, os.environ.get("PYTHONPATH")) if p)
    env = {**os.environ, **settings.child_env({settings.VLLM: True}), "PYTHONPATH": path,
           "VERL_PLATFORM": "tpu",
           "RAY_DEDUP_LOGS": "0", "TOKENIZERS_PARALLELISM": "false", "HF_HUB_OFFLINE": "1"}
    # Ray's sockets live under its session folder and a socket path has at most 107 bytes
    ray_dir = tempfile.mkdtemp(prefix="ray", dir="/tmp")
    cmd = [sys.executable, "-m", "verl.trainer.main_ppo", *overrides(folder, steps, ray_dir),
           *extra]
    start = time.perf_counter()
    with open(folder / "verl.log", "w") as log:
        # its own session: on a timeout the driver, Ray's local cluster and every worker go
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=env, cwd=folder,
                                start_new_session=True)
        try:
            returncode = proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            returncode = None
        finally:
            _stop(proc)
            shutil.rmtree(ray_dir, ignore_errors=True)
    output = (folder / "verl.log").read_text()
    return {"returncode": returncode, "seconds": time.perf_counter() - start,
            "steps": parse(output), "tail": output[-4000:]}


def _stop(proc: subprocess.Popen) -> None:
    """SIGTERM the run's session (Ray's local cluster stops with its driver), then SIGKILL."""
    import signal

    for sig, wait in ((signal.SIGTERM, 20), (signal.SIGKILL, 5)):
        try:
            os.killpg(proc.pid, sig)
        except ProcessLookupError:
            return
        try:
            proc.wait(timeout=wait)
        except subprocess.TimeoutExpired:
            continue


if __name__ == "__main__":
    print("VERL_RESULT " + json.dumps(run(sys.argv[1], int(sys.argv[2]))))
