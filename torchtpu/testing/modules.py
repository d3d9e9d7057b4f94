"""ModuleInfo conformance: PyTorch's own ``torch.nn`` module database run on tpu against CPU.

``python -m torchtpu.testing.modules [--modules REGEX] [--max-samples N]`` takes every ModuleInfo
in ``torch.testing._internal.common_modules.module_db`` and, for each of its sample inputs (in
train and in eval mode where the module behaves differently), builds the module on CPU and a tpu
copy of it, then checks in order:

- ``forward``: the outputs;
- ``backward``: the gradients of the float outputs against a fixed random cotangent, for the
  inputs that require grad and for every parameter;
- ``state``: the parameters and buffers after the step (batch norm's running statistics move);
- ``state_dict``: the tpu module's ``state_dict`` saved with ``torch.save``, loaded with
  ``torch.load`` into a fresh tpu copy, equals the CPU module's.

Modules that take ``inplace`` are also run with ``inplace=True`` (on a non-leaf copy of the
input, as autograd requires) as a sample of their own. The CPU fallback is an error, so a sample
that needs an op without a lowering fails and names it. A sample passes when every check does;
the first error says which check failed. Not counted: what the ModuleInfo skips or expects to
fail for its CPU/GPU parity test, samples that raise on CPU, and samples whose results are random
(two CPU runs with different seeds differ: dropout in training).
"""

from __future__ import annotations

import inspect
import io
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import torch
from torch.nn.utils.rnn import PackedSequence
from torch.utils._pytree import tree_flatten, tree_map

import torchtpu  # noqa: F401  (registers the device)
from torchtpu.testing import conformance
from torchtpu.testing.compare import assert_same
from torchtpu.testing.conformance import Report, Result, same

# The tests of test_modules.py whose decorations describe comparing a device with CPU.
_SKIP_TESTS = ("test_cpu_gpu_parity",)
_TOL_TESTS = ("test_cpu_gpu_parity", "test_forward")

# float32 (atol, rtol): a module is several ops, and its gradients sum over the batch and the
# spatial dims in another order than PyTorch's CPU kernels.
_TOL = (1e-5, 1e-5)
# Measured against float64 on the module_db samples: the tpu gradients of the attention and
# layer norm stacks are up to 3e-5 from CPU's (CPU's own float32 error there is ~1e-6, tpu's
# ~1e-5); ConvTranspose3d's gradients, long sums in another order, differ by up to 1.8e-5.
LOOSER: dict[str, tuple[float, float]] = {
    name: (5e-5, 1e-5)
    for name in ("nn.Transformer", "nn.TransformerEncoder", "nn.TransformerEncoderLayer",
                 "nn.TransformerDecoderLayer", "nn.MultiheadAttention", "nn.ConvTranspose3d",
                 "nn.LazyConvTranspose3d")
}


def _decorators(info, dtype: torch.dtype, tests: tuple[str, ...]) -> Iterator[Any]:
    from torch.testing._internal.opinfo.core import DecorateInfo

    for item in info.decorators:
        if not isinstance(item, DecorateInfo):
            continue
        if item.device_type not in (None, "cpu"):
            continue
        if any(item.is_active("TestModule", t, "cpu", dtype, {}) for t in tests):
            yield from item.decorators


def _skip_reason(info, dtype: torch.dtype) -> str | None:
    if dtype not in info.supported_dtypes("cpu"):
        return f"{dtype} not supported"
    for decorator in _decorators(info, dtype, _SKIP_TESTS):
        name = getattr(decorator, "__qualname__", "")
        if name == "expectedFailure" or name == "skip" or name.startswith("skip."):
            return "skipped by its ModuleInfo"
    return None


def _tolerance(info, dtype: torch.dtype) -> tuple[float, float]:
    atol, rtol = LOOSER.get(info.name, _TOL) if dtype == torch.float32 else _TOL
    for decorator in _decorators(info, dtype, _TOL_TESTS):
        kind = type(decorator).__name__
        if kind == "toleranceOverride" and dtype in decorator.d:
            atol, rtol = max(atol, decorator.d[dtype].atol), max(rtol, decorator.d[dtype].rtol)
        elif kind == "precisionOverride" and dtype in decorator.d:
            atol = max(atol, decorator.d[dtype])
    return atol, rtol


