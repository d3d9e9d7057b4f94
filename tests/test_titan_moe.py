"""TorchTitan 0.3's MoE layer (the one its deepseek_v3 debug model builds: 8 routed experts, 3
per token, 2 shared) on tpu against CPU, in one process: routing (softmax, top-k), the token
reorder (stable argsort, gathers), the experts' ``torch._grouped_mm``, the combine's scatter_add
and the gradients of all of them. The whole trainer with expert parallel on two ranks is in
``tests/test_titan.py``. Needs ``pip install -e '.[titan]'``.
"""

from __future__ import annotations

import copy

import pytest
import torch

pytest.importorskip("torchtitan", reason="TorchTitan is not installed: pip install -e '.[titan]'")

from torchtpu import metrics  # noqa: E402


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


def test_titan_moe_layer_trains_like_cpu():
    moe_cpu = _moe_layer()
    moe_tpu = copy.deepcopy(moe_cpu).to("tpu")
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 16, moe_cpu.routed_experts.inner_experts.w1_EFD.shape[-1], generator=g)
    grad = torch.randn(x.shape, generator=g)
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
