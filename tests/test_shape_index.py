"""Shape, indexing and factory ops on tpu against PyTorch on CPU, including their backward;
indexing at the edges (empty, zero-size, broadcast, out of bounds, shape mismatches), CPU index
tensors as CUDA accepts them, and the float8 dtypes."""

import warnings

import pytest
import torch
import torch.nn.functional as F

import torchtpu
from torchtpu.testing.compare import assert_same, check_against_cpu, to_device


def _inputs():
    x = torch.randn(3, 4)
    return x, torch.tensor([0, 2, 0]), x > 0


def _set(t, key, value):
    t = t.clone()
    t[key] = value
    return t


def _accumulate(t, key, value):
    t = t.clone()
    t.index_put_(key, value, accumulate=True)
    return t


SHAPE = {
    "cat": lambda x, i, m: (torch.cat([x, x[:1], x.new_zeros(0)]), torch.cat([x, i[:, None]], 1)),
    "stack": lambda x, i, m: torch.stack([x, x], 1),
    "constant_pad": lambda x, i, m: F.pad(x, (1, 2, -1, 1), value=3.5),
    "reflect_replicate_pad": lambda x, i, m: (
        F.pad(x[None], (2, 1), mode="reflect"),
        F.pad(x[None, None], (2, 1, 1, 1), mode="reflect"),
        F.pad(x[None], (2, 1), mode="replicate"),
    ),
    "flip_roll": lambda x, i, m: (x.flip(0, -1), x.roll(1, 0), x.roll((2, -1), (1, 0)), x.roll(5)),
    "repeat": lambda x, i, m: x.repeat(2, 1, 3),
    "tril_triu": lambda x, i, m: (x.tril(), x.triu(1), x.tril(-1)),
    "masked_fill": lambda x, i, m: (x.masked_fill(m, 1.5), x.masked_fill(m, x[0, 0])),
}

INDEX = {
    "index": lambda x, i, m: (x[i], x[:, i], x[i, i], x[None, i, 1:], x[i[:, None], i], x[-1]),
    "bool_mask": lambda x, i, m: (x[m], x[m[:, 0]]),
    "gather": lambda x, i, m: x.gather(1, i[None].expand(2, 3)),
    "scatter": lambda x, i, m: (
        x.scatter(1, i[None, :2].flip(1).expand(2, 2), 7.0),
        x.scatter(0, i[None, [1, 0, 1, 0]] % 3, x),
        x.scatter(1, i[None].expand(2, 3), x, reduce="add"),
        x.scatter(1, i[None].expand(2, 3), 2.0, reduce="multiply"),
        x.scatter_add(1, i[None].expand(3, 3), x),
    ),
    "index_ops": lambda x, i, m: (
        x.index_select(0, i),
        x.index_select(1, i),
        x.index_add(0, i, x, alpha=2),
        x.index_copy(1, i[:2] + 1, x[:, :2]),
        x.index_fill(1, i, -1.0),
    ),
    "masked": lambda x, i, m: (
        x.masked_scatter(m, x * 10),
        x.masked_select(m[0]),
        m.nonzero(),
        torch.where(m),
    ),
    "embedding": lambda x, i, m: F.embedding(i.reshape(1, 3), x),
    "searchsorted": lambda x, i, m: (
        torch.searchsorted(torch.sort(x).values, x),
        torch.searchsorted(x[0].sort().values, x, right=True),
        torch.bucketize(x, x[0].sort().values, out_int32=True),
    ),
    "unique": lambda x, i, m: (
        torch.unique(i),
        torch.unique(i, return_inverse=True, return_counts=True),
    ),
    "take": lambda x, i, m: (
        torch.take(x, i + 5),
        torch.take_along_dim(x, i[None].expand(3, 3), 1),
    ),
}

INDEX_PUT = {
    "mask_scalar": lambda x, i, m: _set(x, m, 0.0),
    "mask_values": lambda x, i, m: _set(x, m, torch.arange(int(m.sum()), device=x.device) * 1.0),
    "mask_rows": lambda x, i, m: _set(x, m[:, 0], x[0] * 2),
    "index_value": lambda x, i, m: _set(x, i, 1.0),
    "index_columns": lambda x, i, m: _set(x, (slice(None), i), x[:, 0:1] * 3),
    "accumulate_repeated": lambda x, i, m: _accumulate(x, (i,), x[:3] + 1),
    "accumulate_mask": lambda x, i, m: _accumulate(x, (m,), x[0, 0]),
}


