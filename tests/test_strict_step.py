"""A Strict training step as the chip sees it, counted on CPU (``testing/step_census.py``): no
host waits but the user's ``.item()``, no number copied to the device per op, bfloat16 products
under autocast, and the numbers Strict keeps on the device computing as CPU does."""

import jax
import numpy as np
import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.device import asserts
from torchtpu.eager import numbers
from torchtpu.testing.llama import Llama, LlamaConfig, train_step
from torchtpu.testing.step_census import census

CONFIG = LlamaConfig(vocab=256, dim=64, layers=1, heads=2, hidden=128, seq=32)


def _llama(dtype):
    torch.manual_seed(0)
    model = Llama(CONFIG).to("tpu")
    step, _ = train_step(model, dtype=dtype)
    ids = torch.randint(CONFIG.vocab, (2, CONFIG.seq + 1))
    x, y = ids[:, :-1].contiguous().to("tpu"), ids[:, 1:].contiguous().to("tpu")
    step(x, y)
    step(x, y)  # AdamW's state exists from the first step on: the second is the steady one
    return model, step, x, y


@pytest.fixture(scope="module")
def llama():
    return _llama(torch.bfloat16)


def test_a_strict_step_waits_for_nothing_but_the_users_item(llama):
    _, step, x, y = llama
    with census(dots=False) as c:
        loss = step(x, y)
    assert c.host_waits == [] and c.launch_count > 40  # (one layer: 50 since strict11)
    with census(dots=False) as c:
        loss.item()
    assert c.host_waits  # the census sees a wait where there is one


def test_a_strict_step_copies_no_number_to_the_device_per_op(llama):
    _, step, x, y = llama
    before = torchtpu.metrics.snapshot().get("number_transfers", 0)
    with census(dots=False) as c:
        step(x, y)
    assert not c.scalar_transfers
    # What may still cross: AdamW's step size and bias correction, which change every step (one
    # value for all parameters), unless an earlier run had their values.
    assert torchtpu.metrics.snapshot().get("number_transfers", 0) - before <= 2
    with jax.transfer_guard_host_to_device("disallow"):  # nothing implicit either
        step(x, y)


def test_under_autocast_every_product_takes_bfloat16_operands(llama):
    _, step, x, y = llama
    with census() as c:
        step(x, y)
    assert c.dots and {operands for _, operands, _, _ in c.dots} == {("bf16", "bf16")}
    assert {p for p, *_ in c.dots} >= {"aten.mm.default",
                                      "aten._scaled_dot_product_fused_attention_overrideable"
                                      ".default"}


def test_products_read_attention_gradients_from_typed_storages(llama):
    # SDPA's gradients come laid out in their inputs' order (v's: a transposed projection). They
    # were written through that view into zero bytes, and v's products read them back out of
    # the bytes: on a v5e each such product took ~40x its time (9.4 ms a run at batch 8). Laid
    # out by a clone of a permuted view (results.lay_out) or by a copy into an empty_strided
    # tensor (tensors.write's memory-order array), the storage is a typed array.
    _, step, x, y = llama
    with census(dots=False) as c:
        step(x, y)
    assert not c.byte_inputs
    assert "write_view" not in c.launches and "copy" not in c.launches


@pytest.mark.full
def test_without_autocast_products_keep_float32_at_highest():
    _, step, x, y = _llama(None)
    with census() as c:
        step(x, y)
    assert {(operands, precision) for _, operands, _, precision in c.dots} == {
        (("f32", "f32"), "HIGHEST,HIGHEST")}


