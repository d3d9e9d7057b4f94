"""The short path of in-place calls over tensor lists (``eager/seen_lists.py``): an optimizer's
foreach calls take it from their second step, in Strict and in DeferAndFuse, and a call whose
tensors or numbers need the full path never does (results equal CPU's, signs of zeros too)."""

import pytest
import torch

from torchtpu.eager import defer_replay, dispatch

MODES = [torch.tpu.EagerMode.DEFER_NEVER, torch.tpu.EagerMode.DEFER_AND_FUSE]


@pytest.fixture
def short_paths(monkeypatch):
    """How many in-place list calls took the short path."""
    taken = [0]
    repeat = dispatch._repeat_in_place

    def spy(*args):
        taken[0] += 1
        return repeat(*args)

    monkeypatch.setattr(dispatch, "_repeat_in_place", spy)
    return taken


def _adam_like(ps, ms, vs, gs, i):
    """AdamW's and clipping's calls, with numbers that change every step."""
    torch._foreach_mul_(ps, 1 - 1e-3 * (i + 1))
    torch._foreach_lerp_(ms, gs, 0.1)
    torch._foreach_mul_(vs, 0.999)
    torch._foreach_addcmul_(vs, gs, gs, 0.001)
    d = torch._foreach_sqrt(vs)
    torch._foreach_div_(d, [1.5 + i * 0.25 + j for j in range(len(ps))])
    torch._foreach_add_(d, 1e-8)
    torch._foreach_addcdiv_(ps, ms, d, [-0.01 * (i + 1) - j * 1e-3 for j in range(len(ps))])
    torch._foreach_add_(ps, gs, alpha=0.5)


def _lists(device):
    g = torch.Generator().manual_seed(0)
    shapes = [(4, 3), (5,), (2, 2, 2)]
    ps, ms, vs, gs = ([torch.randn(s, generator=g) for s in shapes] for _ in range(4))
    vs = [v.abs() for v in vs]  # second moments
    return [[t.to(device) for t in ts] for ts in (ps, ms, vs, gs)]


@pytest.mark.parametrize("mode", MODES, ids=["strict", "defer"])
def test_optimizer_calls_take_it_and_equal_cpu(mode, short_paths):
    ref, got = _lists("cpu"), _lists("tpu")
    replayed = defer_replay.REPLAY.lists
    with torch.tpu.set_eager_mode(mode):
        for i in range(3):
            _adam_like(*ref, i)
            _adam_like(*got, i)
            for r, t in zip(ref, got):
                for a, b in zip(r, t):
                    torch.testing.assert_close(b.cpu(), a, rtol=1e-6, atol=1e-6)
    # the 8 in-place calls of steps 2 and 3; DeferAndFuse's replay of a repeated list call
    # (eager/defer_replay_lists.py) is shorter still and takes them from step 3
    assert short_paths[0] + defer_replay.REPLAY.lists - replayed >= 2 * 8


def test_a_zero_keeps_its_sign(short_paths):
    """0.0 is baked into its program, -0.0 is traced: one signature would compute -0.0 as 0.0."""
    x = torch.tensor([1.0, -2.0, 3.0])
    ts = [x.to("tpu")]
    for scale in (0.0, -0.0, 0.0, -0.0):
        ts[0].copy_(x)
        torch._foreach_mul_(ts, scale)
        want = x * scale
        assert torch.equal(ts[0].cpu(), want)
        assert torch.equal(torch.signbit(ts[0].cpu()), torch.signbit(want))
    assert short_paths[0] >= 2


@pytest.mark.parametrize("make", [
    lambda base: base[:4],           # one geometry, a larger storage
    lambda base: base.view(2, 4)[0],  # the same
], ids=["slice", "row"])
def test_a_view_of_a_seen_geometry_takes_the_full_path(make, short_paths):
    """A target of the remembered geometry that is not its storage whole: written through the
    view, the rest of its storage kept."""
    for _ in range(2):
        whole = [torch.ones(4, device="tpu")]
        torch._foreach_mul_(whole, 3.0)
    taken = short_paths[0]
    base = torch.arange(8.0)
    on_tpu = base.to("tpu")
    torch._foreach_mul_([make(on_tpu)], 3.0)
    torch._foreach_mul_([make(base)], 3.0)
    assert torch.equal(on_tpu.cpu(), base)
    assert short_paths[0] == taken


def test_a_transposed_input_is_read_as_a_view(short_paths):
    """A remembered call whose list holds a transposed tensor repeats nothing: its array is not
    the tensor's value in order."""
    z = torch.arange(16.0).view(4, 4)
    zt = z.to("tpu")
    ref, got = [torch.zeros(4, 4)], [torch.zeros(4, 4, device="tpu")]
    for _ in range(3):
        torch._foreach_add_(ref, [z.t()])
        torch._foreach_add_(got, [zt.t()])
    assert torch.equal(got[0].cpu(), ref[0])
    assert short_paths[0] == 0


@pytest.mark.parametrize("mode", MODES, ids=["strict", "defer"])
def test_a_list_read_as_it_is_written(mode, short_paths):
    ref, got = [torch.arange(3.0)], [torch.arange(3.0, device="tpu")]
    with torch.tpu.set_eager_mode(mode):
        for _ in range(3):
            torch._foreach_addcmul_(ref, ref, ref, 0.5)
            torch._foreach_addcmul_(got, got, got, 0.5)
        assert torch.equal(got[0].cpu(), ref[0])
    assert short_paths[0] >= 2


