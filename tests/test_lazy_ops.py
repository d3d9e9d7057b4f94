"""Strict's lazy pointwise calls (``lazy_casts.lazy_op``): a pointwise op of one tensor computed
inside the program of the op that reads it, one launch less, every reader seeing the value as
CPU computes it."""

import jax
import pytest
import torch

from torchtpu.eager import executor, held_sources, lazy_casts
from torchtpu.testing.llama import LlamaConfig, seeded_step
from torchtpu.testing.step_census import census

CONFIG = LlamaConfig(vocab=128, dim=32, layers=2, heads=2, hidden=64, seq=16)


# XLA:CPU computes as CPU's kernels do, to the bit; a TPU's fast transcendental forms and its
# excess precision between a bfloat16 cast and a product part from CPU in the last bits (the
# chip ran these tests in session 27): there the values are compared within a float32 or a
# bfloat16 tolerance instead


def _as_cpu(got: torch.Tensor, want: torch.Tensor) -> None:
    if jax.devices()[0].platform == "cpu":
        assert torch.equal(got, want), (got, want)
    elif want.dtype == torch.float32:
        torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    else:
        torch.testing.assert_close(got, want)


def _lazy(t: torch.Tensor) -> bool:
    held = t.untyped_storage()._tpu_array
    return type(held) is lazy_casts.Converted and held.source is not None


@pytest.fixture
def lazy_ops_off():
    def turn(on: bool) -> None:
        executor.Strict.lazy_ops = on

    yield turn
    executor.Strict.lazy_ops = True


def test_a_norms_chain_runs_in_its_reduction_as_cpu(lazy_ops_off, buckets_off):
    x = torch.randn(4, 6, 32)
    d = x.to("tpu")
    norm = lambda v: torch.rsqrt(v.pow(2).mean(-1, keepdim=True) + 1e-5)  # noqa: E731
    for _ in range(2):  # compiled; the first call of a spec over held values reads them computed
        norm(d).cpu()
    with census(dots=False) as c:
        squares = d.pow(2)
        got = norm(d)
        assert _lazy(squares)
        got = got.cpu()
    # pow, mean (kept), the add of the traced eps and rsqrt held until read: the read
    assert c.launch_count == 1, c.launches
    lazy_ops_off(False)
    # What each op launched gives, but for the order a reduction fused with its producer sums
    # in (an ulp)
    torch.testing.assert_close(got, norm(d).cpu(), rtol=1e-6, atol=0)
    torch.testing.assert_close(got, norm(x))


READS = {
    "cpu": lambda y: y.cpu(),
    "a view": lambda y: (y[1:3] * 2).cpu(),
    "a transposed product": lambda y: (y.t() @ y).cpu(),
    "twice in one program": lambda y: (y * y).cpu(),
    "in a list": lambda y: torch._foreach_norm([y, y[0]])[1].cpu(),
    "written in place": lambda y: y.mul_(3).cpu(),
    "negated in place": lambda y: y.neg_().cpu(),
    "a row negated in place": lambda y: (y[1].neg_(), y.cpu())[1],
    "a view written": lambda y: (y[0].fill_(7.0), y.cpu())[1],
    "copied into": lambda y: torch.zeros(4, 4, device="tpu").copy_(y).cpu(),
    "copied from": lambda y: y.copy_(torch.ones(4, 4)).cpu(),
    "item": lambda y: torch.tensor(y[1, 2].item()),
}


@pytest.mark.parametrize("name", READS)
def test_every_reader_of_a_held_call_sees_it_as_cpu(name):
    x = torch.randn(4, 4)
    y = torch.sigmoid(x.to("tpu"))
    assert _lazy(y)
    torch.testing.assert_close(READS[name](y), READS[name](torch.sigmoid(x)))


def test_a_call_repeated_over_other_held_calls_reads_each_as_its_own():
    # The short path (``seen_calls``) repeats a call's reads: a held call of another op, the
    # same shape and dtype, is another read.
    x, w = torch.randn(4, 4), torch.randn(4, 4)
    d, e = x.to("tpu"), w.to("tpu")
    for _ in range(3):
        for f in (torch.neg, torch.sigmoid, torch.neg, torch.exp):
            y = f(d)
            assert _lazy(y)
            _as_cpu((y + e).cpu(), f(x) + w)


