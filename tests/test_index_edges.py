"""Indexing as CPU does it at the edges (empty, zero-size, broadcast, accumulate, out of bounds,
shape mismatches), CPU index tensors as CUDA accepts them, and the float8 dtypes."""

import pytest
import torch

import torchtpu
from torchtpu.testing.compare import assert_same, to_device

X = torch.randn(4, 3)
ROWS = torch.tensor([True, False, True, False])
NONE = torch.zeros(4, dtype=torch.bool)
EMPTY = torch.zeros(0, dtype=torch.long)


def _set(t, key, value):
    t = t.clone()
    t[key] = value
    return t


def _accumulate(t, key, value):
    t = t.clone()
    t.index_put_(key, value, accumulate=True)
    return t


CASES = {
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
}


def _outcome(fn, x):
    try:
        return fn(x), None
    except Exception as e:  # what CPU refuses, tpu must refuse alike
        return None, e


@pytest.mark.parametrize("name", sorted(CASES))
def test_indexing_edge_cases_match_cpu(name):
    expected, cpu_error = _outcome(CASES[name], X)
    actual, tpu_error = _outcome(CASES[name], X.to("tpu"))
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