@pytest.fixture
def list_reads(monkeypatch):
    """How many functional calls over tensor lists found their arrays on the short path."""
    from torchtpu.eager import seen_lists

    taken = [0]
    arrays = seen_lists.arrays

    def spy(values, reads):
        found = arrays(values, reads)
        taken[0] += found is not None
        return found

    monkeypatch.setattr(seen_lists, "arrays", spy)
    return taken


@pytest.mark.parametrize("mode", MODES, ids=["strict", "defer"])
def test_functional_list_calls_take_it(mode, list_reads):
    a = [torch.randn(3, 4), torch.randn(5)]
    xs = [t.to("tpu") for t in a]
    replayed = defer_replay.REPLAY.lists
    with torch.tpu.set_eager_mode(mode):
        for scale in (0.5, 2.0, 3.0):
            norms = torch._foreach_norm(xs, 2.0)
            roots = torch._foreach_sqrt([(t.abs() * scale).to("tpu") for t in a])
            joined = torch.cat(xs[:1] * 2)
            for n, r, t in zip(norms, roots, a):
                torch.testing.assert_close(n.cpu(), torch.linalg.vector_norm(t))
                torch.testing.assert_close(r.cpu(), (t.abs() * scale).sqrt())
            torch.testing.assert_close(joined.cpu(), torch.cat([a[0], a[0]]))
    # norm, sqrt and cat of the second and third rounds (or DeferAndFuse's replay of them)
    assert list_reads[0] + defer_replay.REPLAY.lists - replayed >= 2 * 3


def test_clippings_calls_over_lazy_casts_and_covering_views_take_it(short_paths, list_reads,
                                                                     buckets_off):
    """Clipping's calls over a step's gradients: float32 casts of bfloat16 products, held
    lazily (``lazy_casts``), and a norm weight's, a keepdim sum viewed flat (a view covering its
    storage's array): the norms, their stack and the in-place scaling repeat from their second
    round, the casts read through their sources, values as CPU's."""
    g = torch.Generator().manual_seed(0)
    ref = [(torch.randn(4, 6, generator=g), torch.randn(6, 5, generator=g)) for _ in range(2)]
    rows = torch.randn(2, 3, 5, generator=g)
    taken, read = short_paths[0], list_reads[0]
    for i in range(3):
        scale = 0.5 + i

        def grads(device, scale=scale):
            products = [(a * scale).to(device, torch.bfloat16) @ b.to(device, torch.bfloat16)
                        for a, b in ref]
            # the cast back to float32, as autocast's backward casts a weight's gradient
            wide = [p.to(torch.float32) for p in products]
            return [*wide, (rows * scale).to(device).sum((0, 1), keepdim=True).view(5)]

        want, got = grads("cpu"), grads("tpu")
        held = got[0].untyped_storage()._tpu_array
        assert type(held).__name__ == "Converted" and held.source is not None
        for gs in (want, got):
            norms = torch._foreach_norm(gs, 2.0)
            total = torch.linalg.vector_norm(torch.stack(norms), 2.0)
            torch._foreach_mul_(gs, torch.clamp(1.0 / (total + 1e-6), max=1.0))
        for w, t in zip(want, got):
            torch.testing.assert_close(t.cpu(), w, rtol=1e-6, atol=1e-6)
    assert short_paths[0] - taken >= 2          # the scaling, rounds 2 and 3
    assert list_reads[0] - read >= 2 * 2        # the norms and their stack, rounds 2 and 3


def test_a_written_call_reads_no_partial_view_beside_its_target(short_paths):
    """An in-place call remembered reading a transposed view of another tensor is never
    repeated over a view of its own target: the two overlap in part, which CPU refuses."""
    a = torch.arange(16.0).view(4, 4)
    t = a.to("tpu")
    other = torch.ones(4, 4, device="tpu")
    for _ in range(3):
        torch._foreach_add_([t], [other.t()])
    with pytest.raises(RuntimeError) as cpu:
        torch._foreach_add_([a], [a.t()])
    with pytest.raises(type(cpu.value)):
        torch._foreach_add_([t], [t.t()])
    assert short_paths[0] == 0


def test_a_target_read_through_a_covering_view_then_whole_takes_the_full_path(short_paths):
    """Remembered reading a (1, 1, 5) array viewed flat (a keepdim sum's, a norm weight's
    gradient), the call repeats over another such view and not over a tensor that is its own
    array whole (the program read the view's array shape): values as CPU's either way."""
    rows = torch.randn(1, 1, 5)
    took = []
    for flat in (False, False, False, True):
        want, got = rows.clone().view(5), rows.to("tpu").view(5)
        if flat:  # the same signature (shape, strides, offset), its storage's array whole
            want, got = want.clone(), rows.view(5).to("tpu")
            assert got.untyped_storage()._tpu_array.shape == (5,)
        taken = short_paths[0]
        torch._foreach_mul_([got], 0.5)
        took.append(short_paths[0] - taken)
        torch._foreach_mul_([want], 0.5)
        assert torch.equal(got.cpu(), want)
    assert took == [0, 1, 1, 0]