@pytest.mark.parametrize("name", sorted(SHAPE))
def test_shape_ops(name):
    check_against_cpu(SHAPE[name], *_inputs())


@pytest.mark.filterwarnings("ignore:The reduce argument of torch.scatter")
@pytest.mark.parametrize("name", sorted(INDEX))
def test_index_ops(name):
    check_against_cpu(INDEX[name], *_inputs())


@pytest.mark.parametrize("name", sorted(INDEX_PUT))
def test_index_put(name):
    check_against_cpu(INDEX_PUT[name], *_inputs())


@pytest.mark.parametrize("reduce", ["sum", "prod", "mean", "amax", "amin"])
def test_scatter_reduce(reduce):
    x, i, _ = _inputs()
    index = i[None].expand(3, 3)

    def fn(x, index):
        return (x.scatter_reduce(1, index, x * 2, reduce),
                x.scatter_reduce(1, index, x * 2, reduce, include_self=False),
                (x * 10).long().scatter_reduce(1, index, (x * 7).long(), reduce,
                                               include_self=False))

    check_against_cpu(fn, x, index)


def test_setitem_in_place_semantics():
    """``x[mask] = 0`` and ``x[idx] += 1`` with repeated indices, written into x itself."""
    x, i, m = _inputs()
    expected, actual = x.clone(), to_device(x)
    for t, mask, idx in ((expected, m, i), (actual, to_device(m), to_device(i))):
        t[mask] = 0
        t[idx] += 1  # read-modify-write: a repeated index adds once, as on CPU
        t.index_put_((idx,), torch.ones((), device=t.device), accumulate=True)  # adds twice
    assert_same(actual, expected)


def test_factories():
    def fn(device):
        return (
            torch.arange(5, device=device),
            torch.arange(10, -3, -3, device=device),
            torch.arange(0, 1, 0.1, device=device, dtype=torch.float64),
            torch.arange(1.0, 7.0, device=device, dtype=torch.bfloat16),
            torch.linspace(0, 10, 7, device=device, dtype=torch.int64),
            torch.linspace(2, 2, 1, device=device),
            torch.logspace(0, 2, 5, base=2, device=device),
            torch.eye(3, device=device),
            torch.eye(2, 4, device=device, dtype=torch.int32),
            torch.full((2, 3), 7, device=device),
            torch.full((2,), True, device=device),
            torch.zeros(2, 3, device=device),
            torch.ones(2, device=device, dtype=torch.int8),
            torch.scalar_tensor(3, device=device),
        )

    assert_same(fn("tpu"), fn("cpu"))


def test_float_ranges_within_one_ulp():
    # PyTorch's CPU kernels round float32 ranges chunk by chunk in float32; these are computed
    # in float64 and rounded once, so they may differ from CPU by one unit in the last place.
    def fn(device):
        return (torch.arange(-3.7, 100.3, 0.37, device=device),
                torch.linspace(-1, 3.3, 17, device=device),
                torch.logspace(0, 2, 5, device=device))

    assert_same(fn("tpu"), fn("cpu"), atol=1e-6, rtol=2.4e-7)


def _grads(fn, x, *rest):
    """Gradient of x through fn on CPU and on tpu, with a fixed upstream gradient."""
    results = []
    for args in ((x, *rest), to_device((x, *rest))):
        leaf = args[0].detach().requires_grad_()
        out = fn(leaf, *args[1:])
        out.backward(torch.linspace(-1, 1, out.numel()).reshape(out.shape).to(out.device))
        results.append(leaf.grad)
    return results


@pytest.mark.parametrize("name", ["index", "gather", "scatter", "index_select", "embedding",
                                  "masked_fill", "cat_pad"])
