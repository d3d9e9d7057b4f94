"""View semantics on tpu equal PyTorch's: aliasing, writes through views, _base, _version, copies.

Each test runs the same steps on a CPU tensor and on a tpu copy and compares every tensor the
steps touched, so a write that misses the base, or lands in the wrong place, shows as a mismatch.
"""

import warnings

import pytest
import torch

from torchtpu.testing.compare import assert_same, to_device


def _same_steps(fn, *args):
    """Run fn on CPU args and on tpu copies; compare what it returns."""
    expected = fn(*[a.clone() for a in args])
    actual = fn(*to_device(args))
    assert_same(actual, expected)
    return actual


def test_select_view_aliases_base():
    def fn(a):
        b = a[1]
        b.add_(1)
        return a, b

    a, b = _same_steps(fn, torch.randn(3, 4))
    assert b._base is a
    assert b.untyped_storage().data_ptr() == a.untyped_storage().data_ptr()


def test_write_through_stepped_slices():
    def fn(a):
        a[::2, 1::3].mul_(-1)
        a[1, ::2] = 5.0
        a[:, 2:].copy_(torch.ones(4, 3, device=a.device) * 2)
        return a

    _same_steps(fn, torch.randn(4, 5))


def test_transpose_and_t_in_place():
    def fn(a):
        t = a.t()
        t.add_(torch.arange(12.0, device=a.device).reshape(4, 3))
        a.transpose(0, 1)[1].mul_(3)
        return a, t, t.contiguous(), t.is_contiguous(), t.contiguous().is_contiguous()

    _same_steps(fn, torch.randn(3, 4))


def test_diagonal_as_strided_unfold():
    def fn(a):
        a.diagonal().fill_(7.0)
        a.diagonal(1).add_(1)
        s = a.as_strided((2, 2), (1, 4), 1)
        s.mul_(10)
        u = a.view(-1).unfold(0, 4, 3)
        return a, s, u, a.diagonal(-1).clone()

    _same_steps(fn, torch.randn(4, 4))


def test_dtype_reinterpreting_view():
    def fn(a):
        bits = a.view(torch.int32)
        sign = torch.tensor(-(1 << 31), dtype=torch.int32, device=a.device)
        bits.bitwise_xor_(sign)  # flips the float's sign bit
        halves = a.view(torch.int16)
        return a, bits, halves

    _same_steps(fn, torch.randn(2, 3))


def test_out_into_a_view():
    def fn(a, b):
        torch.add(b, b, out=a[1:3, 1:3])
        torch.cat([b[0], b[1]], out=a[0])
        return a

    _same_steps(fn, torch.zeros(4, 4), torch.randn(2, 2))


def test_base_and_version_like_cpu():
    for device in ("cpu", "tpu"):
        a = torch.zeros(3, 3, device=device)
        v = a[:, 1]
        assert a._base is None and v._base is a
        assert v[1:]._base is a  # views of views point at the root
        start = a._version
        v.add_(1)
        a[0, 0] = 2.0
        assert a._version == v._version == start + 2
        assert a.clone()._base is None


def test_resize_and_zero_size():
    def fn(a):
        empty = a[:, :0]
        b = a.new_empty(0)
        b.resize_(2, 3)
        b.copy_(a[:2, :3])
        c = torch.empty(0, 4, device=a.device)
        return empty.clone(), b, torch.cat([c, a[:1]])

    _same_steps(fn, torch.randn(3, 4))


def test_resize_keeps_data():
    def fn(a):
        a.resize_(2, 6)
        return a

    _same_steps(fn, torch.arange(12.0).reshape(3, 4))


@pytest.mark.parametrize("dtype", [torch.int32, torch.bfloat16, torch.bool])
def test_copy_between_dtypes_and_devices(dtype):
    src = torch.randn(3, 4) * 4
    expected = src.to(dtype)
    x = src.to("tpu")
    y = torch.empty(3, 4, dtype=dtype, device="tpu")
    y.copy_(x)  # tpu float32 -> tpu dtype
    assert_same(y, expected)
    back = torch.empty(3, 4, dtype=dtype)
    back.copy_(y)  # tpu -> CPU
    assert_same(back, expected)
    z = torch.zeros(4, 3, dtype=dtype, device="tpu")
    z.t().copy_(expected)  # CPU -> a tpu view
    assert_same(z, expected.t())


