"""An add of two same-shape operands of rank 3 or more runs in the (rows, last dim) rank of the
products that feed a residual stream (``lowering/elementwise.add``; bench/RESULTS.md, whole13),
with CPU's values."""

import jax
import jax.numpy as jnp
import pytest
import torch

from torchtpu.lowering import elementwise


@pytest.mark.parametrize("shape, other, alpha, dtype", [
    ((2, 3, 4), (2, 3, 4), 1, torch.float32),
    ((2, 3, 4, 5), (2, 3, 4, 5), 2.5, torch.float32),
    ((2, 3, 4), (2, 3, 4), 3, torch.int64),
    ((2, 3, 4), (3, 4), 1, torch.float32),     # broadcast: the plain form
    ((2, 3, 0), (2, 3, 0), 1, torch.float32),  # empty rows
    ((0, 3, 4), (0, 3, 4), 1, torch.bfloat16),
])
def test_an_add_matches_cpu(shape, other, alpha, dtype):
    g = torch.Generator().manual_seed(0)
    a, b = (torch.randn(s, generator=g).mul(10).to(dtype) for s in (shape, other))
    got = torch.add(a.to("tpu"), b.to("tpu"), alpha=alpha).cpu()
    torch.testing.assert_close(got, torch.add(a, b, alpha=alpha))


def _add_ranks(x, y) -> list:
    jaxpr = jax.make_jaxpr(elementwise.add)(x, y).jaxpr
    return [e.outvars[0].aval.ndim for e in jaxpr.eqns if e.primitive.name == "add"]


def test_a_same_shape_add_of_rank_3_runs_in_rows():
    x = jnp.ones((4, 8, 16), jnp.float32)
    assert _add_ranks(x, x) == [2]
    assert _add_ranks(jnp.ones((8, 16)), jnp.ones((8, 16))) == [2]
    assert _add_ranks(x, jnp.ones((16,))) == [3]  # a broadcast keeps its rank