def test_backward(name):
    x, i, m = _inputs()
    fns = {
        "index": lambda x, i, m: x[i, 1:],
        "gather": lambda x, i, m: x.gather(1, i[None].expand(3, 3)),
        "scatter": lambda x, i, m: x.scatter(1, i[None, :2].expand(3, 2) + 1, x[:, :2] * 2),
        "index_select": lambda x, i, m: x.index_select(1, i),
        "embedding": lambda x, i, m: F.embedding(i, x, padding_idx=2),
        "masked_fill": lambda x, i, m: x.masked_fill(m, 0.0).flip(0).tril(),
        "cat_pad": lambda x, i, m: torch.cat([F.pad(x, (1, 1)), x.roll(1, 1)], 1),
    }
    actual, expected = _grads(fns[name], x, i, m)
    assert_same(actual, expected)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_pad_backward(mode):
    # Autograd calls the backward's out= form, which PyTorch's reflection decomposition rejects.
    for shape, pad in (((2, 5), (2, 1)), ((2, 4, 5), (1, 2, 2, 1)),
                       ((1, 3, 4, 5), (1, 1, 2, 1, 0, 2))):
        actual, expected = _grads(lambda t, p=pad: F.pad(t, p, mode=mode), torch.randn(shape))
        assert_same(actual, expected)


@pytest.mark.parametrize("mode", ["reflect", "replicate"])
def test_negative_pads_crop(mode):
    # A negative pad crops its side; the other side's edge stays the input's, so (-2, 2) reflects
    # into the cropped part.
    for shape, pad in (((2, 5), (-2, 2)), ((2, 5), (1, -3)), ((1, 3, 4, 5), (0, 0, -1, -1)),
                       ((1, 3, 4, 5), (-1, 2, 2, -2))):
        actual, expected = _grads(lambda t, p=pad: F.pad(t, p, mode=mode),
                                  torch.randn(shape, dtype=torch.float64))
        assert_same(actual, expected)


@pytest.mark.filterwarnings("ignore:index_reduce")
@pytest.mark.parametrize("reduce", ["prod", "mean", "amax", "amin"])
def test_index_reduce(reduce):
    x, source, index = torch.randn(4, 5), torch.randn(4, 3), torch.tensor([0, 4, 0])
    for include_self in (True, False):
        check_against_cpu(lambda a, i, s, inc=include_self: a.index_reduce(1, i, s, reduce,
                                                                           include_self=inc),
                          x, index, source)
    actual, expected = _grads(lambda a, i, s: a.index_reduce(0, i, s, reduce), x,
                              torch.tensor([3, 1, 3]), torch.randn(3, 5))
    assert_same(actual, expected)


def test_put_take_and_small_edge_cases():
    x = torch.randn(3, 4)
    check_against_cpu(lambda a, i, s: a.put(i, s, accumulate=True), x,
                      torch.tensor([0, -1, 3, 3]), torch.randn(4))
    check_against_cpu(lambda a, i, s: a.clone().put_(i, s), x, torch.tensor([[0, -1], [5, 7]]),
                      torch.randn(2, 2))
    actual, expected = _grads(lambda a: a.take(torch.tensor([[0, 11], [5, 5]], device=a.device)),
                              x)
    assert_same(actual, expected)
    # combinations of one element: masked_scatter with an empty source in the backward.
    actual, expected = _grads(lambda a: torch.combinations(a, r=2).sum(0), torch.randn(1))
    assert_same(actual, expected)
    # index_fill's backward calls _unique.
    actual, expected = _grads(lambda a: a.index_fill(1, torch.tensor([0, 2, 0], device=a.device),
                                                     -1.0), x)
    assert_same(actual, expected)


@pytest.mark.parametrize("reduce", ["sum", "mean", "max", "min", "prod"])
def test_segment_reduce(reduce):
    data = torch.tensor([1.0, 2.0, 2.0, 0.0, 3.0, -1.0])
    for key, value in (("lengths", torch.tensor([0, 1, 2, 3])),
                       ("offsets", torch.tensor([0, 0, 1, 3, 6]))):
        for initial in (None, 2.0):
            def fn(d, v, k=key, i=initial):
                return torch.segment_reduce(d, reduce, initial=i, **{k: v})

            check_against_cpu(fn, data, value)
            actual, expected = _grads(fn, data, value)
            assert_same(actual, expected)
    batched = torch.randn(2, 6, 3)
    lengths = torch.tensor([[1, 2, 3], [0, 5, 1]])
    actual, expected = _grads(lambda d: torch.segment_reduce(
        d, reduce, lengths=lengths.to(d.device), axis=1), batched)
    assert_same(actual, expected)