def test_lazy_conjugate_and_negative_views_read_and_write_like_cpu():
    torch.manual_seed(0)
    v = torch.linalg.eig(torch.randn(4, 4))[1]
    g = torch.randn(4, 4, dtype=torch.complex64)
    # mm receives the conjugated view itself: the device must apply the bit.
    torch.testing.assert_close((v.to("tpu").mH @ g.to("tpu")).cpu(), v.mH @ g)
    z = torch.randn(3, dtype=torch.complex64)
    dev, host = z.to("tpu"), z.clone()
    dev.conj().copy_(torch.full((3,), 1 + 2j).to("tpu"))
    host.conj().copy_(torch.full((3,), 1 + 2j))
    torch.testing.assert_close(dev.cpu(), host)
    neg = torch._neg_view(torch.arange(3.0).to("tpu"))
    torch.testing.assert_close((neg + 1).cpu(), torch._neg_view(torch.arange(3.0)) + 1)


@pytest.mark.parametrize("mode", ["DEFER_NEVER", "DEFER_AND_FUSE"])
def test_a_view_operand_is_read_inside_the_op_program(monkeypatch, mode):
    # Strided, offset and reshaped operands reach the op's program as their storage's array:
    # no separate program call reads the view first.
    from torchtpu.device import tensors

    calls = []
    real_call = tensors.call
    monkeypatch.setattr(tensors, "call",
                        lambda fn, *a, **k: calls.append(fn) or real_call(fn, *a, **k))
    a, b = torch.randn(6, 4), torch.randn(8, 5)
    ad, bd = to_device((a, b))
    with torch.tpu.set_eager_mode(getattr(torch.tpu.EagerMode, mode)):
        out = ad[1:5].t() @ bd[::2] + ad.view(4, 6)[:, 2, None]
        # Tensor lists too (cat, foreach ops).
        joined = torch.cat([ad[1:3], bd.t()[:2, :4]])
        summed = torch._foreach_add([ad.t(), bd[2:4]], 1.0)
        assert calls == []
        assert_same(out, a[1:5].t() @ b[::2] + a.view(4, 6)[:, 2, None])
        assert_same(joined, torch.cat([a[1:3], b.t()[:2, :4]]))
        assert_same(summed, torch._foreach_add([a.t(), b[2:4]], 1.0))


def _expanded_writes(device):
    """Writes into a target whose elements share memory: fill_ with a Scalar and zero_ write one
    value (CPU allows them), anything else is refused; what each does, or whether it refused."""
    base = torch.zeros(2, device=device)
    target = base.expand(3, 2)
    outcomes = []
    for name, write in [("fill", lambda: target.fill_(2.5)), ("zero", lambda: target.zero_()),
                        ("fill", lambda: target.fill_(-1)),
                        ("fill_tensor", lambda: target.fill_(torch.tensor(5.0, device=device))),
                        ("add", lambda: target.add_(1))]:
        try:
            write()
            outcomes.append((name, base.cpu().tolist()))
        except RuntimeError as error:
            outcomes.append((name, "more than one element" in str(error)))
    stride_0 = torch.empty_strided((10,), (0,), device=device).fill_(3)
    return outcomes, stride_0.cpu().tolist()


def test_writes_into_expanded_targets_allowed_or_refused_as_on_cpu():
    """PyTorch's test_deterministic_resize fills an empty_strided((10,), (0,)) tensor."""
    assert _expanded_writes("tpu") == _expanded_writes("cpu")


def _copies(device):
    """copy_ into targets that overlap themselves or their source: what each gives, or which
    refusal CPU makes (the device computes the copy whole, so it must refuse by itself)."""
    def arange(*shape):
        return torch.arange(float(torch.Size(shape).numel()), device=device).view(shape)

    cases = [("expanded", lambda: torch.zeros(1, 4, device=device).expand(3, 4)
              .copy_(torch.ones(3, 4, device=device))),
             ("expanded from cpu", lambda: torch.zeros(1, 4, device=device).expand(3, 4)
              .copy_(torch.ones(3, 4))),
             ("expanded empty", lambda: torch.zeros(1, 4, device=device).expand(0, 4)
              .copy_(torch.ones(0, 4, device=device))),
             ("shifted", lambda: (lambda x: x[1:].copy_(x[:-1]))(arange(6))),
             ("transposed", lambda: (lambda x: x.t().copy_(x))(arange(2, 2))),
             ("itself", lambda: (lambda x: x.copy_(x))(arange(6))),
             ("same view", lambda: (lambda x: x[:].copy_(x))(arange(6))),
             ("disjoint halves", lambda: (lambda x: x[:3].copy_(x[3:]))(arange(6)))]
    outcomes = []
    for name, copy in cases:
        try:
            outcomes.append((name, copy().cpu().tolist()))
        except RuntimeError as error:
            outcomes.append((name, str(error).split(":")[1][:40]))
    return outcomes


