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
         env_extra: dict | None = None, args: list = ARGS) -> str:
    """One torchrun launch; every process it started is killed if it overruns or fails."""
    program = (["-m", "torchtpu.titan"] if device == "tpu"
               else ["--no-python", sys.executable, REFERENCE])
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path), **(env_extra or {}))
    if device == "cpu":
        env["TORCH_DEVICE_BACKEND_AUTOLOAD"] = "0"  # the reference runs without torchtpu
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
           "--nproc-per-node", str(nproc), *program, *args, *extra, "activation-checkpoint:none"]
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
def assets(tmp_path_factory):
    root = tmp_path_factory.mktemp("titan")
    make_assets(str(root))
    return root


@pytest.fixture(scope="module")
def workdir(assets):
    _run(assets, 1, "cpu", ["--checkpoint.create_seed_checkpoint", "--checkpoint.folder", "seed"])
    return assets


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


# TorchTitan's deepseek_v3 debug model (MoE: 8 routed experts, 3 per token) with varlen
# attention (torchtpu.titan's config); expert parallel over the two ranks' dp_shard mesh.
MOE_ARGS = ["--module", "torchtpu.titan", "--config", "deepseek_v3_debugmodel_varlen_attn",
            *ARGS[4:]]
EP2 = ["--parallelism.expert_parallel_degree", "2"]
# The XLA transport runs the uneven token exchange as one padded XLA program per call
# (distributed/uneven.py); the host transport through host memory.
MOE_LAYOUTS = {"moe-1": (1, [], {}), "moe-ep2": (2, EP2, {}),
               "moe-ep2-xla": (2, EP2, {"TORCHTPU_DIST_TRANSPORT": "xla"})}


@pytest.mark.full  # minutes each at load (seed, CPU and tpu runs); test_titan_moe.py is the smoke
@pytest.mark.parametrize("layout", list(MOE_LAYOUTS))
def test_deepseek_v3_debug_model_with_expert_parallel_trains_like_cpu(assets, layout, tmp_path):
    # Each MoE layer's dispatcher exchanges token counts, reads them on the host and sends
    # the tokens with all_to_all_single's uneven splits (over tpu_dist; gloo on CPU).
    seed = assets / "outputs" / "seed-moe" / "step-0"
    if not seed.exists():
        _run(assets, 1, "cpu", ["--checkpoint.create_seed_checkpoint", "--checkpoint.folder",
                                "seed-moe"], args=MOE_ARGS)
    nproc, flags, env = MOE_LAYOUTS[layout]
    runs = {}
    for device in ("cpu", "tpu"):
        out = _run(assets, nproc, device, flags + [
            "--checkpoint.initial_load_path", str(seed),
            "--checkpoint.folder", f"{device}-{layout}"], args=MOE_ARGS,
            env_extra=env if device == "tpu" else None)
        if device == "tpu":
            assert "torchtpu.fallback" not in out
            assert nproc == 1 or "ep=2" in out  # TorchTitan built the expert-parallel mesh
        runs[device] = _losses(out)
    # Routing picks experts by top-k of float32 scores: equal on both devices here, so the
    # losses differ only by the experts' and attention's bfloat16 rounding.
    assert runs["tpu"] == pytest.approx(runs["cpu"], rel=1e-3), runs
    assert runs["tpu"][-1] < runs["tpu"][0]
