"""A recorded program's products over attention's heads are contracted at the tokens' (batch,
length) rank (``eager/read_forms.view_forms``, ``heads._reads_heads``; bench/RESULTS.md, whole14):
q/k/v's input gradients split their rows, the weight gradients of o, q, k and v contract (batch,
length) on a TPU; with CPU's values, in a capture and a DeferAndFuse flush. o's forward (a
weight read through a view) and products reading no heads array keep the table's form."""

import re

import jax
import numpy as np
import torch

import torchtpu  # noqa: F401
from torchtpu import metrics
from torchtpu.device.views import Geometry
from torchtpu.lowering import heads, linalg
from torchtpu.lowering.registry import VIEW_FORMS
from torchtpu.testing.llama import Attention, LlamaConfig

B, T, H, D = 3, 16, 2, 32  # not test_read_forms.py's: DeferAndFuse keeps programs by recording
N = H * D
C = LlamaConfig(vocab=64, dim=N, layers=1, heads=H, hidden=96, seq=T)
BF16 = np.dtype(jax.numpy.bfloat16)


def _read(size, stride, shape=(B, T, H, D), offset=0, dtype=BF16):
    return Geometry(shape, dtype, size, stride, offset, dtype)


HEADS = _read((B * T, N), (N, 1))      # the kernel's (b, t, h, d) read as (b * t, n)
HEADS_T = _read((N, B * T), (1, N))    # its transpose: a weight gradient's left operand


def test_the_rule_takes_the_tokens_from_a_heads_array_read_plain_or_transposed():
    rows, over = heads._reads_heads((HEADS, None)), heads._reads_heads((HEADS_T, HEADS))
    assert rows.func is heads.rows_product and rows.keywords == {"batch": B, "length": T}
    assert over.func is heads.contracted_product and over.keywords == rows.keywords
    # a weight gradient whose right operand is the heads array (o's: the kernel's output)
    assert heads._reads_heads((None, HEADS)) is over
    weight_t = _read((N, N), (1, N), shape=(N, N))  # w.t(): a forward projection's (o's)
    for reads in [(None, None), (HEADS,), (None, HEADS_T),  # contracting the heads' n
                  (HEADS, weight_t),
                  (_read((B * T, N), (N, 1), shape=(B, T, N)), None),    # the stream's (b, t, n)
                  (_read((B * T, N), (N, 1), offset=N), None),           # a shifted view
                  (_read((B * T, N), (N, 1), dtype=np.dtype("float32"))._replace(
                      array_dtype=BF16), None)]:                         # a reinterpreting view
        assert heads._reads_heads(reads) is None, reads


def test_the_forms_compute_the_product():
    jnp = jax.numpy
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((B * T, 48)), jnp.bfloat16)
    y = jnp.asarray(rng.standard_normal((48, N)), jnp.bfloat16)
    np.testing.assert_array_equal(heads.rows_product(x, y, batch=B, length=T),
                                  linalg.matmul(x, y))
    g = jnp.asarray(rng.standard_normal((48, B * T)), jnp.bfloat16)
    np.testing.assert_array_equal(heads.contracted_product(g, x, batch=B, length=T),
                                  linalg.matmul(g, x))  # XLA:CPU: the table's product
    g32, x32 = g.astype(jnp.float32), x.astype(jnp.float32)  # the TPU's form, in float32 here
    np.testing.assert_allclose(heads._over_tokens(g32, x32, batch=B, length=T), g32 @ x32,
                               rtol=1e-5, atol=1e-4)
    np.testing.assert_array_equal(heads.rows_product(x32, y.astype(jnp.float32), batch=B,
                                                     length=T), linalg.matmul(x32, y.astype(
                                                         jnp.float32)))  # float32: the table's


def _rows_products(text: str, t: int) -> int:
    """Products with a (batch, length, n) result: the rows form's (the three input gradients:
    one function per shape, so one in the text)."""
    return len(re.findall(rf"stablehlo\.dot_general.*-> tensor<{B}x{t}x{N}xf32>", text))


def _block(mode: str, undone: bool, monkeypatch) -> tuple:
    """An attention block's forward and backward under autocast on tpu: (gradients, forms taken
    (view, read), the capture or None)."""
    if undone:  # the rule undone: every product over heads 2-D
        monkeypatch.setitem(VIEW_FORMS, torch.ops.aten.mm.default, lambda reads: None)
    torch.manual_seed(0)
    dev = Attention(C).to("tpu")
    xd = torch.randn(B, T, C.dim).to("tpu").requires_grad_()
    angle = torch.randn(T, D)
    cos, sin = angle.cos().to("tpu"), angle.sin().to("tpu")
    before, g = metrics.snapshot(), None
    if mode == "capture":
        g = torch.tpu.TPUGraph()
        with torch.tpu.graph(g), torch.autocast("tpu", dtype=torch.bfloat16):
            dev(xd, cos, sin).float().square().sum().backward()
        g.replay()
    else:
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE), \
                torch.autocast("tpu", dtype=torch.bfloat16):
            dev(xd, cos, sin).float().square().sum().backward()
    grads = [p.grad.cpu() for p in [*dev.parameters(), xd]]  # (DeferAndFuse flushes here)
    after = metrics.snapshot()
    taken = tuple(after.get(k, 0) - before.get(k, 0) for k in ("view_forms", "read_forms"))
    monkeypatch.undo()
    return grads, taken, g


def _cpu() -> list:
    torch.manual_seed(0)
    cpu = Attention(C)
    x = torch.randn(B, T, C.dim, requires_grad=True)
    angle = torch.randn(T, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        cpu(x, angle.cos(), angle.sin()).float().square().sum().backward()
    return [p.grad for p in [*cpu.parameters(), x]]


def test_a_captured_attention_blocks_products_over_heads_take_the_tokens_rank(monkeypatch):
    grads, taken, g = _block("capture", False, monkeypatch)
    # q/k/v's input gradients (rows); o, q, k and v's weight gradients; the read forms as were
    assert taken == (7, 4)
    plain, taken, g0 = _block("capture", True, monkeypatch)
    assert taken == (0, 4)
    for got, table in zip(grads, plain, strict=True):  # the same values as the table's form
        torch.testing.assert_close(got, table, atol=0, rtol=0)
    for got, want in zip(grads, _cpu(), strict=True):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)  # bf16 products' noise
    for capture, formed in ((g, True), (g0, False)):
        c = capture.captured
        assert (_rows_products(c.hlo(), T) > 0) == formed
        tpu = jax.export.export(c._fn.jitted, platforms=["tpu"])(*c._io.arguments())
        over = re.findall(rf"stablehlo\.dot_general.*contracting_dims = \[0, 1\] x \[0, 1\].*"
                          rf"tensor<{B}x{T}x{N}xbf16>", tpu.mlir_module())
        assert bool(over) == formed  # the weight gradients over (batch, length) on a TPU


def test_a_deferandfuse_flush_takes_the_same_forms(monkeypatch):
    grads, taken, _ = _block("defer", False, monkeypatch)
    assert taken == (7, 4)
    for got, want in zip(grads, _cpu(), strict=True):
        torch.testing.assert_close(got, want, atol=3e-2, rtol=2e-2)