def test_its_source_written_afterwards_leaves_the_value_as_it_was():
    x = torch.randn(4, 4)
    d = x.to("tpu")
    y = d.neg()
    d[1].fill_(5)   # a view write: the lent source is not given away
    d.add_(1)       # in place, whole
    assert _lazy(y)
    assert torch.equal(y.cpu(), -x)


def test_an_in_place_call_writes_its_value():
    x = torch.randn(4, 4)
    d = x.to("tpu")
    d[1].neg_()     # through a view: the write needs the value
    d[:, 2].sigmoid_()
    d.mul_(2)       # whole
    x[1].neg_()
    x[:, 2].sigmoid_()
    _as_cpu(d.cpu(), x * 2)


def test_a_call_smaller_than_its_source_is_settled_by_its_first_reader(buckets_off):
    # The rotary half's negation reads a slice of a larger array: kept, so the array is let go
    # once the program reading the concatenation (held too, since strict11) has read it.
    x = torch.randn(2, 8)
    d = x.to("tpu")
    # (The first cat of a spec reads its inputs whole, where eager buckets came on as the
    # device loaded in this test.)
    torch.cat((-d[..., 4:], d[..., :4]), dim=-1).sum(-1).cpu()
    turned = -d[..., 4:]
    assert _lazy(turned) and turned.untyped_storage()._tpu_array.keep
    got = torch.cat((turned, d[..., :4]), dim=-1)
    assert _lazy(got) and _lazy(turned)
    total = got.sum(-1)
    assert not _lazy(turned) and not lazy_casts._kept
    assert torch.equal(total.cpu(), torch.cat((-x[..., 4:], x[..., :4]), dim=-1).sum(-1))
    assert torch.equal(got.cpu(), torch.cat((-x[..., 4:], x[..., :4]), dim=-1))
    assert torch.equal(turned.cpu(), -x[..., 4:])


def test_a_chain_of_held_calls_runs_in_its_reader_as_cpu(lazy_ops_off):
    # The RMSNorm's backward: a held call (rsqrt) then raised to a power, a lazy cast then
    # doubled: each call of the chain held over the one before, one program for all.
    x, w = torch.randn(4, 8), torch.randn(4, 8)
    d, e = x.to("tpu"), w.to("tpu")
    chain = lambda v: torch.sigmoid(torch.exp(-v)).pow(3)  # noqa: E731
    for _ in range(2):  # compiled, and the first call of a spec resolves (``eager_buckets``)
        (chain(d) * e).sum(0).cpu()
    with census(dots=False) as c:
        steps = [-d]
        for f in (torch.exp, torch.sigmoid, lambda v: v.pow(3)):
            steps.append(f(steps[-1]))
        assert all(_lazy(s) for s in steps)
        got = (steps[-1] * e).sum(0)  # (the product is held too: the sum computes it)
    assert c.launch_count == 1, c.launches
    want = (chain(x) * w).sum(0)
    torch.testing.assert_close(got.cpu(), want)
    for s, f in zip(steps, (torch.neg, lambda v: torch.exp(-v),
                            lambda v: torch.sigmoid(torch.exp(-v)), chain)):
        torch.testing.assert_close(s.cpu(), f(x))  # each link read on its own
    lazy_ops_off(False)
    torch.testing.assert_close(got.cpu(), (chain(d) * e).sum(0).cpu(), rtol=1e-6, atol=0)


def test_a_chain_is_held_no_longer_than_its_bound(buckets_off):
    x = torch.randn(4, 4)
    d = x.to("tpu")

    def loop():
        y = d
        for _ in range(20):
            y = y * 2
        return y.cpu()

    loop()
    with census(dots=False) as c:
        got = loop()
    # The ninth and the eighteenth call launch the chain they end (so a loop's program does not
    # grow with the loop); the read computes the last two.
    assert c.launch_count == 3, c.launches
    assert torch.equal(got, x * 2 ** 20)


def test_a_chain_through_cats_is_held_no_longer_than_its_bound(buckets_off):
    # A cat counts as a call of its chain, as do the held calls each of its tensors applies.
    x = torch.randn(4, 4)
    d = x.to("tpu")

    def loop(t):
        for _ in range(6):
            t = torch.cat((t[:2] * 2, t[2:]))
        return t

    loop(d).cpu()
    with census(dots=False) as c:
        got = loop(d).cpu()
    # 12 held calls: the fourth cat ends a chain of 8 (launched), the sixth's read ends the rest.
    assert c.launch_count == 2, c.launches
    assert torch.equal(got, loop(x))