def test_unique_consecutive_and_nonzero_static():
    x = torch.tensor([[1, 1, 2], [1, 1, 2], [3, 3, 3]])
    for args in ((), (True, True), (False, False, 0), (True, False, -1)):
        check_against_cpu(lambda t, a=args: torch.ops.aten.unique_consecutive(t, *a), x)
    check_against_cpu(lambda t: torch.unique_consecutive(t, return_counts=True),
                      torch.tensor([1.0, 1.0, 2.0, 2.0, 2.0, 0.0]))
    for size, fill in ((3, -1), (1, 7), (6, 0)):
        check_against_cpu(lambda t, s=size, f=fill: torch.nonzero_static(t, size=s, fill_value=f),
                          x - 1)
    check_against_cpu(lambda t: torch.nonzero_static(t, size=2), torch.tensor(3.0))


# ----------------------------------------------------------------------------- edges

X = torch.randn(4, 3)
ROWS = torch.tensor([True, False, True, False])
NONE = torch.zeros(4, dtype=torch.bool)
EMPTY = torch.zeros(0, dtype=torch.long)


EDGE_CASES = {
    "empty_mask": lambda x: x[NONE.to(x.device)],
    "empty_mask_2d": lambda x: x[torch.zeros(4, 3, dtype=torch.bool, device=x.device)],
    "empty_index": lambda x: (x[EMPTY.to(x.device)], x[:, EMPTY.to(x.device)]),
    "zero_size_dim": lambda x: x[:0][EMPTY.to(x.device)],
    "set_empty_mask": lambda x: _set(x, NONE.to(x.device), 2.0),
    "set_empty_index": lambda x: _set(x, EMPTY.to(x.device), 2.0),
    "set_rows_broadcast": lambda x: _set(x, ROWS.to(x.device), torch.arange(3.0, device=x.device)),
    "accumulate_empty": lambda x: _accumulate(x, (EMPTY.to(x.device),), x[:0]),
    "accumulate_repeated": lambda x: _accumulate(x, (torch.tensor([1, 1, 3, 1], device=x.device),),
                                                 torch.ones(4, 3, device=x.device)),
    "accumulate_mask": lambda x: _accumulate(x, (ROWS.to(x.device),), x[:2] * 2),
    "accumulate_empty_mask": lambda x: _accumulate(x, (NONE.to(x.device),), x[NONE.to(x.device)]),
    # Refused: the same exception type and words as CPU, in Strict mode too.
    "out_of_bounds": lambda x: x[torch.tensor([0, 4], device=x.device)],
    "out_of_bounds_negative": lambda x: x[torch.tensor([-5], device=x.device)],
    "out_of_bounds_set": lambda x: _set(x, torch.tensor([7], device=x.device), 1.0),
    "out_of_bounds_accumulate": lambda x: _accumulate(x, (torch.tensor([7], device=x.device),),
                                                      torch.ones(1, 3, device=x.device)),
    "mask_shape": lambda x: x[torch.ones(5, dtype=torch.bool, device=x.device)],
    "mask_broadcast_set": lambda x: _set(x, torch.ones(3, dtype=torch.bool, device=x.device), 1.0),
    "value_shape": lambda x: _set(x, torch.tensor([0, 1], device=x.device),
                                  torch.ones(3, 3, device=x.device)),
    "value_shape_mask": lambda x: _set(x, ROWS.to(x.device), torch.ones(3, 3, device=x.device)),
    "too_many_indices": lambda x: x[torch.tensor([0], device=x.device), 0, 0],
    # A complex fill value into a real tensor: the device would drop the imaginary part.
    "index_fill_complex": lambda x: x.clone().index_fill_(1, torch.tensor([0], device=x.device),
                                                          1 + 1j),
    "index_fill_complex_into_complex": lambda x: x.to(torch.cfloat).index_fill_(
        1, torch.tensor([0], device=x.device), 1 + 1j),
    # gather's result has the index's shape, also where only one of self and index is 0-d.
    "gather_0d_index": lambda x: torch.gather(x[0], 0, torch.tensor(1, device=x.device)),
    "gather_0d_self": lambda x: torch.gather(x[0, 0], 0, torch.tensor([0], device=x.device)),
}


def _outcome(fn, x):
    try:
        return fn(x), None
    except Exception as e:  # what CPU refuses, tpu must refuse alike
        return None, e


