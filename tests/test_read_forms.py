"""A recorded program's projections into attention's heads are written as heads, in a capture and
in a DeferAndFuse flush (``eager/read_forms.py``, ``heads._read_as_heads``; bench/RESULTS.md,
whole9, whole10), with CPU's values; projections out of them (o's forward, q/k/v's input
gradients) and every other product stay 2-D."""

import re

import numpy as np
import pytest
import torch

import torchtpu  # noqa: F401
from torchtpu import metrics
from torchtpu.device.views import Geometry
from torchtpu.eager.defer import RECORDER
from torchtpu.lowering import heads, linalg
from torchtpu.lowering.registry import READ_FORMS
from torchtpu.testing.llama import Attention, LlamaConfig

B, T, H, D = 2, 16, 2, 32
C = LlamaConfig(vocab=64, dim=H * D, layers=1, heads=H, hidden=96, seq=T)


def _geometry(size, stride, offset=0, shape=(B * T, H * D), dtype=np.dtype("float32")):
    return Geometry(shape, dtype, size, stride, offset, dtype)


def test_a_product_read_as_heads_takes_the_batch_and_head_dim_from_the_view():
    n = H * D
    q = _geometry((B, H, T, D), (T * n, D, n, 1))  # .view(b, t, h, d).transpose(1, 2)
    assert heads._read_as_heads(q).keywords == {"rows": T, "lanes": D}
    # rotary's half of each head: the same form, so both readers agree
    assert heads._read_as_heads(_geometry((B, H, T, D // 2), (T * n, D, n, 1), D // 2)) \
        is heads._read_as_heads(q)
    for other in (_geometry((B, T, n), (T * n, n, 1)),       # the residual stream's (b, t, n)
                  _geometry((n, B * T), (1, n)),             # a transpose (a weight gradient's)
                  _geometry((1, T, H, D), (T * n, n, D, 1), shape=(T, n)),  # one sequence
                  q._replace(dtype=np.dtype("int32"))):                  # another dtype's view
        assert heads._read_as_heads(other) is None, other


def test_the_heads_product_is_the_product_and_leaves_other_products_as_they_were():
    import jax.numpy as jnp

    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B * T, 48)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((48, H * D)), jnp.bfloat16)
    np.testing.assert_array_equal(heads.heads_product(x, y, rows=T, lanes=D),
                                  linalg.matmul(x, y))
    x32, y32 = x.astype(jnp.float32), y.astype(jnp.float32)  # float32: as the table has it
    np.testing.assert_array_equal(heads.heads_product(x32, y32, rows=T, lanes=D),
                                  linalg.matmul(x32, y32))


def _heads_products(hlo: str) -> bool:
    """Whether a product's result is (batch, length, heads, head_dim) (q, k and v share one
    function of the text, called three times: a count would say nothing)."""
    return re.search(rf"stablehlo\.dot_general.*-> tensor<{B}x{T}x{H}x{D}x", hlo) is not None


@pytest.mark.parametrize("mode,undone", [("capture", None), ("capture", "read"),
                                         ("defer", None), ("defer", "read")])
def test_a_recorded_attention_block_writes_q_k_v_and_os_input_gradient_as_heads(
        mode, undone, monkeypatch):
    mm = torch.ops.aten.mm.default
    if undone == "read":  # the rule undone: the same block, every product 2-D
        monkeypatch.setitem(READ_FORMS, mm, lambda g: None)
    torch.manual_seed(0)
    cpu = Attention(C)
    dev = Attention(C).to("tpu")
    dev.load_state_dict(cpu.state_dict())
    x = torch.randn(B, T, C.dim, requires_grad=True)  # q, k and v's input gradients too
    xd = x.detach().to("tpu").requires_grad_()
    angle = torch.randn(T, D)
    cos, sin = angle.cos(), angle.sin()
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu(x, cos, sin).float().square().sum().backward()
    before = metrics.snapshot()
    if mode == "capture":
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g), torch.autocast("tpu", dtype=torch.bfloat16):
            dev(xd, cos.to("tpu"), sin.to("tpu")).float().square().sum().backward()
        g.replay()
    else:  # one DeferAndFuse program: the same forms at its flush
        # (built here: the recorder keeps programs by recording, and another case's program
        # of this block was made with the rule as it was then)
        monkeypatch.setattr(RECORDER, "_programs", {})
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE), \
                torch.autocast("tpu", dtype=torch.bfloat16):
            dev(xd, cos.to("tpu"), sin.to("tpu")).float().square().sum().backward()
    after = metrics.snapshot()
    formed = after.get("read_forms", 0) - before.get("read_forms", 0)
    # q, k and v's forward products and o's input gradient; not o's forward nor q/k/v's input
    # gradients (the residual stream's), nor a weight gradient
    assert formed == (0 if undone == "read" else 4)
    if mode == "capture":
        assert _heads_products(g.captured.hlo()) == (undone != "read")
    for c, d in zip([*cpu.parameters(), x], [*dev.parameters(), xd], strict=True):
        torch.testing.assert_close(d.grad.cpu(), c.grad, atol=2e-2, rtol=2e-2)
