"""Ray 2.60 on tpu: Ray Train's ``TorchTrainer`` with ``TorchConfig(backend="tpu_dist")`` trains
TinyGPT with DDP on 2 local workers, each on its own tpu device, with the losses of the
single-process full-batch run on CPU; more workers on a host than it has devices (simulated with
XLA:CPU's forced device count) fail before the loop starts, naming both counts; Ray Data's
``iter_torch_batches(device="tpu")`` hands batches already on the device; with
``FailureConfig(max_failures=1)``, a worker SIGKILLed mid-training is restarted, the group
resumes from its last reported checkpoint and ends with the uninterrupted run's weights. One local
Ray instance for the module, started with bounded time and shut down after it, also on failure.
Needs ``pip install -e '.[ray]'``.
"""

import os
import signal
import sys
import tempfile
import time

import pytest
import torch

pytest.importorskip("ray.train", reason="Ray is not installed: pip install -e '.[ray]'")

import ray  # noqa: E402
import ray.data  # noqa: E402
from ray.train import FailureConfig, RunConfig, ScalingConfig  # noqa: E402
from ray.train.torch import TorchConfig, TorchTrainer  # noqa: E402
from ray.util.placement_group import PlacementGroup  # noqa: E402

from torchtpu.demo.gpt import TinyGPT, batch, train_steps  # noqa: E402
from torchtpu.testing.conformance import time_limit  # noqa: E402

STEPS, WORKERS, VOCAB, BLOCK, BATCH = 3, 2, 17, 8, 8
TOO_MANY = 3  # workers, for a host simulated with WORKERS devices
FIT_S = 300  # a fit that takes longer is a hang (each took ~30-70 s here)


def _data() -> torch.Tensor:
    return torch.randint(0, VOCAB, (400,), generator=torch.Generator().manual_seed(0))


def _model() -> TinyGPT:
    torch.manual_seed(1)
    return TinyGPT(vocab=VOCAB, block=BLOCK)


def _train_loop(config: dict) -> None:
    """One Ray Train worker: its share of every batch, DDP averaging the gradients."""
    import ray.train
    import ray.train.torch
    import torch.distributed as dist

    import torchtpu

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    # This process's own device (tpu_dist gave it its LOCAL_RANK). Ray Train's own device
    # choice follows "TPU" resources, which Ray schedules only on a real TPU slice (topology,
    # accelerator type), so the device is named here.
    device = torch.device("tpu")
    model = _model()
    ddp = ray.train.torch.prepare_model(model, move_to_device=device)  # to the device, in DDP
    assert next(ddp.parameters()).device.type == "tpu"
    ddp.block = model.block
    losses = torch.tensor(train_steps(ddp, _data(), STEPS, device, batch_size=BATCH,
                                      shard=(rank, world)), device=device)
    # The mean of the equal shards' mean losses is the full batch's loss.
    dist.all_reduce(losses)
    metrics = {"losses": (losses / world).tolist(), "device": str(device),
               "backend": dist.get_backend(),
               "fallbacks": torchtpu.metrics.snapshot()["cpu_fallbacks"]}
    with tempfile.TemporaryDirectory() as folder:  # Ray keeps metrics that come with a checkpoint
        checkpoint = None
        if rank == 0:
            torch.save({k: v.cpu() for k, v in model.state_dict().items()},
                       os.path.join(folder, "model.pt"))
            checkpoint = ray.train.Checkpoint.from_directory(folder)
        ray.train.report(metrics, checkpoint=checkpoint)


@pytest.fixture(scope="module")
def local_ray():
    # Workers import torchtpu (and this module) from where this process does.
    ray.init(num_cpus=TOO_MANY + 1, include_dashboard=False,
             log_to_driver=False, runtime_env={"env_vars": {
                 "PYTHONPATH": os.pathsep.join(sys.path)}})
    try:
        yield
    finally:
        ray.shutdown()


