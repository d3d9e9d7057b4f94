"""DeferAndFuse's per-op recording (``eager/defer.py``'s ``Recorder.record``) and the seen-calls
short path's result wrapping: the steps every deferred op takes, kept few (signature numbers
carried by pending values, one plain result wrapped without walking its description), with
results equal to CPU's."""

import pytest
import torch

from torchtpu.eager import defer, results

DEFER = torch.tpu.EagerMode.DEFER_AND_FUSE


@pytest.fixture
def signed(monkeypatch):
    """How many recorded arguments were given a signature (``defer._signature``)."""
    count = [0]
    sign = defer._signature

    def spy(x):
        count[0] += 1
        return sign(x)

    monkeypatch.setattr(defer, "_signature", spy)
    return count


def test_pending_arguments_carry_their_signature(signed):
    a, b = torch.randn(6, 5), torch.randn(6, 5)
    x, y = a.to("tpu"), b.to("tpu")
    with torch.tpu.set_eager_mode(DEFER):
        s = x * y          # two inputs from outside the recording: signed
        before = signed[0]
        t = s + s          # both arguments pending: their signature came with them
        u = torch.sin(t) * s
        assert signed[0] == before
        got = (u - t).cpu()
    want = torch.sin((a * b) + (a * b)) * (a * b) - ((a * b) + (a * b))
    torch.testing.assert_close(got, want)


def test_pending_and_computed_arrays_share_a_key():
    # One signature number per (shape, dtype, weak type): a call recorded on a pending value and
    # on a computed array of the same shape finds one result-shape entry.
    a = torch.randn(3, 7)
    x = a.to("tpu")
    with torch.tpu.set_eager_mode(DEFER):
        torch.cos(x).cpu()  # a computed array
        p = x * 1.5
        shapes = len(defer.RECORDER._shapes)
        c = torch.cos(p)   # the same call on a pending value of the same shape
        assert len(defer.RECORDER._shapes) == shapes
        torch.testing.assert_close(c.cpu(), torch.cos(a * 1.5))


def test_seen_call_wraps_its_one_result_directly(monkeypatch):
    walked = [0]
    wrap = results.wrapped

    def spy(arrays, d, op=None):
        walked[0] += 1
        return wrap(arrays, d, op)

    monkeypatch.setattr(results, "wrapped", spy)
    a, b = torch.randn(4, 3), torch.randn(3, 3) / 3
    x, y = a.to("tpu"), b.to("tpu")
    for mode in (torch.tpu.EagerMode.DEFER_NEVER, DEFER):
        with torch.tpu.set_eager_mode(mode):
            # A product: Strict may hold a pointwise call of two tensors (``lazy_casts``),
            # which its first reader computes; a product it launches.
            z = x @ y
            before = walked[0]
            for _ in range(3):
                z = z @ y  # a seen signature: the short path
            assert walked[0] == before
            torch.testing.assert_close(z.cpu(), a @ b @ b @ b @ b)
    # Several results still go through the description (and come back as CPU's).
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(2):
            values, indices = torch.max(x, dim=1)
        want = torch.max(a, dim=1)
        torch.testing.assert_close(values.cpu(), want.values)
        torch.testing.assert_close(indices.cpu(), want.indices)


def test_backward_on_the_autograd_thread_is_no_other_thread(monkeypatch, recwarn):
    # PyTorch runs a tpu backward on its own thread: its ops are the owner's step, not another
    # thread's (whose ops would be warned about, once).
    monkeypatch.setattr(defer.RECORDER, "_warned_threads", False)
    m = torch.nn.Linear(4, 3)
    d = torch.nn.Linear(4, 3).to("tpu")
    d.load_state_dict(m.state_dict())
    x = torch.randn(2, 4)
    with torch.tpu.set_eager_mode(DEFER):
        for _ in range(2):
            d(x.to("tpu")).pow(2).sum().backward()
        grad = d.weight.grad.cpu()
    m(x).pow(2).sum().backward()
    m(x).pow(2).sum().backward()
    torch.testing.assert_close(grad, m.weight.grad)
    assert not defer.RECORDER._warned_threads
    assert not [w for w in recwarn if "one recording of the process" in str(w.message)]


def test_a_pending_tensor_read_whole_takes_no_generic_read(monkeypatch):
    # Every tensor of a deferred step holds a recorded value: read whole (an in-place foreach
    # call's every list element, a planned call's operands), it is taken as it is, without the
    # generic path's storage and geometry steps (``tensors._parts``); a view still takes them.
    from torchtpu.device import tensors

    generic = [0]
    parts = tensors._parts

    def spy(t):
        generic[0] += 1
        return parts(t)

    a = torch.randn(4, 6)
    with torch.tpu.set_eager_mode(DEFER):
        p = a.to("tpu") * 2.0
        monkeypatch.setattr(tensors, "_parts", spy)
        array, geometry = tensors.read_parts(p)
        assert array is p.untyped_storage()._tpu_array and geometry is None
        assert generic[0] == 0
        tensors.read_parts(p.t())  # a view: the generic path
        assert generic[0] == 1
        torch.testing.assert_close(p.cpu(), a * 2.0)
        # Run: the same read gives its array.
        before = generic[0]
        array, geometry = tensors.read_parts(p)
        assert type(array) is not defer.Pending and geometry is None and generic[0] == before
        assert p.untyped_storage()._tpu_array is array