def test_what_is_not_held(monkeypatch):
    d = torch.randn(3, 1, device="tpu")
    monkeypatch.setattr(lazy_casts, "LARGER", 1000)
    # larger than its source, past LARGER bytes: runs where its memory is asked for
    assert not _lazy(d.expand(3, 1000) * 2)
    e, f = torch.randn(3, 1000, device="tpu"), torch.randn(3, 1000, device="tpu")
    assert _lazy(e + e)                       # two tensors holding nothing more than the sum
    # two whose inputs hold more than LARGER bytes beyond their result until its first reader
    assert not _lazy(e + f)
    # one applying more than ``CHAIN`` held calls in all (each of its two inputs applies 4)
    chain = lambda v: v.exp().sigmoid().exp().sigmoid()  # noqa: E731
    assert not _lazy(chain(d) * chain(-d))
    assert _lazy(chain(d) * d)
    # a reduction whose source holds more than LARGER bytes beyond its value (a statistic kept
    # for later would hold all of it)
    assert not _lazy(d.expand(3, 1000).exp().mean(-1))
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        assert not _lazy(d * 2)               # Debug checks each op's result
    y = d * 2
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        assert not _lazy(y)                   # computed when Strict stops being the executor
        assert torch.equal((y + 1).cpu(), d.cpu() * 2 + 1)


def _losses(device: str, steps: int = 3):
    model, step, x, y = seeded_step(CONFIG, device)
    losses = [step(x, y).item() for _ in range(steps)]
    with census(dots=False) as c:
        step(x, y)
    return losses, [p.detach().cpu() for p in model.parameters()], c.launch_count


def test_an_autocast_llama_step_computes_as_before_with_fewer_launches(lazy_ops_off):
    losses, params, launches = _losses("tpu")
    lazy_ops_off(False)
    each, each_params, each_launches = _losses("tpu")
    # Within an ulp or so: a reduction fused with its producer sums in another order.
    torch.testing.assert_close(losses, each, rtol=1e-6, atol=0)
    for p, q in zip(params, each_params):
        torch.testing.assert_close(p, q, rtol=1e-6, atol=1e-7)
    # Per layer: the norms' squares, rsqrt and the backward's multiplies by numbers, the
    # rotary negations, silu (see bench/RESULTS.md, strict4; silu's backward is one program
    # since strict6, its sigmoid and ``1 + ...`` no longer two held calls); and held over held
    # calls (strict6), each norm's backward's power of rsqrt and doubled input; the rotary
    # halves' gradients (slice_backward, held: strict7), 4 a layer; calls with traced numbers
    # (strict7): each norm's ``+ eps`` and its mean's gradient's division, 4 a layer, and 3
    # outside the layers (the last norm's two, the clip's ``+ 1e-6``).
    # And each norm's mean (held, kept: strict7), 2 a layer and the last norm's. And (strict8)
    # calls of two tensors, held, kept: 26 a layer (the norms' and rotary products and sums,
    # the residual sums, the backward's products and gradient sums) and 5 outside the layers.
    # And (strict9) calls reading kept values, which their reader settles: 13 a layer (the
    # rotary products of the kept bfloat16 tables and their sums, the norms' products by their
    # kept rsqrt, silu's gradient) and 3 outside. And (layout1) the rotary sums of q and k, 2 a
    # layer, laid out as CPU lays them now (in the transposed projections' order), held, where
    # their row-major results launched. And (strict11) each cat: the rotary halves', 2 a layer,
    # and the clip's stack of the gradients' norms.
    assert each_launches - launches == 70 * CONFIG.layers + 22, (each_launches, launches)
    cpu, _, _ = _losses("cpu")
    torch.testing.assert_close(torch.tensor(losses), torch.tensor(cpu), atol=2e-3, rtol=2e-3)


