"""FSDP2 (``fully_shard``) on device "tpu", with the ranks as threads of one process.

The ranks share the device and the compiled programs (``torchtpu.testing.threaded``); what is
tested is the device layer under FSDP2: meta-device init and ``to_empty``, sharded DTensor
parameters, the copy-in/copy-out of its all-gathers, the storage resizes that free unsharded
parameters, reduce-scattered gradients and mixed precision. Each test also runs its ranks as
processes over ``tpu_dist`` on request (``runners.py``).
"""

import copy

import pytest
import torch
import torch.distributed.checkpoint as dcp
from runners import ALL, DEFERRED
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
from torch.distributed.tensor import DTensor, Shard

from torchtpu.demo.gpt import TinyGPT, train_steps
from torchtpu.testing.threaded import run_threads

VOCAB, BLOCK, STEPS = 32, 8, 3


def _data() -> torch.Tensor:
    return torch.randint(VOCAB, (512,), generator=torch.Generator().manual_seed(1))


def _reference() -> TinyGPT:
    torch.manual_seed(0)
    return TinyGPT(VOCAB, BLOCK)


def _sharded_gpt(mesh, state: dict, mp_policy=None) -> TinyGPT:
    """TinyGPT built on the meta device, sharded per block and at the root, then given
    storage on the device and the weights in state."""
    with torch.device("meta"):
        model = TinyGPT(VOCAB, BLOCK)
    kwargs = {} if mp_policy is None else {"mp_policy": mp_policy}
    for block in model.blocks:
        fully_shard(block, mesh=mesh, **kwargs)
    fully_shard(model, mesh=mesh, **kwargs)
    model.to_empty(device="tpu")
    set_model_state_dict(model, state, options=StateDictOptions(full_state_dict=True))
    return model


def _fsdp_training(rank, world, state, data):
    mesh = init_device_mesh("tpu", (world,))
    model = _sharded_gpt(mesh, state)
    weight = model.blocks[0].mlp[0].weight
    assert isinstance(weight, DTensor) and weight.placements == (Shard(0),)
    assert weight.to_local().shape == (128 // world, 32) and weight.device.type == "tpu"
    losses = train_steps(model, data, STEPS, "tpu", shard=(rank, world))
    # reshard_after_forward: the unsharded parameters' storages were freed (resized to 0).
    unsharded = model.blocks[0]._get_fsdp_state()._fsdp_param_group.fsdp_params[0]
    freed = unsharded._unsharded_param.untyped_storage().nbytes() == 0
    params = {k: v.full_tensor().cpu() for k, v in model.state_dict().items()}
    return losses, params, freed


@pytest.mark.parametrize("run", [*ALL, DEFERRED])
def test_fsdp2_gpt_training_equals_full_batch(run):
    data, ref = _data(), _reference()
    state = {k: v.clone() for k, v in ref.state_dict().items()}
    expected = train_steps(ref, data, STEPS, "cpu")
    outs = run(_fsdp_training, 2, args=(state, data))
    losses = torch.tensor([o[0] for o in outs]).mean(0)  # each rank's loss is over its half
    torch.testing.assert_close(losses, torch.tensor(expected), atol=1e-5, rtol=1e-5)
    for _, params, freed in outs:
        assert freed
        for name, value in ref.state_dict().items():
            torch.testing.assert_close(params[name], value, atol=2e-5, rtol=1e-4, msg=name)


def _mlp() -> nn.Sequential:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16))


def _mixed_precision(rank, world, device, ref, x):
    mesh = init_device_mesh(device, (world,))
    model = copy.deepcopy(ref).to(device)
    policy = MixedPrecisionPolicy(param_dtype=torch.bfloat16, reduce_dtype=torch.float32)
    fully_shard(model[0], mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    seen = []
    model[2].register_forward_pre_hook(lambda m, args: seen.append(m.weight.dtype))
    y = model(x.chunk(world)[rank].to(device))
    y.float().pow(2).sum().backward()
    grads = [p.grad for p in model.parameters()]
    return {
        "dtypes": (seen[0], y.dtype, model[2].weight.dtype, grads[0].dtype),
        "grads": [g.full_tensor().cpu() for g in grads],
    }


@pytest.mark.parametrize("run", ALL)
def test_fsdp2_mixed_precision_bf16_params_fp32_reduce_matches_cpu(run):
    ref, x = _mlp(), torch.randn(8, 16)
    on_tpu = run(_mixed_precision, 2, args=("tpu", ref, x))
    on_cpu = run_threads(_mixed_precision, 2, args=("cpu", ref, x))
    for tpu, cpu in zip(on_tpu, on_cpu, strict=True):
        # Computed in bf16, sharded parameters and reduced gradients kept in fp32.
        assert tpu["dtypes"] == cpu["dtypes"] == (
            torch.bfloat16, torch.bfloat16, torch.float32, torch.float32)
        for a, b in zip(tpu["grads"], cpu["grads"], strict=True):
            torch.testing.assert_close(a, b, atol=2e-2, rtol=2e-2)


def _sharded_mlp(mesh, seed: int):
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 16)).to("tpu")
    fully_shard(model[0], mesh=mesh)
    fully_shard(model, mesh=mesh)
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


def _step(model, opt, seed: int) -> None:
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(seed))
    model(x.to("tpu")).pow(2).sum().backward()
    opt.step()
    opt.zero_grad()


def _local_leaves(state) -> list:
    leaves, _ = torch.utils._pytree.tree_flatten(state)
    return [x.to_local().cpu() if isinstance(x, DTensor) else
            x.cpu() if isinstance(x, torch.Tensor) else x for x in leaves]


def _checkpoint_round_trip(rank, world, path):
    mesh = init_device_mesh("tpu", (world,))
    model, opt = _sharded_mlp(mesh, seed=0)
    _step(model, opt, seed=rank)
    msd, osd = get_state_dict(model, opt)
    dcp.save({"model": msd, "optim": osd}, checkpoint_id=path)
    saved = _local_leaves(get_state_dict(model, opt))

    other, other_opt = _sharded_mlp(mesh, seed=1)
    _step(other, other_opt, seed=rank + 7)
    msd, osd = get_state_dict(other, other_opt)
    state = {"model": msd, "optim": osd}
    dcp.load(state, checkpoint_id=path)
    set_state_dict(other, other_opt, model_state_dict=state["model"],
                   optim_state_dict=state["optim"])
    loaded = _local_leaves(get_state_dict(other, other_opt))
    # Training on from the checkpoint continues exactly as from the saved model.
    _step(model, opt, seed=9)
    _step(other, other_opt, seed=9)
    return saved, loaded, _local_leaves(model.state_dict()), _local_leaves(other.state_dict())


@pytest.mark.parametrize("run", ALL)
def test_dcp_round_trip_of_sharded_model_and_optimizer_is_exact(run, tmp_path):
    for saved, loaded, trained, resumed in run(_checkpoint_round_trip, 2, args=(str(tmp_path),)):
        assert len(saved) == len(loaded) > 8  # parameters, Adam moments, steps, hyperparameters
        for a, b in [*zip(saved, loaded, strict=True), *zip(trained, resumed, strict=True)]:
            if isinstance(a, torch.Tensor):
                assert a.dtype == b.dtype and torch.equal(a, b)
            else:
                assert a == b


def test_threaded_ranks_refuse_defer_and_fuse():
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        with pytest.raises(RuntimeError, match="cannot run ranks under DeferAndFuse"):
            run_threads(_mixed_precision, 2, args=("tpu", _mlp(), torch.randn(8, 16)))