@pytest.mark.parametrize("name", sorted(EDGE_CASES))
def test_indexing_edge_cases_match_cpu(name):
    expected, cpu_error = _outcome(EDGE_CASES[name], X)
    actual, tpu_error = _outcome(EDGE_CASES[name], X.to("tpu"))
    if cpu_error is not None:
        assert (type(tpu_error), str(tpu_error)) == (type(cpu_error), str(cpu_error))
    else:
        assert tpu_error is None, tpu_error
        assert_same(actual, expected)


def _transfers() -> int:
    return torchtpu.metrics.snapshot().get("implicit_index_transfers", 0)


def test_cpu_index_tensors_are_accepted_as_on_cuda_and_counted():
    x, idx = X.to("tpu"), torch.tensor([2, 0, 2])
    before = _transfers()
    assert_same(x[idx], X[idx])
    assert_same(x[ROWS], X[ROWS])
    assert_same(x[idx, 1:], X[idx, 1:])
    assert_same(_set(x, ROWS, 5.0), _set(X, ROWS, 5.0))
    assert_same(_set(x, ROWS, torch.tensor(2.0)), _set(X, ROWS, torch.tensor(2.0)))  # CPU scalar
    assert_same(_accumulate(x, (idx,), torch.ones(3, 3, device="tpu")),
                _accumulate(X, (idx,), torch.ones(3, 3)))
    assert _transfers() - before == 6
    # Everything else still refuses a CPU operand: no silent copies.
    for fn in (lambda: x + X, lambda: x.index_select(0, idx),
               lambda: x.clone().index_put_((idx,), torch.ones(3, 3))):
        with pytest.raises(RuntimeError, match="Expected all tensors to be on the same device"):
            fn()


FLOAT8 = [torch.float8_e4m3fn, torch.float8_e5m2, torch.float8_e4m3fnuz, torch.float8_e5m2fnuz]


@pytest.mark.parametrize("dtype", FLOAT8, ids=str)
def test_float8_storage_copies_views_indexing_and_casts(dtype):
    special = torch.tensor([1e6, -1e6, float("inf"), float("nan"), 0.0, -0.0, 1e-10, 448.0, 464.0])
    wide = torch.cat([torch.randn(40) * 10, special])
    x = wide[:48].reshape(4, 12).to(dtype)

    def same(a, b):  # bitwise, NaN payloads aside
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a.cpu().float().nan_to_num(7.0), b.float().nan_to_num(7.0))

    dev = x.to("tpu")
    same(dev, x)
    same(dev[1:, ::3], x[1:, ::3])
    same(dev.t().contiguous(), x.t().contiguous())
    same(dev[torch.tensor([2, 0])], x[torch.tensor([2, 0])])
    same(dev[ROWS], x[ROWS])
    same(torch.cat([dev, dev]), torch.cat([x, x]))
    same(dev.view(torch.uint8).view(dtype), x)
    for source in (wide, wide.double(), wide.half(), wide.bfloat16()):
        same(source.to("tpu").to(dtype), source.to(dtype))  # CPU saturates e4m3fn at +-448
    assert_same(dev.to(torch.float32), x.to(torch.float32))
    assert_same(to_device(X).to(dtype).cpu().float(), X.to(dtype).float())


def test_assert_async_passes_or_raises_what_cpu_raises():
    """torch._assert_async (TorchTitan's RoPE bounds check) checks the value as CPU does."""
    positions = torch.arange(5, device="tpu")
    torch._assert_async(torch.all(positions <= 4), "positions exceed 4")
    with pytest.raises(RuntimeError, match="positions exceed 3"):
        torch._assert_async(torch.all(positions <= 3), "positions exceed 3")
    with pytest.raises(RuntimeError, match="single nonzero value, but got zero"):
        torch._assert_async(torch.all(positions <= 3))
    with pytest.raises(RuntimeError, match="more than one value is ambiguous"):
        torch._assert_async(positions < 3)


def _byte_mask_warnings(device):
    x, mask = X.to(device), ROWS.to(torch.uint8).to(device)
    calls = [lambda: x[mask], lambda: x[mask, :, None], lambda: _set(x, mask, x[mask] * 2),
             lambda: _accumulate(x, (mask,), x[mask]), lambda: x[mask[:3]]]  # the last raises
    counts = []
    for call in calls:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                call()
            except IndexError:
                pass
        counts.append(sum("torch.uint8 is now deprecated" in str(w.message) for w in caught))
    return counts