# ----------------------------------------------------------------------------- one sample

def _move(tree: Any, device: str) -> Any:
    """Detached copies on device; leaves keep requires_grad."""

    def move(x):
        if isinstance(x, PackedSequence):
            return x.to(device)
        if not isinstance(x, torch.Tensor):
            return x
        return x.detach().to(device, copy=True).requires_grad_(x.requires_grad)

    # A PackedSequence moves whole: its batch_sizes stay on CPU.
    return tree_map(move, tree, is_leaf=lambda x: isinstance(x, PackedSequence))


def _tensors(tree: Any) -> list[torch.Tensor]:
    return [x for x in tree_flatten(tree)[0] if isinstance(x, torch.Tensor)]


class _Case:
    """One module on one device, built and seeded the same way on every device."""

    def __init__(self, info, module_input, training: bool, device: str, inplace: bool):
        ctor, fwd = module_input.constructor_input, module_input.forward_input
        kwargs = dict(ctor.kwargs, inplace=True) if inplace else ctor.kwargs
        torch.manual_seed(0)
        module = info.module_cls(*ctor.args, **kwargs)
        self.args, self.kwargs = _move((fwd.args, fwd.kwargs), device)
        self.inplace = inplace
        if info.is_lazy:
            # Materialize on CPU, so both devices start from the same random initialization.
            cpu_args, cpu_kwargs = _move((fwd.args, fwd.kwargs), "cpu")
            module._infer_parameters(module, cpu_args, cpu_kwargs)
        self.module = module.to(device).train(training)

    def forward(self, seed: int) -> Any:
        args, kwargs = self.args, self.kwargs
        if self.inplace:
            # An in-place module may not write into a leaf that requires grad.
            args, kwargs = tree_map(lambda x: x.clone() if isinstance(x, torch.Tensor) else x,
                                    (args, kwargs))
        torch.manual_seed(seed)
        return self.module(*args, **kwargs)

    def backward(self, out: Any) -> list[torch.Tensor | None] | None:
        inputs = [t for t in _tensors((self.args, self.kwargs)) if t.requires_grad]
        inputs += [p for p in self.module.parameters() if p.requires_grad]
        outs = [t for t in _tensors(out) if t.requires_grad and t.is_floating_point()]
        if not inputs or not outs:
            return None
        gen = torch.Generator().manual_seed(1234)  # the same cotangent on every device
        cotangents = [torch.randn(o.shape, generator=gen).to(o.device, o.dtype) for o in outs]
        return list(torch.autograd.grad(outs, inputs, cotangents, allow_unused=True))

    def state(self) -> dict[str, torch.Tensor]:
        return dict(self.module.state_dict())


def _round_trip(case: _Case, fresh: _Case) -> dict[str, torch.Tensor]:
    buffer = io.BytesIO()
    torch.save(case.module.state_dict(), buffer)
    buffer.seek(0)
    loaded = torch.load(buffer)
    on_cpu = [k for k, v in loaded.items() if isinstance(v, torch.Tensor) and v.is_cpu]
    if on_cpu:
        raise AssertionError(f"torch.load gave {on_cpu[0]} on CPU, not tpu")
    fresh.module.load_state_dict(loaded)
    return fresh.state()


def _run(case: _Case, seed: int) -> dict[str, Any]:
    out = case.forward(seed)
    return {"forward": out, "backward": case.backward(out), "state": case.state()}


