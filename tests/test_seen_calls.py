"""Strict's short path for repeated call signatures (``eager/seen_calls.py``): taken when it may
be (also on DeferAndFuse's recorded values), and never for a call whose tensors or constants
need the full path (results equal CPU's)."""

import pytest
import torch

from torchtpu.device import ownership
from torchtpu.eager import seen_calls


@pytest.fixture
def short_paths(monkeypatch):
    """How many calls took the short path (``lookup`` found their arrays)."""
    taken = [0]
    lookup = seen_calls.lookup

    def spy(values, seen, keyed=False):
        key, found = lookup(values, seen, keyed)
        taken[0] += found is not None
        return key, found

    monkeypatch.setattr(seen_calls, "lookup", spy)
    return taken


def test_repeated_call_takes_it(short_paths):
    a, b = torch.randn(3, 5), torch.randn(3, 5)
    x, y = a.to("tpu"), b.to("tpu")
    for _ in range(3):
        torch.testing.assert_close((x + y).cpu(), a + b)
    assert short_paths[0] >= 2
    z = torch.randn(2, 7)
    torch.testing.assert_close((z.to("tpu") + z.to("tpu")).cpu(), z + z)  # a new signature


@pytest.mark.parametrize("base, make", [
    ((4, 4), lambda t: t.t()),       # not contiguous
    ((8, 4), lambda t: t[4:]),       # an offset into a larger storage
    ((4, 4), lambda t: t.view(16)),  # the storage array has another shape
], ids=["transposed", "offset", "reshaped"])
def test_views_take_the_full_path_then_their_own(base, make, short_paths):
    a = torch.randn(base)
    view_cpu = make(a)
    b = torch.randn(view_cpu.shape)
    y = b.to("tpu")
    for _ in range(2):  # the view's signature runs first on whole tensors
        torch.testing.assert_close((view_cpu.contiguous().to("tpu") + y).cpu(), view_cpu + b)
    x, z = make(a.to("tpu")), make((a * 2).to("tpu"))
    before = short_paths[0]
    torch.testing.assert_close((x + y).cpu(), view_cpu + b)
    assert short_paths[0] == before
    # The view's own reads replaced the whole ones: the loop's next calls take it.
    torch.testing.assert_close((x + y).cpu(), view_cpu + b)
    torch.testing.assert_close((z + y).cpu(), make(a * 2) + b)
    assert short_paths[0] == before + 2


def test_a_view_read_another_way_takes_the_full_path(short_paths):
    # Same signature (shape, dtype) as the remembered view, read at another offset or stride.
    a, b = torch.randn(8, 4), torch.randn(4, 4)
    x, y = a.to("tpu"), b.to("tpu")
    for _ in range(2):
        torch.testing.assert_close((x[4:] + y).cpu(), a[4:] + b)
    for view, cpu in ((x[:4], a[:4]), (x[2:6], a[2:6]), (x[:4].t(), a[:4].t()),
                      (x.view(4, 8)[:, :4], a.view(4, 8)[:, :4])):
        before = short_paths[0]
        torch.testing.assert_close((view + y).cpu(), cpu + b)
        assert short_paths[0] == before


def test_one_signature_read_two_ways_takes_it_both_ways(short_paths):
    # (4, 4) with strides (4, 1): its storage array whole, then a view of a (16,) array.
    a, b, f = torch.randn(4, 4), torch.randn(4, 4), torch.randn(16)
    x, y, flat = a.to("tpu"), b.to("tpu"), f.to("tpu")
    for _ in range(2):
        torch.testing.assert_close((x * y).cpu(), a * b)
        torch.testing.assert_close((flat.view(4, 4) * y).cpu(), f.view(4, 4) * b)
    before = short_paths[0]
    for _ in range(2):
        torch.testing.assert_close((x * y).cpu(), a * b)
        torch.testing.assert_close((flat.view(4, 4) * y).cpu(), f.view(4, 4) * b)
    assert short_paths[0] == before + 4


