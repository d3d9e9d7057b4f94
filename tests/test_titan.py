"""TorchTitan 0.3's llama3 debug model trained on tpu (``python -m torchtpu.titan`` under torchrun)
against the same run on CPU with gloo (``torchtpu/testing/titan.py``): one process, then two with
FSDP2 or tensor parallelism over tpu_dist, eager and with ``--compile.enable``. Both start from
one seed checkpoint (tpu's random init differs from CPU's)
and read the same locally made tokenizer and documents. Needs ``pip install -e '.[titan]'``.
"""

import os
import re
import signal
import subprocess
import sys

import pytest

pytest.importorskip("torchtitan", reason="TorchTitan is not installed: pip install -e '.[titan]'")

from torchtpu.testing.titan import REFERENCE, make_assets  # noqa: E402

STEPS = 3
# The varlen debug config on a small batch; spmd_types (0.3's default) needs a newer FSDP2 than
# torch 2.13's, so the DTensor path; no validation, no activation checkpointing.
ARGS = ["--module", "llama3", "--config", "llama3_debugmodel_varlen_attn",
        "--training.seq_len", "64", "--training.local_batch_size", "2",
        "--training.steps", str(STEPS), "--validator.no-enable",
        "--parallelism.spmd_backend", "partial_dtensor", "--metrics.disable_color_printing",
        "--checkpoint.enable"]
LOSS = re.compile(r"step:\s*(\d+)\s+loss:\s*([-\d.]+)")


def _run(cwd, nproc: int, device: str, extra: list, timeout: float = 900,
         env_extra: dict | None = None) -> str:
    """One torchrun launch; every process it started is killed if it overruns or fails."""
    program = (["-m", "torchtpu.titan"] if device == "tpu"
               else ["--no-python", sys.executable, REFERENCE])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env_extra or {}))
    if device == "cpu":
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # the reference runs without torchtpu
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), *program, *ARGS, *extra, "activation-checkpoint:none"]
    proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        out, _ = proc.communicate(timeout=timeout)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    assert proc.returncode == 0, out[-8000:]
    return out


def _losses(out: str) -> list[float]:
    losses = {}
    for step, loss in LOSS.findall(out):  # every rank logs the same global loss
        losses.setdefault(int(step), float(loss))
    assert sorted(losses) == list(range(1, STEPS + 1)), out[-8000:]
    return [losses[step] for step in sorted(losses)]


@pytest.fixture(scope="module")
def workdir(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan")
    make_assets(str(root))
    _run(root, 1, "cpu", ["--checkpoint.create_seed_checkpoint", "--checkpoint.folder", "seed"])
    return root


# Process count and parallelism flags of each layout TorchTitan trains in.
LAYOUTS = {"one-process": (1, []), "torchrun-2-fsdp2": (2, []),
           "torchrun-2-tp": (2, ["--parallelism.tensor_parallel_degree", "2"])}


@pytest.fixture(scope="module")
def cpu_losses(workdir):
    """The CPU run's losses per layout, made once for the eager and compiled tpu runs."""
    runs = {}

    def losses(layout: str) -> list[float]:
        if layout not in runs:
            nproc, flags = LAYOUTS[layout]
            load = ["--checkpoint.initial_load_path", str(workdir / "outputs" / "seed" / "step-0")]
            runs[layout] = _losses(_run(workdir, nproc, "cpu", load + flags + [
                "--checkpoint.folder", f"cpu-{layout}"]))
        return runs[layout]

    return losses


@pytest.mark.parametrize("compiled", [False, True], ids=["eager", "compiled"])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_llama3_debug_model_trains_like_cpu(workdir, cpu_losses, layout, compiled, tmp_path):
    # --compile.enable compiles each TransformerBlock with backend "inductor", TorchTitan's
    # default, which graphs on tpu compile with "tpu"; FSDP2 wraps the compiled blocks, and
    # tensor parallelism runs them on DTensors.
    nproc, flags = LAYOUTS[layout]
    load = ["--checkpoint.initial_load_path", str(workdir / "outputs" / "seed" / "step-0")]
    flags = flags + (["--compile.enable"] if compiled else [])
    folder = ["--checkpoint.folder", f"tpu-{layout}-{'compiled' if compiled else 'eager'}"]
    out = _run(workdir, nproc, "tpu", load + folder + flags, env_extra={
        "TORCHTPU_DUMP": str(tmp_path)})  # each program built (or read from the cache), named
    tpu = _losses(out)
    assert "torchtpu.fallback" not in out  # every op of the step runs on the device
    programs = {p.name for p in tmp_path.glob("*.stablehlo.mlir")}
    assert compiled == any("compiled_backward" in name for name in programs), sorted(programs)
    # Attention runs in bfloat16 (TorchTitan casts q/k/v), so equal to ~1e-5 relative.
    assert tpu == pytest.approx(cpu_losses(layout), rel=1e-4), (tpu, cpu_losses(layout))
    assert tpu[-1] < tpu[0]
