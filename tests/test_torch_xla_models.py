"""The PyTorch/XLA names model code (torchprime, aklein4/easy-torch-tpu) reaches for, on torchtpu's
layer: scan_layers, flash_attention, checkpoint_module, PureModule, xp.Trace, device attributes,
a torch_xla.compile step past DeferAndFuse's op bound; compared with CPU. Names that cannot keep
PyTorch/XLA's meaning import and refuse when called. The last test runs easy-torch-tpu's own
train.py, unchanged, on a local dataset (full; it needs a checkout and its packages)."""

import copy
import importlib.util
import json
import math
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import torchtpu.integrations.torch_xla as torch_xla
from torchtpu import metrics
from torchtpu.eager import defer
from torchtpu.integrations.torch_xla import install
from torchtpu.integrations.torch_xla.core import xla_builder
from torchtpu.integrations.torch_xla.debug import profiler as xp
from torchtpu.integrations.torch_xla.distributed import fsdp
from torchtpu.integrations.torch_xla.distributed.spmd import xla_sharding
from torchtpu.integrations.torch_xla.experimental import (
    assume_pure,
    custom_kernel,
    scan_layers,
    splash_attention,
    stablehlo_custom_call,
)

ROOT = Path(__file__).resolve().parents[1]


class _Layer(torch.nn.Module):
    """Takes (hidden, extras) and hands both on, as torchprime's BroadcastArguments does."""

    def __init__(self):
        super().__init__()
        self.fc = torch.nn.Linear(8, 8)

    def forward(self, h, extras):
        return torch.tanh(self.fc(h)) * extras["scale"], extras


def test_scan_layers_applies_each_layer_to_the_last_ones_output_as_on_cpu():
    torch.manual_seed(0)
    layers = [_Layer() for _ in range(3)]
    x, scale = torch.randn(2, 8), torch.tensor(0.5)
    want = x
    with torch.no_grad():
        for layer in layers:
            want, _ = layer(want, {"scale": scale})
    on_tpu = [copy.deepcopy(layer).to("tpu") for layer in layers]
    got, extras = scan_layers.scan_layers(on_tpu, (x.to("tpu"), {"scale": scale.to("tpu")}))
    torch.testing.assert_close(got.cpu(), want)
    assert extras["scale"].device.type == "tpu"
    with pytest.raises(ValueError, match="torchtpu.argument: scan_layers needs at least one"):
        scan_layers.scan_layers([], x)


@pytest.mark.parametrize("causal", [False, True])
def test_flash_attention_is_sdpa_with_the_callers_scale(causal):
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 4, 128, 16, generator=g) for _ in range(3))
    want = F.scaled_dot_product_attention(q / 4.0, k, v, is_causal=causal, scale=1.0)
    got = custom_kernel.flash_attention(*(t.to("tpu") for t in (q / 4.0, k, v)), causal=causal,
                                        partition_spec=(("data", "fsdp"), None, None, None))
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)
    custom_kernel.FlashAttention.DEFAULT_BLOCK_SIZES = {"block_q": 512}  # scripts set it
    with pytest.raises(NotImplementedError, match=r"torchtpu.unsupported: .*flash_attention\("
                                                  r"q_segment_ids=...\)"):
        custom_kernel.flash_attention(q, k, v, q_segment_ids=torch.zeros(2, 128))


def test_checkpoint_module_recomputes_its_forward_and_gives_cpus_gradients():
    calls = []

    class Counted(torch.nn.Linear):
        def forward(self, x):
            calls.append(1)
            return torch.relu(super().forward(x))

    torch.manual_seed(0)
    cpu = Counted(8, 8)
    tpu = fsdp.checkpoint_module(Counted(8, 8).to("tpu"))
    tpu.load_state_dict(cpu.state_dict())
    x = torch.randn(4, 8)
    cpu(x).sum().backward()
    calls.clear()
    tpu(x.to("tpu")).sum().backward()
    assert len(calls) == 2  # the forward, and its recomputation in the backward
    torch.testing.assert_close(tpu.weight.grad.cpu(), cpu.weight.grad)
    with pytest.raises(AttributeError, match=r"torchtpu.unsupported: torch_xla.distributed.fsdp."
                                             r"XlaFullyShardedDataParallel .*fully_shard"):
        fsdp.XlaFullyShardedDataParallel  # noqa: B018


def test_marks_that_change_no_value_and_names_that_refuse_when_called():
    lin = torch.nn.Linear(4, 4).to("tpu")
    x = torch.randn(2, 4, device="tpu")
    pure = assume_pure.PureModule(lin)
    assert torch.equal(pure(x).cpu(), lin(x).cpu()) and assume_pure.assume_pure(len) is len
    assert xla_sharding.apply_xla_patch_to_nn_linear(lin) is lin

    @xp.trace_me("scaled")
    def scaled(t):
        return t * 2

    with torch.profiler.profile() as prof, xp.Trace("region", extra="ignored"):
        scaled(x)
    names = {e.name for e in prof.events()}
    assert {"region", "scaled"} <= names
    with torch_xla._internal.jax_workarounds.jax_env_context():
        pass
    assert torch_xla.version.__version__ == torch_xla.__version__
    assert torch_xla.runtime.global_runtime_device_attributes() == [
        {"name": f"{torch_xla.runtime.device_type()}:0", "slice_index": 0}]
    config = splash_attention.SplashAttentionConfig(mesh="m", block_q=512)
    assert config.block_q == 512 and json.loads(config.to_json())["block_q"] == 512
    for call, name in ((lambda: splash_attention.splash_attention(x), "splash_attention"),
                       (lambda: stablehlo_custom_call.place_to_host(x), "place_to_host"),
                       (lambda: xla_builder.call_jax(abs, (x,)), "call_jax")):
        with pytest.raises(NotImplementedError, match=rf"torchtpu.unsupported: .*{name}"):
            call()