def test_many_device_checks_are_merged_on_the_device_not_read():
    cpu_w = torch.randn(10, 4)
    w = cpu_w.to("tpu")
    good = torch.tensor([0, 9], device="tpu")
    with census(dots=False) as c:
        outs = [F.embedding(good, w) for _ in range(3 * asserts.MAX_PENDING)]
        bad = F.embedding(torch.tensor([2, 12], device="tpu"), w)
        outs += [F.embedding(good, w) for _ in range(2 * asserts.MAX_PENDING)]
    assert c.host_waits == [] and len(asserts._pending) <= asserts.MAX_PENDING
    with pytest.raises(IndexError, match="index 12 is out of bounds") as raised:
        bad.cpu()
    assert "test_strict_step.py" in str(raised.value.__notes__)  # the failed call's line
    assert not asserts._pending
    torch.testing.assert_close(outs[-1].cpu(), F.embedding(torch.tensor([0, 9]), cpu_w))


@pytest.mark.parametrize("number", [1e-5, -0.0, float("nan"), float("inf"), 7, -3, True,
                                    2 ** 40, 0.1 + 0.2j])
def test_numbers_kept_on_the_device_compute_as_cpu(number):
    x = torch.linspace(-2, 2, 12).reshape(3, 4)
    if isinstance(number, complex):
        x = x.to(torch.complex64)
    for _ in range(2):  # the second call finds the number kept
        got = (x.to("tpu") * number + number).cpu()
    want = x * number + number
    assert got.dtype == want.dtype
    torch.testing.assert_close(got, want, equal_nan=True)
    if isinstance(number, float) and number == 0:  # -0.0 is kept apart from 0.0
        assert torch.equal(torch.signbit(got), torch.signbit(want))


@pytest.mark.parametrize("scalars", [[0.5, 1e-3, -2.0], [3, -1, 2], [0.5, 2, -1.5, 0.5],
                                     [0.0, -0.0]])
def test_a_list_of_numbers_crosses_each_value_once_and_computes_as_cpu(scalars):
    ts = [torch.randn(5) for _ in scalars]
    devs = [t.to("tpu") for t in ts]
    torch._foreach_mul(devs, scalars)
    before = torchtpu.metrics.snapshot().get("number_transfers", 0)
    with census(dots=False) as c:
        got = torch._foreach_mul(devs, scalars)
    assert not c.scalar_transfers
    zeros = sum(1 for s in scalars if s == 0)  # a float zero's sign is no key: it crosses
    assert torchtpu.metrics.snapshot().get("number_transfers", 0) - before == zeros
    for g, t, s in zip(got, ts, scalars):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g.cpu(), t * s)


def test_a_complex_numbers_signed_zero_parts_are_kept_apart():
    # complex(-0.0, 1.0) == 1j and complex(-0.0, 0.0) == 0j: kept by value, the first one's
    # array served the others (x * -0j computed x * 0j: the zeros' signs were 0j's).
    x = torch.tensor([1 + 1j, -2 + 0.5j, 1 + 0j], dtype=torch.complex64)
    d = x.to("tpu")
    for z in (0j, complex(-0.0, 0.0), -0j, complex(-0.0, -0.0), 1j, complex(-0.0, 1.0)):
        got, want = torch.view_as_real((d * z).cpu()), torch.view_as_real(x * z)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want)), z