def test_a_call_with_traced_numbers_runs_in_its_reader_as_cpu(buckets_off):
    # The norm's ``+ eps`` and the mean's gradient divided by its count: the numbers travel with
    # the held call as device arrays, its reader's program takes them; another number is the
    # same program (traced, not baked in).
    x, w = torch.rand(4, 1) + 0.1, torch.randn(4, 8)
    d, e = x.to("tpu"), w.to("tpu")

    def calls(eps):
        a = d + eps
        b = torch.rsqrt(a)
        q = d.expand(4, 8) / 8.5  # a broadcast, held: smaller than ``LARGER``
        return a, b, q, ((b * e).sum(1), (q * e).sum(1))  # (each product held, in its sum)

    for eps in (0.5, 0.75):  # the first calls of a spec read their inputs whole (eager buckets)
        calls(eps)[3][0].cpu()
    for eps in (1e-5, 1e-5, 0.25, 0.3):  # (a special number, 3.0, is another spec)
        with census(dots=False) as c:
            a, b, q, got = calls(eps)
            assert _lazy(a) and _lazy(b) and _lazy(q)
        assert c.launch_count == 2, c.launches
        assert not c.scalar_transfers
        torch.testing.assert_close(got[0].cpu(), (torch.rsqrt(x + eps) * w).sum(1))
        torch.testing.assert_close(got[1].cpu(), (x.expand(4, 8) / 8.5 * w).sum(1))
        torch.testing.assert_close(a.cpu(), x + eps)  # read on its own
    # a chain over it, then one of many numbers
    y = torch.clamp(torch.sigmoid(d * 0.3), 0.2, 0.6)
    assert _lazy(y)
    torch.testing.assert_close((y + e).cpu(), torch.clamp(torch.sigmoid(x * 0.3), 0.2, 0.6) + w)


def test_a_slices_gradient_is_padded_inside_its_reader(buckets_off):
    # The rotary halves' backward: ``slice_backward`` is a pad its lowering record says may be
    # held; the sum of the halves' gradients pads both inside its own program.
    g = torch.randn(2, 3, 8)
    d = g.to("tpu")
    pad = lambda v, lo, hi: torch.ops.aten.slice_backward(v, [2, 3, 8], -1, lo, hi, 1)  # noqa: E731
    for i in range(3):  # the first call of a spec reads its inputs whole (``eager_buckets``)
        with census(dots=False) as c:
            first, second = pad(-d[..., :4], 4, 8), pad(d[..., 4:], 0, 4)
            lazy = _lazy(first) and _lazy(second)
            got = (first + second).sum(0)
        assert lazy or i == 0
        assert c.launch_count == 1 or i == 0, c.launches
        want = (pad(-g[..., :4], 4, 8) + pad(g[..., 4:], 0, 4)).sum(0)
        assert torch.equal(got.cpu(), want)
    assert torch.equal(first.cpu(), pad(-g[..., :4], 4, 8))
    assert not lazy_casts._kept  # the negation's kept value went with its tensor


def test_rotary_gradients_match_cpu():
    x = torch.randn(2, 2, 6, 8, requires_grad=True)
    cos, sin = torch.randn(6, 8), torch.randn(6, 8)
    from torchtpu.testing.llama import _rotate

    d = x.detach().to("tpu").requires_grad_()
    for _ in range(2):
        d.grad = None
        (_rotate(d, cos.to("tpu"), sin.to("tpu")) ** 2).sum().backward()
    x.grad = None
    (_rotate(x, cos, sin) ** 2).sum().backward()
    torch.testing.assert_close(d.grad.cpu(), x.grad)


def test_a_chain_over_a_kept_value_computes_it_if_it_still_lives(buckets_off):
    # A mean is kept (smaller than its source), ``+ 0.5`` over it is kept too: when that is
    # computed, the mean is computed with it if its tensor lives, so the source goes then.
    x, w = torch.rand(4, 8), torch.randn(4, 1)
    d, e = x.to("tpu"), w.to("tpu")
    for i in range(3):
        m = d.mean(-1, keepdim=True)
        a = m + 0.5
        assert i == 0 or (_lazy(m) and _lazy(a))
        got = (a * e).sum(0)
        assert not _lazy(m) and not _lazy(a) and not lazy_casts._kept
        torch.testing.assert_close(got.cpu(), ((x.mean(-1, keepdim=True) + 0.5) * w).sum(0))
        torch.testing.assert_close(m.cpu(), x.mean(-1, keepdim=True))


def test_held_means_of_two_shapes_over_held_calls_keep_their_own_shapes(buckets_off):
    # Equal specs of two shapes (a mean over a held square) derive their held form apart.
    xs = [torch.rand(4, 6, 8), torch.rand(2, 3, 8)]
    ds = [x.to("tpu") for x in xs]
    for _ in range(3):
        for x, d in zip(xs, ds):
            m = d.pow(2).mean(-1, keepdim=True)
            torch.testing.assert_close((m * d).cpu(), x.pow(2).mean(-1, keepdim=True) * x)