@pytest.fixture(autouse=True)
def _resources_released(local_ray):
    """Each test leaves the instance's CPUs free for the next. Ray Train 2.60 keeps the placement
    group of a worker group whose backend failed to start (the too-many test's), holding its CPUs
    until the driver exits; the next trainer then waits for workers that cannot be placed, and
    its restart after a failure waited forever (CI's ray stage ran out of its time)."""
    before = set(ray.util.placement_group_table())
    yield
    for pg_id, pg in ray.util.placement_group_table().items():
        if pg_id not in before and pg["state"] == "CREATED":
            ray.util.remove_placement_group(
                PlacementGroup(ray.PlacementGroupID(bytes.fromhex(pg_id))))
    total, deadline = ray.cluster_resources().get("CPU"), time.monotonic() + 30
    while (free := ray.available_resources().get("CPU", 0)) != total:
        assert time.monotonic() < deadline, f"{total - free} of {total} CPUs still held after 30 s"
        time.sleep(0.2)


def _fit(trainer: TorchTrainer):
    with time_limit(FIT_S):
        return trainer.fit()


def test_torch_trainer_with_tpu_dist_matches_the_full_batch_on_cpu(local_ray, tmp_path):
    trainer = TorchTrainer(
        _train_loop, torch_config=TorchConfig(backend="tpu_dist", timeout_s=300),
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(storage_path=str(tmp_path), name="tinygpt"))
    result = _fit(trainer)
    assert result.error is None, result.error
    metrics = result.metrics
    assert metrics["device"].startswith("tpu") and metrics["backend"] == "tpu_dist"
    assert metrics["fallbacks"] == {}  # every op of the step ran on the device
    reference = _model()
    expected = train_steps(reference, _data(), STEPS, "cpu", batch_size=BATCH)
    assert metrics["losses"] == pytest.approx(expected, rel=1e-5, abs=1e-6)
    # The checkpointed weights predict as the reference's do. (Weights themselves are not
    # compared: the key bias gets a zero gradient in exact arithmetic, which AdamW turns into
    # a step of the rounding noise's sign.)
    trained = _model()
    with result.checkpoint.as_directory() as folder:
        trained.load_state_dict(torch.load(os.path.join(folder, "model.pt")))
    x = _data()[:BLOCK + 1].reshape(1, -1)
    with torch.no_grad():
        assert trained(x[:, :-1], x[:, 1:])[1].item() == pytest.approx(
            reference(x[:, :-1], x[:, 1:])[1].item(), rel=1e-5)


def _touch(config: dict) -> None:
    open(config["marker"], "w").close()


def test_more_workers_than_devices_fail_before_the_loop(local_ray, tmp_path):
    marker = tmp_path / "loop-ran"
    devices = {"XLA_FLAGS": f"--xla_force_host_platform_device_count={WORKERS}",
               "TORCHTPU_PLATFORM": "cpu"}
    trainer = TorchTrainer(
        _touch, train_loop_config={"marker": str(marker)},
        torch_config=TorchConfig(backend="tpu_dist", timeout_s=120),
        scaling_config=ScalingConfig(num_workers=TOO_MANY),
        run_config=RunConfig(storage_path=str(tmp_path), name="too-many",
                             worker_runtime_env={"env_vars": devices}))
    with pytest.raises(Exception, match=f"{TOO_MANY} processes were started on this host, but "
                                        f"it has {WORKERS} cpu devices"):
        _fit(trainer)
    assert not marker.exists()


def test_iter_torch_batches_hands_batches_on_tpu(local_ray):
    rows = torch.arange(12, dtype=torch.float32).reshape(6, 2)
    ds = ray.data.from_items([{"x": row.numpy(), "y": int(i)} for i, row in enumerate(rows)])
    batches = list(ds.iter_torch_batches(batch_size=4, device="tpu"))
    assert [b["x"].device.type for b in batches] == ["tpu", "tpu"]
    assert type(batches[0]["x"]) is torch.Tensor
    got = torch.cat([b["x"].cpu() for b in batches])
    assert torch.equal(got[torch.cat([b["y"].cpu() for b in batches]).argsort()], rows)