def test_copy_into_overlapping_targets_refused_as_on_cpu():
    outcomes = _copies("tpu")
    assert outcomes == _copies("cpu")
    assert sum(isinstance(o, str) for _, o in outcomes) == 4  # the four CPU refuses


def _index_writes(device):
    """In-place index ops whose index or source is the written tensor itself (CPU refuses any
    overlap there), and the ones that only warn on an expand-ed target: outcome and warning."""
    def ind():
        return torch.tensor([2, 1, 0], device=device)

    def expanded():
        return torch.zeros(1, device=device).expand(6)

    mask = torch.tensor([True, False, True, True, False, False], device=device)
    cases = [("index_add_", lambda i: i.index_add_(0, i, i.clone())),
             ("index_copy_", lambda i: i.index_copy_(0, i.clone(), i)),
             ("index_fill_", lambda i: i.index_fill_(0, i, 0)),
             ("put_", lambda i: i.put_(i, i.clone())),
             ("index_put_", lambda i: i.index_put_((i,), i.clone())),
             ("scatter_", lambda i: i.scatter_(0, i, i.clone())),
             ("expanded index_put_", lambda i: expanded().index_put_((i,), i.float())),
             ("expanded masked_fill_", lambda i: expanded().masked_fill_(mask, 1.0)),
             ("expanded index_fill_", lambda i: expanded().index_fill_(0, i, 1.0)),
             ("expanded index_add_", lambda i: expanded().index_add_(0, i, i.float())),
             # CPU never checks these against the target: masked_scatter_'s source, and a
             # Tensor value the fill ops read as a number.
             ("masked_scatter_ itself", lambda i: (lambda t: t.masked_scatter_(mask, t))(
                 torch.arange(6.0, device=device))),
             ("masked_fill_ own element", lambda i: (lambda t: t.masked_fill_(mask, t[0]))(
                 torch.arange(6.0, device=device))),
             ("index_fill_ own element", lambda i: (lambda t: t.index_fill_(0, i, t[0]))(
                 torch.arange(6.0, device=device)))]
    outcomes = []
    for name, write in cases:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                outcome = write(ind()).shape
            except RuntimeError as error:
                outcome = str(error).split(":")[1][:40]
        outcomes.append((name, outcome, [str(w.message).removeprefix("torchtpu.check: ")[:40]
                                         for w in caught]))
    return outcomes


def test_index_writes_overlapping_their_index_refused_as_on_cpu():
    outcomes = _index_writes("tpu")
    assert outcomes == _index_writes("cpu")
    assert sum(isinstance(o, str) for _, o, _ in outcomes) == 7  # CPU's refusals
    assert sum(len(w) for _, _, w in outcomes) == 3  # and its warnings


@pytest.mark.parametrize("dtype", [torch.float32, torch.int64])
def test_element_by_element_writes_share_programs(dtype):
    # PyTorch's reference loops write a result element by element (``out[i, j] = v``); with each
    # view's offset static in its writer, every element compiled a program of its own (a test
    # of nn.NLLLoss ran past 300 s in compiles). Values against CPU, and programs loaded counted
    # (compiled or read from the persistent cache) around the writes.
    from torchtpu import metrics

    cpu = torch.zeros(5, 11, dtype=dtype)
    src_cpu = torch.arange(1, 56, dtype=dtype).reshape(5, 11)
    tpu, src = cpu.to("tpu"), src_cpu.to("tpu")
    spots = [(i, j) for i in range(5) for j in (0, 3, 7)][:12]
    values = [src[j % 5, (i * 3 + j) % 11].clone() for i, j in spots]  # 0-d tpu tensors
    before = metrics.snapshot()
    for (i, j), v in zip(spots, values, strict=True):
        tpu[i, j] = v
    after = metrics.snapshot()
    loaded = sum(after[k] - before[k] for k in ("executable_compiles", "persistent_cache_hits"))
    assert loaded <= 2, f"{loaded} programs for 12 element writes"
    for (i, j), v in zip(spots, values, strict=True):
        cpu[i, j] = v.cpu()
    # Rows and stride-1 slices at several offsets (runs), and columns (not runs), against CPU.
    for k in range(3):
        for t, s in ((tpu, src), (cpu, src_cpu)):
            t[k + 1] = s[k]
            t[k, 2 + k:6 + k] = s[4 - k, :4]
            t[:, k * 4] = s[:, 10 - k]
    assert_same(tpu, cpu)