def test_byte_masks_warn_as_on_cpu():
    """Once per byte mask of each call, as CPU warns; not again from CPU's kernel, which
    torchtpu runs on stand-ins to check the call's dtypes (``eager/refusals``) or, where the
    call fails, on copies to word the error as CPU does (``fallback.cpu_error``)."""
    assert _byte_mask_warnings("tpu") == _byte_mask_warnings("cpu")


def test_repeat_interleave_by_tensor_matches_cpu():
    """Tensor repeats (zeros included): with output_size one program, without it sized from the
    repeats' values; vLLM's mean pooling takes the first form."""
    r = torch.tensor([2, 0, 3, 1, 4])
    x = torch.randn(5, 3)
    check_against_cpu(lambda r: torch.repeat_interleave(r), r)
    check_against_cpu(lambda x, r: torch.repeat_interleave(x, r, dim=0, output_size=10), x, r)
    check_against_cpu(lambda x, r: torch.repeat_interleave(x, r, dim=1), x.T.contiguous(), r)


@pytest.mark.parametrize("device", ["cpu", "tpu"])
def test_put_refuses_what_cpu_refuses(device):
    """put_ out of range raises CPU's IndexError (XLA's scatter would drop the write), and
    without accumulate it alerts in deterministic mode (PyTorch's test_nondeterministic_alert_put):
    raised, or warned under warn_only; accumulating does not alert."""
    from torch.testing._internal.common_utils import DeterministicGuard

    x = torch.zeros(4, device=device)
    for bad in (7, -5):
        with pytest.raises(IndexError, match=f"tried to access index {bad} on a tensor of 4"):
            x.put_(torch.tensor([bad], device=device), torch.tensor([1.0], device=device))
    i, v = torch.tensor([1, 1], device=device), torch.tensor([1.0, 2.0], device=device)
    with DeterministicGuard(True):
        with pytest.raises(RuntimeError, match="put_ does not have a deterministic"):
            x.put_(i, v)
        assert x.put(i, v, accumulate=True).tolist() == [0, 3, 0, 0]
    with DeterministicGuard(True, warn_only=True):
        with pytest.warns(UserWarning, match="put_ does not have a deterministic"):
            x.put_(i, v)


def test_bool_accumulations_are_a_logical_or_as_on_cpu():
    """index_put_(accumulate=True), put(accumulate=True), index_add_ and scatter_add_ on bool
    tensors (XLA's scatter-add has no bool; PyTorch's test_index_put_src_datatype[bool])."""
    x = torch.tensor([[True, False], [False, False], [False, True]])
    v = torch.tensor([[True, True], [False, True]])
    i = torch.tensor([0, 0])
    check_against_cpu(lambda x, v, i: x.clone().index_put_((i,), v, accumulate=True), x, v, i)
    check_against_cpu(lambda x, i: x.put(i, torch.ones_like(i, dtype=torch.bool),
                                         accumulate=True), x, i)
    check_against_cpu(lambda x, v, i: x.clone().index_add_(0, i, v), x, v, i)
    check_against_cpu(lambda x, v, i: x.clone().scatter_add_(0, i[:, None].expand(2, 2), v),
                      x, v, i)


def test_zero_size_tensors_take_cpu_strides():
    makers = (lambda d: torch.empty(0, 1, 2, 0, device=d),
              lambda d: torch.randn(0, 1, 2, 0, device=d),
              lambda d: torch.zeros(0, 3, device=d) + 1, lambda d: torch.ones(2, 0, 4, device=d))
    for make in makers:
        assert make("tpu").stride() == make("cpu").stride()


def test_tpu_indices_into_a_cpu_tensor_refused_as_cuda_refuses_them():
    # CUDA's AdvancedIndex rule (PyTorch's TestDevicePrecision): indices may be on CPU or on the
    # indexed tensor's device, not on another one.
    x, index = torch.randn(3, 4), torch.tensor([0, 2], device="tpu")
    expected = (r"indices should be either on cpu or on the same device as the indexed tensor "
                r"\(cpu\)")
    with pytest.raises(RuntimeError, match=expected):
        x[index]
    with pytest.raises(RuntimeError, match=expected):
        x[:, index] = 1.0