def test_reinterpreted_dtype_takes_the_full_path():
    f = torch.randn(4, 4)
    i, j = torch.randint(0, 100, (4, 4), dtype=torch.int32), torch.ones(4, 4, dtype=torch.int32)
    di, dj = i.to("tpu"), j.to("tpu")
    for _ in range(2):
        torch.testing.assert_close((di + dj).cpu(), i + j)
    bits = f.to("tpu").view(torch.int32)  # int32 tensor over a float32 array
    torch.testing.assert_close((bits + dj).cpu(), f.view(torch.int32) + j)


def test_a_parameter_is_keyed_by_its_geometry(short_paths):
    # A Parameter (a Tensor subclass, keyed past ``lookup``'s exact-type test) is keyed by its
    # shape, strides and offset as a tensor is: its data swapped for a transposed tensor of the
    # same shape is another signature, read through the transpose.
    a, b = torch.randn(4, 4), torch.randn(4, 4)
    p = torch.nn.Parameter(a.to("tpu"), requires_grad=False)
    y = b.to("tpu")
    for _ in range(3):
        torch.testing.assert_close((p * y).cpu(), a * b)
    assert short_paths[0] >= 2
    p.data = b.to("tpu").t()
    for _ in range(2):
        torch.testing.assert_close((p * y).cpu(), b.t() * b)


def test_a_lazy_cast_viewed_as_another_shape_takes_the_full_path(short_paths):
    # A (16,) tensor's lazy cast viewed (4, 4) has the signature of a (4, 4) tensor's cast,
    # and the same remembered ``Cast`` read; only its value's shape tells them apart.
    a, f, w = torch.randn(4, 4), torch.randn(16), torch.randn(4, 4)
    x, flat, y = a.to("tpu"), f.to("tpu"), w.to("tpu")
    bf = torch.bfloat16
    for _ in range(3):
        torch.testing.assert_close((x.to(bf) * y.to(bf)).cpu(), a.to(bf) * w.to(bf))
    taken = short_paths[0]
    assert taken >= 2
    for _ in range(2):
        torch.testing.assert_close((flat.to(bf).view(4, 4) * y.to(bf)).cpu(),
                                   f.to(bf).view(4, 4) * w.to(bf))


def test_lazy_conj_takes_the_full_path(short_paths):
    # mm is one of the ops PyTorch hands a lazy conj bit instead of resolving it first.
    lazy, op = torch.conj, torch.mm
    a = torch.randn(3, 3, dtype=torch.complex64)
    b = torch.randn(3, 3, dtype=torch.complex64)
    x, y = a.to("tpu"), b.to("tpu")
    for _ in range(2):
        op(x, y)
    before = short_paths[0]
    torch.testing.assert_close(op(lazy(x), y).cpu(), op(lazy(a), b))
    assert short_paths[0] == before


def test_constants_of_other_types_or_signs_are_other_calls():
    a = torch.tensor([-5.0, 3.0, -0.0, 2.0])
    x = a.to("tpu")
    for _ in range(2):
        torch.clamp(x, min=0.0)
    # -0.0 == 0.0 as a key: the baked-in +0.0 must not serve it.
    got = torch.clamp(x, min=-0.0).cpu()
    assert torch.equal(torch.signbit(got), torch.signbit(torch.clamp(a, min=-0.0)))
    n = torch.tensor([1, 2, 3])
    d = n.to("tpu")
    for _ in range(2):
        assert (d ** 2).dtype == torch.int64
    # 2 == 2.0 as a key, but an int tensor to a float power is a float tensor.
    got = (d ** 2.0).cpu()
    assert got.dtype == (n ** 2.0).dtype
    torch.testing.assert_close(got, n ** 2.0)