def test_a_compiled_step_past_defer_and_fuses_op_bound_is_still_one_program(monkeypatch):
    """A training step of a few thousand ops (easy-torch-tpu's) under full_graph=True: one
    program, not a refusal (DeferAndFuse splits recordings at its bound outside the region; a
    bound of 50 here, for a short program)."""
    monkeypatch.setattr(defer.RECORDER, "max_ops", 50)
    x = torch.ones(4, device="tpu")

    @torch_xla.compile(full_graph=True)
    def many(t):
        for _ in range(60):
            t = t + 1
        return t

    before = metrics.snapshot()
    out = many(x)
    assert metrics.snapshot()["executions"] - before["executions"] == 1
    assert torch.equal(out.cpu(), torch.full((4,), 61.0))
    assert defer.RECORDER.max_ops == 50  # restored after the region


def test_a_step_closures_read_on_its_worker_does_not_run_the_next_steps_recording():
    """xm.add_step_closure(run_async=True) reads a finished step's value on a worker thread
    while the main thread records the next step: the device checks (index bounds) pending in that
    recording stay pending, or the worker would flush the step half-way (full_graph refused
    easy-torch-tpu's step for it, now and then)."""
    import threading

    from torchtpu.device import asserts

    done = torch.ones(1, device="tpu") * 2
    table = torch.randn(10, 4)
    on_tpu = table.to("tpu")
    torch.tpu.synchronize()
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        rows = on_tpu[torch.tensor([1, 7], device="tpu") + 0]  # a bounds check, pending
        pending = len(asserts._pending)
        before = metrics.snapshot()
        read = []
        worker = threading.Thread(target=lambda: read.append(done.item()))
        worker.start()
        worker.join()
        assert read == [2.0] and metrics.snapshot()["executions"] == before["executions"]
        assert pending >= 1 and len(asserts._pending) == pending
        torch.testing.assert_close(rows.cpu(), table[[1, 7]])  # the main thread's read checks
    assert not asserts._pending


# ---------------------------------------------------------------------------- easy-torch-tpu

ETPU = os.environ.get("TORCHTPU_EASY_TORCH_TPU")  # a checkout of aklein4/easy-torch-tpu
_NEEDS = ("hydra", "omegaconf", "dotenv", "git", "datasets", "wandb", "transformers")


@pytest.mark.full
@pytest.mark.skipif(not ETPU, reason="set TORCHTPU_EASY_TORCH_TPU to a checkout of "
                                     "aklein4/easy-torch-tpu")
def test_easy_torch_tpu_trains_unchanged_on_a_local_dataset(tmp_path):
    """Its train.py with its defaults (tinyllama-test from config: scan over the layers,
    activation checkpointing, flash attention, torch_xla.compile(full_graph=True) steps, AdamW,
    clipping, async step closures), pointed by its own Hydra overrides at a JSON file of token
    ids made here (datasets' json builder) and with W&B and the Hub off (debug=true)."""
    missing = [m for m in _NEEDS if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"easy-torch-tpu needs {', '.join(missing)}")
    g = torch.Generator().manual_seed(0)
    data = tmp_path / "tokens.jsonl"
    data.write_text("".join(json.dumps({"input_ids": torch.randint(3, 32000, (32,), generator=g)
                                        .tolist()}) + "\n" for _ in range(16)))
    site = tmp_path / "site"
    assert install.main(["--target", str(site)]) == 0
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(site), str(ROOT), ".", *filter(None, [os.environ.get("PYTHONPATH")])]),
        # nothing from the Hub: offline, and the json builder's cache under tmp_path
        "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
        "HF_DATASETS_CACHE": str(tmp_path / "hf")}
    proc = subprocess.run(
        [sys.executable, "train.py", "debug=true", "data=pre-tokenized-fineweb-tinyllama-1024",
         "data.dataset.url=json", f"+data.dataset.kwargs.data_files={data}",
         "~data.dataset.kwargs.name", "data.dataset.kwargs.streaming=false", "ici_mesh.fsdp=1",
         "trainer.global_batch_size=2", "trainer.max_steps=3", f"hydra.run.dir={tmp_path}/run"],
        cwd=Path(ETPU) / "src", env=env, capture_output=True, text=True, timeout=1200)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    losses = [float(v) for v in re.findall(r"step: \d+, loss: ([\d.]+)", out)]
    assert len(losses) == 3 and "Finished training run" in out, out[-4000:]
    # Initialised at std 0.02, the logits start near 0: the loss is about ln(vocab).
    assert abs(losses[0] - math.log(32000)) < 0.1 and all(math.isfinite(v) for v in losses)
