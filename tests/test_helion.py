"""A Helion kernel (Pallas backend) on tpu tensors through jax_op (torchtpu/kernels/helion.py),
against PyTorch on CPU, eager and compiled. Needs the extra: pip install -e '.[helion]'."""

import os

import pytest
import torch

os.environ.setdefault("HELION_BACKEND", "pallas")  # before Helion reads its settings
helion = pytest.importorskip("helion", reason="Helion is not installed: pip install -e '.[helion]'")

import helion.language as hl  # noqa: E402

from torchtpu.kernels.helion import helion_op  # noqa: E402
from torchtpu.testing.compare import assert_same  # noqa: E402


@helion.kernel(config=helion.Config(block_sizes=[8]), static_shapes=True)
def scaled_add(x: torch.Tensor, y: torch.Tensor) -> torch.Tensor:
    out = torch.empty_like(x)
    for tile in hl.tile(x.size(0)):
        out[tile] = x[tile] + 2 * y[tile]
    return out


op = helion_op("test_helion::scaled_add", scaled_add)


def test_schema_from_the_kernel_signature():
    assert str(torch.ops.test_helion.scaled_add.default._schema) == (
        "test_helion::scaled_add(Tensor x, Tensor y) -> Tensor")


def test_helion_kernel_eager_and_compiled(fresh_dynamo):
    x, y = torch.randn(32), torch.randn(32)
    assert_same(op(x.to("tpu"), y.to("tpu")), x + 2 * y)
    fn = torch.compile(lambda a, b: op(a * 3, b).sum(), backend="tpu")
    assert_same(fn(x.to("tpu"), y.to("tpu")), (x * 3 + 2 * y).sum(), atol=1e-4)