def test_defer_and_fuses_recorded_values_take_it(short_paths):
    # A recorded (pending) result is its storage whole, as a computed one: a loop under
    # DeferAndFuse, where nearly every input is pending, repeats its calls the short way; so
    # does a pending value under a view read as before (the Llama's transposed heads), and not
    # one under another view of the same shape.
    a, b = torch.randn(4, 6), torch.randn(4, 6)
    x, y = a.to("tpu"), b.to("tpu")
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        for _ in range(2):
            s = x * y
            s = s + y
        before = short_paths[0]
        s = x * y
        assert not torch.tpu.is_materialized(s)
        out = s + y
        assert short_paths[0] == before + 2
        t = (x * y).t()
        torch.mul(t, 2.0), torch.mul(t, 2.0)
        before = short_paths[0]
        view = torch.mul((x * y).t(), 2.0)
        assert not torch.tpu.is_materialized(view)
        assert short_paths[0] == before + 2  # x * y and the transposed view's mul
        before = short_paths[0]
        other = torch.mul((x * y).reshape(6, 4), 2.0)  # the view's shape, read another way
        assert short_paths[0] == before + 1
    torch.testing.assert_close(out.cpu(), a * b + b)
    torch.testing.assert_close(view.cpu(), (a * b).t() * 2)
    torch.testing.assert_close(other.cpu(), (a * b).reshape(6, 4) * 2)


def test_capture_keeps_the_full_path(short_paths):
    x = torch.randn(4, 4, device="tpu")
    y = torch.randn(4, 4, device="tpu")
    for _ in range(2):
        x + y
    g = torch.tpu.TPUGraph()
    before = short_paths[0]
    with torch.tpu.graph(g):
        out = x + y
    assert short_paths[0] == before
    x.copy_(torch.ones(4, 4))
    g.replay()
    torch.testing.assert_close(out.cpu(), 1 + y.cpu())


@pytest.mark.parametrize("mode", [torch.tpu.EagerMode.DEFER_NEVER,
                                  torch.tpu.EagerMode.DEFER_AND_FUSE], ids=["strict", "defer"])
def test_another_default_dtype_is_another_call(mode, short_paths):
    # A Python float over an integer tensor, an integer's square root or true division is of
    # the default dtype: each call of one was planned (and repeated) as float32 after
    # ``torch.set_default_dtype(torch.float64)``.
    n = torch.arange(1, 7).reshape(2, 3)
    d = n.to("tpu")

    def calls(t):
        return [t * 2.5, torch.sqrt(t), t / 3, *torch._foreach_mul([t, t], 0.5)]

    try:
        with torch.tpu.set_eager_mode(mode):
            for default in (torch.float32, torch.float32, torch.float64, torch.float64,
                            torch.float32):
                torch.set_default_dtype(default)
                for got, want in zip(calls(d), calls(n), strict=True):
                    assert got.dtype == want.dtype == default
                    torch.testing.assert_close(got.cpu(), want)
    finally:
        torch.set_default_dtype(torch.float32)
    assert short_paths[0] >= (4 if mode is torch.tpu.EagerMode.DEFER_NEVER else 0)


def test_calls_with_traced_numbers_take_it_and_compute_as_cpu(short_paths):
    a = torch.randn(3, 5)
    x = a.to("tpu")
    for number in (0.3, 0.3, 0.3, torch.tensor(0.7), torch.tensor(-1.5), 7, 7):
        torch.testing.assert_close((x * number).cpu(), a * number)
    assert short_paths[0] >= 4  # 0.3 twice, the second CPU scalar tensor's value, 7 once


def test_a_float_zero_keeps_its_sign_whichever_came_first(short_paths):
    # 0.0 is baked into its program (a signature tells it from -0.0: it repeats), -0.0 is
    # traced (a traced zero takes the full path).
    a = torch.randn(3, 5)
    x = a.to("tpu")
    for number in (-0.0, -0.0, 0.0, -0.0, 0.0):
        got = (x * number).cpu()
        assert torch.equal(torch.signbit(got), torch.signbit(a * number))
    assert short_paths[0] >= 1