RESUME_STEPS, KILL_AT = 4, 2  # the kill comes after two checkpointed steps
POLL_S = 2.0  # Ray Train 2.60's DEFAULT_HEALTH_CHECK_INTERVAL_S


def _sgd(params) -> torch.optim.SGD:
    # Momentum, so that a resume which lost the optimizer's state ends with other weights.
    return torch.optim.SGD(params, lr=0.1, momentum=0.9)


def _sgd_step(model, opt, step: int, device, shard: tuple[int, int] = (0, 1)) -> None:
    x, y = batch(_data(), BATCH, BLOCK, torch.Generator().manual_seed(step))
    rank, world = shard
    _, loss = model(x.chunk(world)[rank].to(device), y.chunk(world)[rank].to(device))
    opt.zero_grad(set_to_none=True)
    loss.backward()
    opt.step()


def _on_cpu(tree):
    return torch.utils._pytree.tree_map_only(torch.Tensor, lambda t: t.cpu(), tree)


def _resumable_loop(config: dict) -> None:
    """Checkpoints every step; rank 1 of the first attempt SIGKILLs itself before step KILL_AT."""
    import ray.train
    import ray.train.torch

    context = ray.train.get_context()
    rank, world = context.get_world_rank(), context.get_world_size()
    device = torch.device("tpu")
    model, start, state = _model(), 0, None
    checkpoint = ray.train.get_checkpoint()
    if checkpoint is not None:
        with checkpoint.as_directory() as folder:
            state = torch.load(os.path.join(folder, "state.pt"))
        model.load_state_dict(state["model"])
        start = state["step"]
    ddp = ray.train.torch.prepare_model(model, move_to_device=device)
    opt = _sgd(ddp.parameters())
    if state is not None:
        opt.load_state_dict(state["opt"])
    for step in range(start, RESUME_STEPS):
        if step == KILL_AT and rank == 1 and not os.path.exists(config["marker"]):
            open(config["marker"], "w").close()
            # Ray Train's controller collects reports when it polls the workers (every 2 s): a
            # worker that dies first takes its uncollected reports, and the checkpoints they
            # commit, with it. Warm steps take milliseconds, so wait out a few polls.
            time.sleep(3 * POLL_S)
            os.kill(os.getpid(), signal.SIGKILL)
        _sgd_step(ddp, opt, step, device, (rank, world))
        with tempfile.TemporaryDirectory() as folder:
            saved = None
            if rank == 0:
                torch.save({"model": _on_cpu(model.state_dict()),
                            "opt": _on_cpu(opt.state_dict()), "step": step + 1},
                           os.path.join(folder, "state.pt"))
                saved = ray.train.Checkpoint.from_directory(folder)
            ray.train.report({"step": step + 1, "resumed_from": start}, checkpoint=saved)


def test_killed_worker_restarts_from_its_checkpoint_with_the_uninterrupted_weights(
        local_ray, tmp_path):
    marker = tmp_path / "killed-once"
    trainer = TorchTrainer(
        _resumable_loop, train_loop_config={"marker": str(marker)},
        torch_config=TorchConfig(backend="tpu_dist", timeout_s=120),
        scaling_config=ScalingConfig(num_workers=WORKERS),
        run_config=RunConfig(storage_path=str(tmp_path), name="resume",
                             failure_config=FailureConfig(max_failures=1)))
    result = _fit(trainer)
    assert result.error is None, result.error
    assert marker.exists()  # a worker really died
    # Ray commits a step's checkpoint once every worker has reported it, so the restart resumes
    # from the last step both reported before the kill or the one before it.
    assert result.metrics["step"] == RESUME_STEPS and 0 < result.metrics["resumed_from"] <= KILL_AT
    reference = _model()
    opt = _sgd(reference.parameters())
    for step in range(RESUME_STEPS):
        _sgd_step(reference, opt, step, "cpu")
    with result.checkpoint.as_directory() as folder:
        trained = torch.load(os.path.join(folder, "state.pt"))["model"]
    for name, value in reference.state_dict().items():
        torch.testing.assert_close(trained[name], value, rtol=1e-5, atol=1e-6, msg=name)