def test_a_call_of_two_tensors_is_computed_once_by_its_first_reader(buckets_off):
    # The norm's ``weight * h``, a gradient's product, a residual sum: held, kept (its first
    # reader returns it too, so later readers read it computed), as CPU computes it.
    x, w = torch.randn(4, 8), torch.randn(8)
    d, e = x.to("tpu"), w.to("tpu")
    for _ in range(2):  # compiled; the first call of a spec reads its inputs whole
        (d * e).sum(0).cpu()
    with census(dots=False) as c:
        p = d * e
        assert _lazy(p)
        s = p.sum(0)
        assert not _lazy(p)  # settled by the sum's program
        t = p.sum(1)
    assert c.launch_count == 2, c.launches  # each sum; the product within the first
    assert torch.equal(p.cpu(), x * w)
    torch.testing.assert_close(s.cpu(), (x * w).sum(0))
    torch.testing.assert_close(t.cpu(), (x * w).sum(1))


def test_a_cat_is_held_and_computed_in_its_reader_as_cpu(buckets_off):
    # The rotary halves' cat (over a held negation and a view), a cat widening bfloat16 to
    # float32, and a cat of one tensor: each held, computed inside the program of the sum
    # reading it (one launch each), as CPU computes it; its inputs written afterwards leave it
    # as it was.
    x, w = torch.randn(2, 3, 8), torch.randn(3, 4)
    d, e = x.to("tpu"), w.to("tpu")

    def cats(d, e):
        return (torch.cat((-d[..., 4:], d[..., :4]), dim=-1),
                torch.cat((e.to(torch.bfloat16), d[0, :, :4]), dim=0), torch.cat((e,)))

    for i in range(3):  # the first calls of a spec read their inputs whole (eager buckets)
        with census(dots=False) as c:
            held = cats(d, e)
            lazy = all(_lazy(t) for t in held)
            sums = [t.sum(-1) for t in held]
        assert (lazy and c.launch_count == 3) or i == 0, c.launches
        # (A sum fused with its producer may sum in another order: an ulp.)
        for got, want in zip(sums, [t.sum(-1) for t in cats(x, w)]):
            torch.testing.assert_close(got.cpu(), want, rtol=1e-6, atol=1e-6)
    held = cats(d, e)
    d.mul_(2)
    e[0] = 7.0
    for got, want in zip(held, cats(x, w)):
        _as_cpu(got.cpu(), want)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_a_narrow_held_value_is_rounded_in_its_reader_as_cpu(dtype, buckets_off):
    # XLA computes a bfloat16 product in float32 and may skip its rounding inside the program
    # that reads it; the value a reader sees must be the product's, rounded (as CPU's).
    x, w = torch.randn(64, 64).to(dtype), torch.randn(64, 64).to(dtype)
    d, e = x.to("tpu"), w.to("tpu")
    for _ in range(3):
        p = d * e  # held
        assert _lazy(p)
        got = torch.cat((p.float(), (-p).float())).cpu()  # the cast and the negation held too
        want = (x * w).float()
        assert torch.equal(got, torch.cat((want, -want)))


@pytest.mark.parametrize("write", ["whole", "a row"])
def test_a_held_calls_inputs_keep_their_values_when_written(write, buckets_off):
    # Every input's buffer is lent while the call is held: an in-place write of its second
    # input gives that one a new value and never donates the buffer the held call reads.
    x, w = torch.randn(4, 8), torch.randn(4, 8)
    for _ in range(2):
        d, e = x.to("tpu"), w.to("tpu")
        p = d * e
        assert _lazy(p)
        if write == "whole":
            e.mul_(3)
            d.mul_(5)
        else:
            e[1].fill_(7.0)
            d[2].fill_(9.0)
        assert torch.equal(p.cpu(), x * w)