def test_a_remembered_call_runs_in_the_mode_current_at_each_call(short_paths, monkeypatch):
    # Strict launches a remembered call's program directly (``Strict.launcher``); under another
    # mode the same call runs that mode's way: Debug checks its result, DeferAndFuse records it.
    monkeypatch.setenv("TORCHTPU_DEBUG_NANS", "1")
    t = torch.tensor([1.0, 0.0], device="tpu")
    for _ in range(3):
        t / t  # remembered, then launched directly (a NaN Strict does not look for)
    before = short_paths[0]
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER_AND_LAUNCH_BLOCKING):
        with pytest.raises(FloatingPointError, match="aten.div"):
            t / t
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
        u = t / t
        v = u + 1
        assert not ownership.is_materialized(u)  # recorded, not run
        torch.testing.assert_close(v.cpu(), torch.tensor([2.0, float("nan")]), equal_nan=True)
    # (at least: earlier tests in the process may have remembered these calls too)
    assert short_paths[0] >= before + 2
    torch.testing.assert_close((t / t).cpu(), torch.tensor([1.0, float("nan")]), equal_nan=True)


def test_a_constant_zero_keeps_its_sign(short_paths):
    """A signature tells 0.0 from -0.0 (a constant the program bakes in)."""
    a = torch.tensor([1.0, float("nan"), -2.0])
    x = a.to("tpu")
    for nan in (0.0, 0.0, -0.0, -0.0, 0.0):
        got, want = torch.nan_to_num(x, nan=nan).cpu(), torch.nan_to_num(a, nan=nan)
        assert torch.equal(got, want) and torch.equal(torch.signbit(got), torch.signbit(want))
    assert short_paths[0] >= 2


@pytest.mark.parametrize("mode", [torch.tpu.EagerMode.DEFER_NEVER,
                                  torch.tpu.EagerMode.DEFER_AND_FUSE], ids=["strict", "defer"])
def test_attention_without_dropout_takes_it(mode, monkeypatch):
    """SDPA draws no key at dropout 0.0 and lays its output out in its query's order: its
    forward and backward repeat, equal to CPU's."""
    import torch.nn.functional as F

    from torchtpu.eager import dispatch

    repeated = []
    run_seen = dispatch.run_seen

    def spy(lowering, *args, **kwargs):
        repeated.append(str(lowering.op))
        return run_seen(lowering, *args, **kwargs)

    monkeypatch.setattr(dispatch, "run_seen", spy)
    # DeferAndFuse may replay a repeat from its recording instead (``defer_replay``'s calls of
    # several nodes: SDPA's forward and backward): a repeat too.
    from torchtpu.device.hooks import MISS
    from torchtpu.eager import defer_replay

    repeat = defer_replay.Replay.repeat

    def replayed(self, op, args, kwargs):
        out = repeat(self, op, args, kwargs)
        if out is not MISS:
            repeated.append(str(op))
        return out

    monkeypatch.setattr(defer_replay.Replay, "repeat", replayed)

    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, 2, 8, 16, generator=g) for _ in range(3))

    def step(device):
        leaves = [t.to(device).detach().requires_grad_() for t in (q, k, v)]
        with torch.tpu.set_eager_mode(mode):
            out = F.scaled_dot_product_attention(*leaves, is_causal=True, dropout_p=0.0)
            (out * out).sum().backward()
            return [t.cpu() for t in (out, *(x.grad for x in leaves))]

    want = step("cpu")
    for _ in range(4):
        for got, w in zip(step("tpu"), want):
            torch.testing.assert_close(got, w, rtol=1e-4, atol=1e-5)
            assert got.stride() == w.stride()
    attention = [op for op in repeated if "attention" in op]
    # Forward and backward, from the third step: the gradient backward reads is held (a sum
    # of held products) from the second, whose first call of that form reads it computed.
    assert len(attention) >= 2 * 2
    assert any(not op.endswith("backward.default") for op in attention)


