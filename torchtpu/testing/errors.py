"""Bad input against CPU: the OpInfo ``error_inputs`` mode of ``python -m torchtpu.testing.opinfo``.

Each OpInfo's ``error_inputs`` are inputs PyTorch must refuse, each with the exception type and a
regex for its message. A sample is generated on CPU and run there first (if CPU accepts it, or
raises something the OpInfo does not expect, it is not counted); its tpu copy then passes when
it raises the same exception type as CPU with a message the regex matches. It fails when tpu
accepts the input (counted as ``failed``: a silently wrong answer) or raises something else
(``errored``). A result is read back to the host before it counts as accepted, so errors found
when the program runs are seen too.

``error_inputs_sparse`` (rows ``<op> [sparse]``) give sparse inputs in each of the five sparse
layouts. tpu tensors are strided only and tpu refuses sparse layouts themselves
(``device/sparse.py``), so such a sample passes when its copy to tpu, or the call, raises that
refusal naming the sample's layout; CPU must still refuse the sample as the OpInfo says for it to
count.
"""

from __future__ import annotations

import itertools
import re
from typing import Any

import torch
from torch.utils._pytree import tree_flatten

from torchtpu.device import sparse
from torchtpu.eager.fallback import copy_keeping_aliases
from torchtpu.testing import conformance, op_samples
from torchtpu.testing.conformance import Result, shorten


class _Accepted(Exception):
    """tpu returned a result for an input CPU refuses."""


def _read_back(out: Any) -> None:
    """Copy every tensor result to the host: a deferred program runs and raises here."""
    for t in tree_flatten(out)[0]:
        if isinstance(t, torch.Tensor) and t.device.type == "tpu":
            t.cpu()


def _raise(op, sample) -> BaseException | None:
    try:
        _read_back(op(sample.input, *sample.args, **sample.kwargs))
    except Exception as exc:
        return exc
    return None


def _aliased_copy(sample):
    """A tpu copy of sample whose tensors keep their strides and their sharing of storages
    (many error inputs pass an expanded out= or one that aliases an input)."""
    bases: dict = {}

    def move(t):
        return copy_keeping_aliases(t, "tpu", bases) if isinstance(t, torch.Tensor) else t

    copy = sample.transform(move)
    copy.args = tuple(op_samples.device_value(a) for a in copy.args)
    copy.kwargs = {k: op_samples.device_value(v) for k, v in copy.kwargs.items()}
    return copy


def _copy_or_error(sample):
    try:
        return _aliased_copy(sample)
    except Exception as exc:
        return exc


def _cpu_refuses(op, error_input) -> BaseException | None:
    """CPU's error for error_input when it is the one the OpInfo expects, else None."""
    expected = _raise(op, error_input.sample_input)
    if expected is None or not isinstance(expected, error_input.error_type) \
            or not re.search(error_input.error_regex, str(expected)):
        return None
    return expected


def check_error_input(op, error_input, device_sample, result: Result) -> None:
    """Count one ErrorInput: CPU must refuse it as the OpInfo says, tpu (device_sample, its
    copy, or the exception copying it raised) the same way."""
    regex = error_input.error_regex
    expected = _cpu_refuses(op, error_input)
    if expected is None:
        result.skipped += 1  # CPU does not refuse it as the OpInfo expects: not ours to count
        return
    if isinstance(device_sample, Exception):
        result.error(device_sample, "copy to tpu: ")
        return
    actual = _raise(op, device_sample)
    if actual is None:
        result.mismatch(_Accepted(f"accepted; CPU raises {shorten(expected)}"))
    elif type(actual) is not type(expected) or not re.search(regex, str(actual)):
        result.error(actual, f"want {type(expected).__name__} /{regex}/, got ")
    else:
        result.passed += 1


def check_op(op, *, max_samples: int = 1000, timeout: float = 60.0) -> Result:
    """Run up to max_samples counted error inputs of one OpInfo on tpu against CPU."""
    name = op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
    result = Result(name)
    if op.error_inputs_func is None:
        result.first_error = "(skipped: no error_inputs)"
        return result
    try:
        with conformance.time_limit(timeout):
            torch.manual_seed(0)
            # Copied before CPU runs any: some samples share tensors, and a refused CPU call
            # may still resize its out= argument.
            inputs = list(itertools.islice(op.error_inputs("cpu"), 2 * max_samples))
            copies = [_copy_or_error(e.sample_input) if op_samples.plain(e.sample_input) else None
                      for e in inputs]
            for error_input, device_sample in zip(inputs, copies):
                if result.counted >= max_samples:
                    break
                if device_sample is None:
                    result.skipped += 1
                    continue
                check_error_input(op, error_input, device_sample, result)
    except conformance.Timeout as exc:
        result.errored += 1
        result.note(str(exc))
    except Exception as exc:  # generating error inputs failed: nothing device-specific yet
        if not result.counted:
            result.first_error = f"(skipped: error input generation: {shorten(exc)})"
    return result


SPARSE_LAYOUTS = (torch.sparse_coo, torch.sparse_csr, torch.sparse_csc, torch.sparse_bsr,
                  torch.sparse_bsc)


def check_sparse_error_input(op, error_input, layout: torch.layout, result: Result) -> None:
    """Count one sparse ErrorInput: CPU refuses it as the OpInfo says, tpu refuses its layout."""
    if _cpu_refuses(op, error_input) is None:
        result.skipped += 1
        return
    try:  # as a user moves one: a sparse tensor has no storage to keep the sharing of
        device_sample = error_input.sample_input.transform(
            lambda t: t.to("tpu") if isinstance(t, torch.Tensor) else t)
    except Exception as exc:
        device_sample = exc
    actual = device_sample if isinstance(device_sample, Exception) else _raise(op, device_sample)
    if actual is None:
        result.mismatch(_Accepted(f"accepted a {layout} input"))
    elif str(sparse.refusal("", str(layout))).split(" (aten op")[0] in str(actual):
        result.passed += 1
    else:
        result.error(actual, f"want the {layout} refusal, got ")


def check_sparse(op, *, max_samples: int = 1000, timeout: float = 60.0) -> Result:
    """Run up to max_samples counted ``error_inputs_sparse`` of one OpInfo, in every layout it
    supports."""
    result = Result(op.name + (f".{op.variant_test_name}" if op.variant_test_name else "")
                    + " [sparse]")
    try:
        with conformance.time_limit(timeout):
            for layout in filter(op.supports_sparse_layout, SPARSE_LAYOUTS):
                for error_input in op.error_inputs_sparse("cpu", layout):
                    if result.counted >= max_samples:
                        return result
                    check_sparse_error_input(op, error_input, layout, result)
    except conformance.Timeout as exc:
        result.errored += 1
        result.note(str(exc))
    return result