def test_held_calls_hold_at_most_larger_bytes_beyond_their_results_in_all(monkeypatch):
    # Each input may die before the held call's first reader comes (a gradient in ``.grad``):
    # the pending ones together hold no more than ``LARGER`` bytes beyond their results.
    e, f, g, h = (torch.randn(3, 1000, device="tpu") for _ in range(4))  # 12,000 bytes each
    monkeypatch.setattr(lazy_casts, "LARGER", 20_000)
    first = e + f  # 12,000 beyond its result
    assert _lazy(first)
    assert not _lazy(g + h)  # 24,000 in all
    assert _lazy(e * e)  # nothing beyond its result
    assert torch.equal(first.cpu(), e.cpu() + f.cpu())  # computed: its inputs are its own again
    second = g + h
    assert _lazy(second)
    del second  # dropped unread: nothing held any more
    assert _lazy(g * h)


def test_a_call_of_kept_values_settles_them_in_its_reader_as_cpu(buckets_off):
    # The rotary ``x * cos`` over its kept bfloat16 table, the norm's ``h * rsqrt``: a held
    # call reading kept values, nested (a sum over such a product), is computed by its reader,
    # whose program returns every kept value it read and settles them (their wide sources go).
    x, w = torch.randn(4, 8), torch.randn(4, 8)
    d, e = x.to("tpu"), w.to("tpu")
    y_want, z_want = x.bfloat16(), w.bfloat16()
    # compiled; the first call of a spec reads its inputs whole (a held one's once its
    # inputs are held: the second time)
    for i in range(4):
        with census(dots=False) as c:
            y, z = d.to(torch.bfloat16), e.to(torch.bfloat16)  # kept casts
            m = d.mean(-1, keepdim=True)  # kept: smaller than its source
            p, q = y * z, e * m  # held over kept values
            r = p + z  # held over them
            assert i < 2 or all(_lazy(v) for v in (y, z, m, p, q, r))
            got = (r.sum(0), q.sum(0))
            assert i < 2 or not any(_lazy(v) for v in (y, z, m, r, q))
        assert i < 2 or (c.launch_count == 2 and not lazy_casts._kept), c.launches
        assert torch.equal(y.cpu(), y_want) and torch.equal(z.cpu(), z_want)
        torch.testing.assert_close(m.cpu(), x.mean(-1, keepdim=True))
        _as_cpu(p.cpu(), y_want * z_want)
        torch.testing.assert_close(got[0].cpu(), (y_want * z_want + z_want).sum(0))
        torch.testing.assert_close(got[1].cpu(), (w * x.mean(-1, keepdim=True)).sum(0))
    # read alone, it settles them too
    y, z = d.to(torch.bfloat16), e.to(torch.bfloat16)
    p = y * z
    assert _lazy(y) and torch.equal(p.cpu(), y_want * z_want)
    assert not _lazy(y) and not _lazy(z) and not lazy_casts._kept


@pytest.mark.parametrize("end", ["read", "dropped"])
def test_a_held_calls_lent_arrays_are_given_back_once_it_is_computed_or_dies(end, buckets_off):
    # A held call lends every array its arguments hold, nested held calls' too, and gives each
    # back when it is computed or dies: a buffer left lent could never be donated again.
    from torchtpu.device import ownership

    x, w, v = torch.randn(4, 8), torch.randn(4, 8), torch.randn(4, 8)
    d, e, f = x.to("tpu"), w.to("tpu"), v.to("tpu")
    torch.add(d * e, f, alpha=0.3).cpu()  # the first calls of a signature run as they come
    ids = {id(t.untyped_storage()._tpu_array) for t in (d, e, f)}
    p = d * e
    q = torch.add(p, f, alpha=0.3)  # held over a held call: its source nests p's arguments
    assert _lazy(p) and _lazy(q)
    # Its traced number's device array too
    number = q.untyped_storage()._tpu_array.lent
    assert len(number) == 4 and id(number[-1]) not in ids
    ids.add(id(number[-1]))
    del number
    assert ids <= set(ownership.lent)
    pending = {id(t.untyped_storage()._tpu_array) for t in (p, q)}
    assert pending <= set(lazy_casts._pending)
    if end == "read":
        assert torch.equal(q.cpu(), torch.add(x * w, v, alpha=0.3))
        assert torch.equal(p.cpu(), x * w)
    else:
        del p, q
    assert not ids & set(ownership.lent)
    assert not pending & set(lazy_casts._pending)  # none left pending, computed or dead


def test_a_held_values_arrays_are_its_sources_in_order():
    a, b, c = (jax.numpy.zeros(2) + i for i in range(3))
    assert held_sources.arrays(((a, (b, 1.0)), c)) == [a, b, c]
    assert held_sources.arrays(a) == [a] and held_sources.arrays(2.0) == []