def test_an_in_place_list_call_makes_its_call_key_once(monkeypatch):
    # An in-place foreach call (AdamW's, clip_grad_norm_'s: lists of a tensor a parameter) is
    # checked by its own meta kernel and planned by its functional twin's: one call key for both.
    from torchtpu.eager import meta

    keyed = [0]
    call_key = meta.call_key

    def spy(*args, **kwargs):
        keyed[0] += 1
        return call_key(*args, **kwargs)

    a = [torch.randn(3, 4) for _ in range(5)]
    b = [torch.randn(3, 4) for _ in range(5)]
    xs, ys = [t.to("tpu") for t in a], [t.to("tpu") for t in b]
    # ys of another layout: another call key (an operand's layout is in it) and ``seen_lists``
    # signature (the full path), made once
    laid = [y.t().contiguous().t() for y in ys]
    with torch.tpu.set_eager_mode(DEFER):
        torch._foreach_add_(xs, ys, alpha=0.3)  # planned and checked, remembered
        monkeypatch.setattr(meta, "call_key", spy)
        torch._foreach_add_(xs, laid, alpha=0.7)
        assert keyed[0] == 1
        torch._foreach_add_(xs, ys, alpha=0.2)  # ``seen_lists``' short path: none
        assert keyed[0] == 1
        got = [x.cpu() for x in xs]
    torch.testing.assert_close(got, [x + 1.2 * y for x, y in zip(a, b)])


def test_a_recorded_cast_of_a_whole_value_takes_the_short_path(monkeypatch):
    # Autocast's casts of a recorded step (both ways; backward's name the device and layout):
    # a tensor that is its storage's whole value is recorded converted, without
    # ``read_converted``; a view, a lazily negated view and a same-dtype copy keep the general
    # path, and every result has CPU's values and strides.
    from torchtpu.device import kernels

    general = [0]
    converted = kernels.read_converted

    def spy(*args, **kwargs):
        general[0] += 1
        return converted(*args, **kwargs)

    monkeypatch.setattr(kernels, "read_converted", spy)
    a = torch.randn(5, 4)
    w = torch.randn(4, 3, requires_grad=True)
    dw = w.detach().to("tpu").requires_grad_()
    with torch.tpu.set_eager_mode(DEFER):
        p = a.to("tpu") * 2.0          # a pending value
        down = p.to(torch.bfloat16)
        up = down.to(torch.float32)
        wide = torch.ops.aten._to_copy(up, dtype=torch.float64, layout=torch.strided,
                                       device=up.device)  # as backward casts
        assert general[0] == 0
        got = [t.cpu() for t in (down, up, wide)]
        with torch.autocast("tpu", dtype=torch.bfloat16):
            y = p @ dw
        y.float().sum().backward()
        grad = dw.grad.cpu()
        shortcut = general[0]
        view = p.t().to(torch.bfloat16)          # a view: read through its geometry
        negated = torch._neg_view(p.t()).to(torch.bfloat16)  # a lazy negation bit
        same = p.to(torch.float32, copy=True)
        assert general[0] > shortcut
        others = [(t.cpu(), t.stride()) for t in (view, negated, same)]
    want = [(a * 2.0).to(torch.bfloat16)]
    want += [want[0].float(), want[0].float().double()]
    for g, w_ in zip(got, want, strict=True):
        assert g.dtype == w_.dtype
        torch.testing.assert_close(g, w_)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        yc = (a * 2.0) @ w
    yc.float().sum().backward()
    torch.testing.assert_close(grad, w.grad)
    p_cpu = a * 2.0
    for (g, stride), w_ in zip(others, (p_cpu.t().to(torch.bfloat16),
                                       torch._neg_view(p_cpu.t()).to(torch.bfloat16),
                                       p_cpu.clone()), strict=True):
        torch.testing.assert_close(g, w_)
        assert stride == w_.stride()


@pytest.mark.parametrize("inside", ["DEFAULT", "HIGHEST"])
def test_products_run_at_the_precision_they_were_recorded_under(inside, monkeypatch):
    # A program computes at the precision current where it is traced: a product recorded
    # inside ``torch.tpu.precision`` was flushed after the block, at the precision outside it
    # (on a TPU, DEFAULT's bfloat16 passes where HIGHEST was asked for).
    programs = []
    run = defer.launch.run

    def spy(label, fn, args, *rest, **kwargs):
        if str(label).startswith("defer_and_fuse"):
            programs.append(fn.lower(*args).as_text())
        return run(label, fn, args, *rest, **kwargs)

    monkeypatch.setattr(defer.launch, "run", spy)
    a, b = torch.randn(8, 8), torch.randn(8, 8)
    x, w = a.to("tpu"), b.to("tpu")
    outside = "HIGHEST" if inside == "DEFAULT" else "DEFAULT"
    with torch.tpu.precision(getattr(torch.tpu.Precision, outside)):
        with torch.tpu.set_eager_mode(DEFER):
            with torch.tpu.precision(getattr(torch.tpu.Precision, inside)):
                y = torch.sin(x @ w)
            z = (x @ w).cpu()
            got = y.cpu()
    products = [line for text in programs for line in text.splitlines() if "dot_general" in line]
    assert len(products) == 2
    assert ("HIGHEST" in products[0]) == (inside == "HIGHEST")
    assert ("HIGHEST" in products[1]) == (outside == "HIGHEST")
    torch.testing.assert_close(got, torch.sin(a @ b))
    torch.testing.assert_close(z, a @ b)