def test_a_kept_number_handed_back_as_a_result_is_copied():
    kept = numbers.cached(0.625)
    assert numbers.cached(0.625) is kept
    out = numbers.not_kept((kept, 1))
    assert out[0] is not kept and out[1] == 1
    np.testing.assert_array_equal(np.asarray(out[0]), 0.625)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_runs_as_one_program_and_matches_cpu(dtype):
    x = torch.randn(16, 33, dtype=dtype) * 4
    F.silu(x.to("tpu"))
    with census(dots=False) as c:
        got = F.silu(x.to("tpu")).cpu()  # read: Strict holds a pointwise call until then
    assert c.launch_count == 1
    exact = dtype != torch.float32  # float32: CPU divides by 1 + exp(-x), an ulp apart
    torch.testing.assert_close(got, F.silu(x), atol=0 if exact else 1e-6,
                               rtol=0 if exact else 1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_silu_backward_runs_as_one_program_and_matches_cpu(dtype):
    x, g = (torch.randn(16, 33) * 4).to(dtype), torch.randn(16, 33).to(dtype)
    grads = []
    for device in ("cpu", "tpu"):
        leaf = x.to(device).detach().requires_grad_()
        y = F.silu(leaf)
        with census(dots=False) as c:
            y.backward(g.to(device))
            grads.append(leaf.grad.cpu())  # (held since strict8: computed by this read)
    # autograd calls silu_backward with grad mode off: it has a device kernel, as on CPU
    assert c.launches == {"aten.silu_backward.default": 1}
    exact = dtype != torch.float32  # float32: CPU divides by 1 + exp(-x), an ulp apart
    torch.testing.assert_close(grads[1], grads[0], atol=0 if exact else 1e-6,
                               rtol=0 if exact else 1e-6)


def test_silu_double_backward_keeps_its_formula():
    x = torch.randn(6)
    grads = []
    for device in ("cpu", "tpu"):
        leaf = x.to(device).detach().requires_grad_()
        (first,) = torch.autograd.grad(F.silu(leaf).sum(), leaf, create_graph=True)
        first.sum().backward()
        grads.append(leaf.grad.cpu())
    torch.testing.assert_close(grads[1], grads[0], atol=1e-6, rtol=1e-6)


VIEW_CASTS = {
    "slice to float64": lambda t: t[1:4].to(torch.float64),
    "strided columns to bf16": lambda t: t[:, ::2].to(torch.bfloat16),
    "a row to int32": lambda t: t[2].to(torch.int32),
    "expanded to bf16": lambda t: t.expand(2, 6, 8).to(torch.bfloat16),
    "reshaped then cast": lambda t: t.view(48)[5:29].float().double(),
}


@pytest.mark.parametrize("name", VIEW_CASTS)
def test_a_views_cast_reads_and_casts_in_one_program(name):
    fn, x = VIEW_CASTS[name], torch.randn(6, 8)
    fn(x.to("tpu"))
    d = x.to("tpu")
    with census(dots=False) as c:
        got = fn(d)
        value = got.cpu()  # a float copy of a view may be held until read (``lazy_casts``)
    want = fn(x)
    assert c.launch_count == 1
    assert got.dtype == want.dtype and got.stride() == want.stride()
    assert torch.equal(value, want)


def test_a_contiguous_cast_wraps_its_value_without_an_empty_tensor(monkeypatch):
    from torchtpu.device import tensors

    x = torch.randn(6, 8)
    d = x.to("tpu").requires_grad_()
    made, new_tensor = [], tensors.new_tensor
    monkeypatch.setattr(tensors, "new_tensor", lambda *a, **k: made.append(a) or new_tensor(*a,
                                                                                           **k))
    got = d.to(torch.bfloat16)  # every autocast cast of a weight or an activation
    assert made == []
    assert torch.equal(got.cpu(), x.to(torch.bfloat16)) and got.stride() == (8, 1)
    got.float().sum().backward()
    assert torch.equal(d.grad.cpu(), torch.ones(6, 8))
    same = d.detach().to(torch.float32, copy=True)  # a copy of its own, never the same buffer
    same.add_(1)
    assert torch.equal(d.detach().cpu(), x)


@pytest.mark.parametrize("where", [(slice(None), slice(4, 8)), (slice(1, 6, 2),),
                                   (slice(None), slice(-3, None)), (slice(2, 2),),
                                   (Ellipsis, slice(1, 7, 3))])
def test_a_slices_gradient_is_one_program(where):
    x = torch.randn(6, 8, requires_grad=True)
    g = torch.randn(x[where].shape)
    x[where].backward(g)
    d = x.detach().to("tpu").requires_grad_()
    d[where].backward(g.to("tpu"))  # the rotary halves' backward in every attention layer
    d.grad = None
    with census(dots=False) as c:
        d[where].backward(g.to("tpu"))
        grad = d.grad.cpu()  # the pad may be held until read (``lazy_casts``)
    assert c.launch_count == 1
    assert torch.equal(grad, x.grad)