def _reads_tried(monkeypatch) -> tuple:
    """The reads each remembered call tries (a list, filled as calls run), and a (3, 6)
    signature's operands: two (3, 6) tensors and an (18,) one, on CPU and on tpu."""
    tries, arrays = [], seen_calls.arrays
    monkeypatch.setattr(seen_calls, "arrays",
                        lambda values, reads: tries.append(reads) or arrays(values, reads))
    cpu = torch.randn(3, 6), torch.randn(3, 6), torch.randn(18)
    return tries, cpu, tuple(t.to("tpu") for t in cpu)


def test_the_read_found_next_last_time_is_tried_first_and_checked(monkeypatch):
    # One signature (3, 6) read two ways in turn: its storage array whole, and a view of an (18,)
    # array. Each call's read is then the one found after the last one: one try a call.
    tries, (a, b, f), (x, y, flat) = _reads_tried(monkeypatch)
    for _ in range(3):
        torch.testing.assert_close(torch.sub(x, y).cpu(), a - b)
        torch.testing.assert_close(torch.sub(flat.view(3, 6), y).cpu(), f.view(3, 6) - b)
    before = len(tries)
    for _ in range(2):
        torch.testing.assert_close(torch.sub(x, y).cpu(), a - b)
        torch.testing.assert_close(torch.sub(flat.view(3, 6), y).cpu(), f.view(3, 6) - b)
    assert len(tries) == before + 4
    # The whole read twice in a row: the first try (the view's read, found after it last time)
    # does not fit the second call, which then finds its own, as CPU computes it.
    for _ in range(2):
        torch.testing.assert_close(torch.sub(x, y).cpu(), a - b)
    torch.testing.assert_close(torch.sub(flat.view(3, 6), y).cpu(), f.view(3, 6) - b)


@pytest.mark.parametrize("default", [torch.float32, torch.float64], ids=["f32", "f64"])
def test_a_number_promotes_a_0_dim_tensor_by_its_kind_only(default):
    # A Python number beside a tensor is a wrapped number: it promotes by its kind (int,
    # float) alone. Given to the meta kernel as a 0-dim tensor of the default dtype, it won
    # against 0-dim tensors: a bfloat16 loss * 2.5 was float32, an int8 count + 3 int64, and
    # under a float64 default a float32 loss * 2.5 float64 (CPU keeps each tensor's dtype).
    torch.set_default_dtype(default)
    try:
        for mode in (torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_AND_FUSE):
            with torch.tpu.set_eager_mode(mode):
                for dtype, number in ((torch.bfloat16, 2.5), (torch.float16, 2.5),
                                      (torch.float32, 2.5), (torch.int8, 3), (torch.int32, 3),
                                      (torch.int32, 2.5), (torch.uint8, 7)):
                    x = torch.tensor(2, dtype=dtype)
                    for f in (lambda t, n=number: t * n, lambda t, n=number: t + n,
                              lambda t, n=number: n - t, lambda t: t / 2.5):
                        want, got = f(x), f(x.to("tpu")).cpu()
                        assert got.dtype == want.dtype, (dtype, number, got.dtype, want.dtype)
                        assert torch.equal(got, want)
    finally:
        torch.set_default_dtype(torch.float32)


def test_the_call_before_a_site_picks_its_read(monkeypatch):
    # One signature (3, 6) called at three sites a round, read whole, through a view of an
    # (18,) array, then whole again, each after another op: the call found before each site
    # tells its read (the signature's own last read does not: after a whole read comes a view
    # at one site and a whole read at the next). One try a call from the third round.
    tries, (a, b, f), (x, y, flat) = _reads_tried(monkeypatch)

    def round_():
        got = [torch.neg(x), torch.sub(x, y), torch.mul(x, y), torch.sub(flat.view(3, 6), y),
               torch.add(x, y), torch.sub(x, y)]
        for g, w in zip(got, [-a, a - b, a * b, f.view(3, 6) - b, a + b, a - b]):
            torch.testing.assert_close(g.cpu(), w)

    for _ in range(3):
        round_()
    before = len(tries)
    round_()
    assert len(tries) == before + 6
