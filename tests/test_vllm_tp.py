"""vLLM tensor parallel on device "tpu": two workers, their collectives over tpu_dist.

The platform's device communicator (``integrations/vllm/communicator.py``) against CPU results
in two tpu_dist processes; then ``vllm.LLM(tensor_parallel_size=2)``: vLLM's multiprocessing
executor runs one worker process per device, and the greedy tokens equal the single-worker
engine's and Hugging Face's. vLLM is an optional extra with its own venv (``python -m
torchtpu.integrations.vllm.install``); elsewhere these skip.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from torchtpu.distributed import spawn

pytestmark = pytest.mark.skipif(
    __import__("importlib").util.find_spec("vllm") is None,
    reason="vLLM is not installed: python -m torchtpu.integrations.vllm.install")


def _communicate(rank: int, world: int) -> dict:
    """rank's all-reduce, all-gather (along the last dim and the first), gather and
    reduce-scatter through TpuCommunicator on a tpu_dist group, and the refusal of a gloo one."""
    import torch.distributed as dist

    from torchtpu.integrations.vllm.communicator import TpuCommunicator

    cpu_group = dist.new_group(backend="gloo")
    comm = TpuCommunicator(cpu_group, torch.device("tpu"), dist.group.WORLD, "tp:0")
    x = torch.arange(6.0).reshape(2, 3) * (rank + 1)
    out = {
        "all_reduce": comm.all_reduce(x.tpu()).cpu(),
        "all_gather_last": comm.all_gather(x.tpu(), -1).cpu(),
        "all_gather_first": comm.all_gather(x.tpu(), 0).cpu(),
        "gather": (lambda g: None if g is None else g.cpu())(comm.gather(x.tpu(), 0, 1)),
        "reduce_scatter": comm.reduce_scatter(x.reshape(3, 2).tpu(), 1).cpu(),
        "calls": dict(comm.calls),
    }
    try:
        TpuCommunicator(cpu_group, torch.device("tpu"), cpu_group, "tp:1")
    except RuntimeError as e:
        out["refused"] = str(e)
    return out


def test_communicator_collectives_equal_cpu_over_tpu_dist():
    got = spawn.run(_communicate, 2, timeout=600)  # each rank imports vLLM: slow at load
    xs = [torch.arange(6.0).reshape(2, 3) * (r + 1) for r in range(2)]
    for rank, out in enumerate(got):
        torch.testing.assert_close(out["all_reduce"], xs[0] + xs[1])
        torch.testing.assert_close(out["all_gather_last"], torch.cat(xs, -1))
        torch.testing.assert_close(out["all_gather_first"], torch.cat(xs, 0))
        summed = (xs[0] + xs[1]).reshape(3, 2)
        torch.testing.assert_close(out["reduce_scatter"], summed[:, rank:rank + 1])
        assert out["calls"] == {"all_reduce": 1, "all_gather": 2, "gather": 1,
                                "reduce_scatter": 1}
        assert "needs a tpu_dist device group, got 'gloo'" in out["refused"]
    torch.testing.assert_close(got[0]["gather"], torch.cat(xs, 1))
    assert got[1]["gather"] is None


# Run as a script of its own: vLLM picks its platform once per process, and its
# multiprocessing executor spawns the workers, which import this file as their main module.
_GENERATE = r"""
import json, sys
import vllm

if __name__ == "__main__":
    model, prompts, tp = sys.argv[1], json.loads(sys.argv[2]), int(sys.argv[3])
    llm = vllm.LLM(model=model, dtype="float32", tensor_parallel_size=tp, max_model_len=128,
                   max_num_seqs=4, max_num_batched_tokens=64, gpu_memory_utilization=0.01,
                   kv_cache_memory_bytes=4 << 20)
    params = vllm.SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
    outs = llm.generate(prompts, params, use_tqdm=False)
    print("RESULT " + json.dumps({
        "ids": [list(o.outputs[0].token_ids) for o in outs],
        "communication": llm.collective_rpc("communication"),
    }), flush=True)
"""
PROMPTS = ["hello", "the quick brown fox jumps over", "pack my box with five dozen"]


def _session(sid: int) -> list[int]:
    """The live processes of session sid (the script, its engine and worker processes)."""
    pids = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:  # gone meanwhile
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(stat.parent.name))
    return pids


def _generate(script: Path, model_dir: str, tp: int, timeout: float) -> dict:
    """The script's RESULT for tp workers; every process it started is gone on return, also
    when it fails or runs past timeout (a session of its own, killed whole)."""
    env = {**os.environ, "TORCHTPU_VLLM": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
    proc = subprocess.Popen(
        [sys.executable, str(script), model_dir, json.dumps(PROMPTS), str(tp)], env=env,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True)
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        raise AssertionError(
            f"tp={tp}: no result within {timeout:.0f} s:\n{stderr[-4000:]}") from None
    finally:
        deadline = time.monotonic() + 30
        while _session(proc.pid) and time.monotonic() < deadline:
            time.sleep(0.5)  # vLLM's shutdown stops its workers
        if _session(proc.pid):
            os.killpg(proc.pid, signal.SIGKILL)
    lines = [x for x in stdout.splitlines() if x.startswith("RESULT ")]
    assert proc.returncode == 0 and lines, f"tp={tp}:\n{stderr[-4000:]}"
    return json.loads(lines[-1][len("RESULT "):])


@pytest.mark.full
def test_llm_tensor_parallel_2_tokens_equal_tp1_and_hf(tmp_path):
    from test_vllm import _hf_greedy

    from torchtpu.integrations.vllm.tiny import save_tiny_model

    # 4 query and 2 KV heads: each worker holds 2 and 1 of them, half of every MLP and half of
    # the (padded) vocabulary
    model_dir = str(save_tiny_model(tmp_path / "llama", "llama", heads=4, kv_heads=2))
    script = tmp_path / "generate.py"
    script.write_text(_GENERATE)
    tp2 = _generate(script, model_dir, 2, timeout=900)
    tp1 = _generate(script, model_dir, 1, timeout=600)
    want = _hf_greedy(model_dir, PROMPTS, max_new_tokens=6)
    assert tp2["ids"] == tp1["ids"] == want, (tp2["ids"], tp1["ids"], want)
    # both workers' tensor-parallel group ran its collectives over tpu_dist: an all-reduce
    # after each row-parallel layer (2 a layer), an all-gather of the logits each step
    assert len(tp2["communication"]) == 2, tp2["communication"]
    for worker in tp2["communication"]:
        calls = worker["tp:0"]
        assert calls["all_reduce"] >= 2 * 2 * 6 and calls["all_gather"] >= 6, worker
    assert tp1["communication"] == [{}]  # one worker: no communicator