def _check_sample(info, module_input, training: bool, inplace: bool,
                  tol: tuple[float, float], result: Result) -> None:
    def build(device):
        return _Case(info, module_input, training, device, inplace)

    try:
        expected = _run(build("cpu"), 0)
        if not same(_run(build("cpu"), 1), expected):
            result.skipped += 1  # random: two CPU runs with different seeds differ
            return
    except Exception:
        result.skipped += 1  # fails on CPU too: not ours to count
        return
    where = f"[{module_input.desc or 'sample'}{', eval' if not training else ''}" \
            f"{', inplace' if inplace else ''}] "
    stage = "forward"
    try:
        case = build("tpu")
        out = case.forward(0)
        assert_same(out, expected["forward"], atol=tol[0], rtol=tol[1])
        stage = "backward"
        assert_same(case.backward(out), expected["backward"], atol=tol[0], rtol=tol[1])
        stage = "state"
        assert_same(case.state(), expected["state"], atol=tol[0], rtol=tol[1])
        stage = "state_dict"
        assert_same(_round_trip(case, build("tpu")), expected["state"], atol=tol[0],
                    rtol=tol[1])
    except Exception as exc:  # one broken module must not stop the run
        result.fail(exc, f"{stage} {where}")
        return
    result.passed += 1


def _takes_inplace(info) -> bool:
    return "inplace" in inspect.signature(info.module_cls.__init__).parameters


def _samples(info, dtype: torch.dtype) -> Iterator[tuple[Any, bool, bool]]:
    """(module input, training, inplace) for every sample the runner counts."""
    modes = (True, False) if info.train_and_eval_differ else (True,)
    inplace = (False, True) if _takes_inplace(info) else (False,)
    for training in modes:
        torch.manual_seed(0)
        inputs = info.module_inputs_func(info, device="cpu", dtype=dtype, requires_grad=True,
                                         training=training)
        for module_input in inputs:
            for variant in inplace:
                if variant and "inplace" in module_input.constructor_input.kwargs:
                    continue  # the sample chose already
                yield module_input, training, variant


def _interleaved(info, dtype: torch.dtype) -> Iterator[tuple[Any, bool, bool]]:
    """The samples with train/eval and in-place variants alternating, so a cap sees each."""
    groups: dict[tuple[bool, bool], list] = {}
    for sample in _samples(info, dtype):
        groups.setdefault(sample[1:], []).append(sample)
    lists = list(groups.values())
    for i in range(max((len(g) for g in lists), default=0)):
        for g in lists:
            if i < len(g):
                yield g[i]


def check_module(info, *, max_samples: int = 4, dtype: torch.dtype = torch.float32,
                 timeout: float = 60.0) -> Result:
    """Run up to max_samples counted samples of one ModuleInfo on tpu against CPU."""
    result = Result(info.name)
    reason = _skip_reason(info, dtype)
    if reason is not None:
        result.first_error = f"(skipped: {reason})"
        return result
    tol = _tolerance(info, dtype)

    def check(sample):
        _check_sample(info, *sample, tol, result)

    # Samples skipped on CPU do not use up the cap, but do bound the search.
    return conformance.check_samples(result, _interleaved(info, dtype), check,
                                     max_samples=max_samples, timeout=timeout,
                                     search=4 * max_samples)


def _module_db():
    from torch.testing._internal.common_modules import module_db

    return module_db


def run(modules: str | None = None, *, max_samples: int = 4,
        dtype: torch.dtype = torch.float32, timeout_per_module: float = 60.0,
        progress: TextIO | None = None) -> Report:
    """Check every ModuleInfo whose name (``nn.Linear``) or class name matches modules fully."""

    def names(info):
        return info.name, info.module_cls.__name__

    def check(info):
        return check_module(info, max_samples=max_samples, dtype=dtype,
                            timeout=timeout_per_module)

    results, seconds = conformance.run_each(_module_db(), names, check, modules, progress)
    return Report("modules", results, seconds, entries="ModuleInfos")


def main(argv: list[str] | None = None) -> int:
    parser = conformance.parser("python -m torchtpu.testing.modules", __doc__, "--modules", 4)
    args = parser.parse_args(argv)
    return conformance.finish(run(args.modules, max_samples=args.max_samples, dtype=args.dtype,
                                  timeout_per_module=args.timeout_per_op,
                                  progress=args.progress), args.top)


if __name__ == "__main__":
    sys.exit(main())
