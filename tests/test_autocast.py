"""torch.autocast("tpu"): bfloat16 by default, the same casting policy as CPU/CUDA autocast."""

import torch

from torchtpu.testing.compare import assert_same, to_device


def _step(a, b):
    y = a @ b
    return y, y.float() * 2


def test_matmul_runs_in_bfloat16_and_matches_cpu_autocast():
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        expected = _step(a, b)
    with torch.autocast("tpu"):
        actual = _step(*to_device((a, b)))
    assert actual[0].dtype == torch.bfloat16
    assert_same(actual, expected, atol=2e-2, rtol=2e-2)


def test_gradients_flow_in_float32_leaves():
    a = torch.randn(4, 4).to("tpu").requires_grad_()
    with torch.autocast("tpu", dtype=torch.bfloat16):
        loss = (a @ a).float().sum()
    loss.backward()
    assert a.grad.dtype == torch.float32
    expected = torch.ones(4, 4) @ a.detach().cpu().T + a.detach().cpu().T @ torch.ones(4, 4)
    torch.testing.assert_close(a.grad.cpu(), expected, atol=0.1, rtol=0.05)
