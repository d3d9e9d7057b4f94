"""TorchTitan 0.3's MoE layer (the one its deepseek_v3 debug model builds: 8 routed experts, 3
per token, 2 shared) on tpu against CPU: in one process, routing (softmax, top-k), the token
reorder (stable argsort, gathers), the experts' ``torch._grouped_mm``, the combine's scatter_add
and the gradients of all of them; on two tpu_dist ranks with expert parallel (each rank holds 4
of the 8 experts; TorchTitan's ``AllToAllTokenDispatcher`` exchanges the token counts, then the
tokens with ``all_to_all_single`` and uneven splits), against the same layer on CPU without
expert parallel. The whole trainer with expert parallel is in ``tests/test_titan.py``. Needs
``pip install -e '.[titan]'``.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan", reason="TorchTitan is not installed: pip install -e '.[titan]'")

from torchtpu import metrics  # noqa: E402
from torchtpu.distributed import spawn  # noqa: E402


def _moe_layer():
    """The debug model's first MoE layer as TorchTitan configures it, with seeded weights."""
    from torchtitan.models.deepseek_v3 import model_registry

    config = model_registry("debugmodel", attn_backend="varlen").model
    moe = next(layer.moe for layer in config.layers if layer.moe is not None).build()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in moe.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.05)
    return moe.train()


def _batch(seed: int, dim: int = 256) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(2, 16, dim, generator=g), torch.randn(2, 16, dim, generator=g)


def test_titan_moe_layer_trains_like_cpu():
    moe_cpu = _moe_layer()
    moe_tpu = copy.deepcopy(moe_cpu).to("tpu")
    x, grad = _batch(1)
    before = metrics.snapshot()["cpu_fallbacks"]
    outs = []
    for moe, device in ((moe_cpu, "cpu"), (moe_tpu, "tpu")):
        xd = x.detach().to(device).requires_grad_()
        y = moe(xd)
        y.backward(grad.to(device))
        grads = {n: p.grad for n, p in moe.named_parameters()}
        outs.append({"out": y.detach(), "x": xd.grad, **grads, "tokens": moe.tokens_per_expert_E})
    assert metrics.snapshot()["cpu_fallbacks"] == before  # every op ran on the device
    want, got = outs
    assert want["tokens"].sum() == 2 * 16 * 3  # each token went to its 3 experts
    assert torch.equal(got["tokens"].cpu(), want["tokens"])  # the same routing
    for name in want:  # the experts run in bfloat16 (TorchTitan casts): a rounding apart
        scale = want[name].abs().max().item()
        torch.testing.assert_close(got[name].cpu(), want[name], rtol=2e-2, atol=2e-2 * scale,
                                   msg=name)


EXPERTS = ("w1_EFD", "w2_EDF", "w3_EFD")


def _expert_parallel_rank(rank: int, world_size: int) -> dict:
    """One rank: the layer with its half of the experts, TorchTitan's dispatcher on an "ep"
    mesh, its own batch; what it computed, and the splits its token exchange used."""
    from torch.distributed.device_mesh import init_device_mesh
    from torchtitan.distributed.utils import set_spmd_backend

    set_spmd_backend("partial_dtensor")  # as --parallelism.spmd_backend (docs, TorchTitan)
    moe = _moe_layer()
    experts = moe.routed_experts.inner_experts
    local = experts.num_experts // world_size
    for name in EXPERTS:  # the local shard, as TorchTitan's expert-parallel plan keeps it
        full = getattr(experts, name)
        setattr(experts, name, torch.nn.Parameter(full.detach()[rank * local:][:local].clone()))
    moe.to("tpu")
    dispatcher = moe.routed_experts.token_dispatcher
    dispatcher.wire_meshes(ep_mesh=init_device_mesh("tpu", (world_size,), mesh_dim_names=("ep",)))
    splits = []
    exchange = dispatcher._dispatch_token_exchange

    def recorded(routed, pg, output_splits, input_splits):
        splits.append((list(input_splits), list(output_splits)))
        return exchange(routed, pg, output_splits, input_splits)

    dispatcher._dispatch_token_exchange = recorded
    x, grad = _batch(10 + rank)
    x = x.to("tpu").requires_grad_()
    y = moe(x)
    y.backward(grad.to("tpu"))
    return {"out": y.detach().cpu(), "x": x.grad.cpu(), "splits": splits,
            **{name: getattr(experts, name).grad.cpu() for name in EXPERTS}}


@pytest.mark.parametrize("transport", ["host", "xla"])
def test_titan_moe_expert_parallel_on_two_ranks_equals_cpu(transport):
    ranks = spawn.run(_expert_parallel_rank, 2, timeout=600,
                            env={"TORCHTPU_DIST_TRANSPORT": transport})
    # CPU, no expert parallel: each rank's tokens through the whole layer; the experts'
    # gradients are the sums over both ranks' tokens.
    moe = _moe_layer()
    want = []
    for rank in range(2):
        x, grad = _batch(10 + rank)
        x.requires_grad_()
        y = moe(x)
        y.backward(grad)  # the experts' gradients accumulate over the two batches
        want.append({"out": y.detach(), "x": x.grad})
    experts = moe.routed_experts.inner_experts
    for rank, got in enumerate(ranks):
        sent, received = got["splits"][0]
        assert len(got["splits"]) == 1 and sum(sent) == 2 * 16 * 3  # each token to 3 experts
        assert len(set(sent)) > 1 or len(set(received)) > 1, got["splits"]  # uneven
        for name in ("out", "x"):
            scale = want[rank][name].abs().max().item()
            torch.testing.assert_close(got[name], want[rank][name], rtol=2e-2,
                                       atol=2e-2 * scale, msg=f"rank {rank} {name}")
        for name in EXPERTS:
            full = getattr(experts, name).grad
            shard = full[rank * 4:][:4]
            torch.testing.assert_close(got[name], shard, rtol=2e-2,
                                       atol=2e-2 * full.abs().max().item(),
                                       msg=f"rank {rank} {name}")
