"""Running the same computation on tpu and on CPU and comparing, for tests and conformance."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_flatten, tree_map


def to_device(tree: Any, device: str = "tpu") -> Any:
    """Copy every tensor in tree to device, keeping requires_grad (leaves stay leaves)."""

    def move(x):
        if isinstance(x, torch.Tensor):
            y = x.detach().to(device)
            return y.requires_grad_(x.requires_grad)
        return x

    return tree_map(move, tree)


def to_cpu(tree: Any) -> Any:
    return tree_map(lambda x: x.detach().cpu() if isinstance(x, torch.Tensor) else x, tree)


def assert_same(actual: Any, expected: Any, *, atol: float = 1e-5, rtol: float = 1.3e-6,
                exact_dtype: bool = True) -> None:
    """actual (tpu results) equals expected (CPU results): values, shapes and dtypes."""
    a_flat, a_spec = tree_flatten(to_cpu(actual))
    e_flat, e_spec = tree_flatten(expected)
    assert a_spec == e_spec, f"result structure differs: {a_spec} vs {e_spec}"
    for a, e in zip(a_flat, e_flat):
        if isinstance(e, torch.Tensor):
            torch.testing.assert_close(a, e, atol=atol, rtol=rtol, equal_nan=True,
                                       check_dtype=exact_dtype, check_device=False)
        else:
            assert a == e or (a != a and e != e), f"{a!r} != {e!r}"


def assert_permutation(indices: torch.Tensor, dim: int = -1) -> None:
    """indices holds each of 0..n-1 exactly once along dim (n its size there)."""
    moved = indices.cpu().movedim(dim, -1)
    expected = torch.arange(moved.shape[-1]).expand_as(moved)
    assert torch.equal(moved.sort(-1).values, expected), f"not a permutation along {dim}: {indices}"


def check_against_cpu(fn: Callable, *args: Any, atol: float = 1e-5, rtol: float = 1.3e-6,
                      **kwargs: Any) -> Any:
    """Run fn on CPU inputs and on tpu copies of them; assert the results match."""
    expected = fn(*args, **kwargs)
    actual = fn(*to_device(args), **to_device(kwargs))
    assert_same(actual, expected, atol=atol, rtol=rtol)
    return actual
