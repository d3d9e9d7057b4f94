"""The quick-start path: creating tensors on tpu, moving them, simple math, printing."""

import torch

from torchtpu.testing.compare import check_against_cpu


def test_quickstart_runs_on_tpu():
    x = torch.ones((4, 4), device="tpu")
    y = torch.full((4, 4), 2.0).to("tpu")
    result = torch.matmul(x, y).cpu()
    assert x.device == torch.device("tpu", 0)
    assert str(x.device) == "tpu:0"
    torch.testing.assert_close(result, torch.full((4, 4), 8.0))


def test_add_mul_match_cpu():
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    check_against_cpu(lambda a, b: a + b * 2 - a / 3, a, b)


def test_is_plain_tensor():
    x = torch.zeros(2, device="tpu")
    assert type(x) is torch.Tensor
    assert x.is_tpu
