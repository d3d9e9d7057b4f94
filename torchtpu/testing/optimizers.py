"""OptimizerInfo conformance: PyTorch's own optimizer database run on tpu against CPU.

``python -m torchtpu.testing.optimizers [--optimizers REGEX] [--configs REGEX] [--max-samples N]
[--steps N]``
takes every OptimizerInfo in ``torch.testing._internal.common_optimizers.optim_db`` and each of
its configurations, with the implementation flags it supports (foreach, fused, differentiable)
and the configurations PyTorch reserves for CUDA (capturable, tensor learning rates and betas),
plus one configuration per LR scheduler list it names. Each configuration trains a small model
(a weight matrix and a bias) for a few steps on tpu and on CPU and compares the parameters and
the optimizer's state; then the tpu optimizer's ``state_dict`` goes through ``torch.save`` and
``torch.load`` into a fresh optimizer on a copy of the model, which takes one more step that
must match CPU's next one.

CPU runs the same configuration (PyTorch's refusal of capturable=True on CPU is a device check,
lifted for the reference), so a configuration that PyTorch itself cannot run is not counted
against tpu. The CPU fallback is an error. Not counted: configurations that raise on CPU, and
SparseAdam (sparse gradients only).
"""

from __future__ import annotations

import contextlib
import io
import re
import sys
from collections.abc import Iterator
from typing import Any, TextIO

import torch

import torchtpu  # noqa: F401  (registers the device)
from torchtpu.testing import conformance
from torchtpu.testing.compare import assert_same
from torchtpu.testing.conformance import Report, Result

_TOL = (1e-5, 1e-5)
# float32 (atol, rtol), measured. Three LBFGS steps are sixty inner iterations with line
# searches, which amplify rounding: CPU's and tpu's parameters are equally far from a float64
# run (2e-5), and its last flat gradient (up to 37 in size) differs between them by up to
# 6.5e-4. Muon orthogonalizes each update by Newton-Schulz iterations in bfloat16 (PyTorch's
# choice), where one rounding step is 7.8e-3: CPU's and XLA's bfloat16 matmuls round
# differently, up to 1.3e-2 relative on the parameters.
LOOSER = {"LBFGS": (1e-3, 1e-5), "Muon": (1e-3, 1.6e-2)}
# Optimizers that take matrices only.
_MATRICES_ONLY = {"Muon"}


def _configs(info) -> list[tuple[str, dict, list]]:
    """(description, optimizer kwargs, scheduler constructors) for every configuration."""
    from torch.testing._internal.common_optimizers import (
        _get_optim_inputs_including_global_cliquey_kwargs,
    )

    # As on CUDA: its configurations (capturable, tensor lr) and fused flags are the ones that
    # describe an accelerator, and tpu supports what CUDA does.
    inputs = _get_optim_inputs_including_global_cliquey_kwargs("cuda", torch.float32, info)
    configs = [(i.desc or "default", i.kwargs, []) for i in inputs]
    for schedulers in info.scheduler_inputs:
        if schedulers:
            names = ", ".join(_scheduler_name(s) for s in schedulers)
            configs.append((f"default with {names}", {}, list(schedulers)))
    return configs


def _scheduler_name(make) -> str:
    try:
        return type(make(torch.optim.SGD([torch.zeros(1, requires_grad=True)]))).__name__
    except Exception:
        return "scheduler"


def _move(value: Any, device: str) -> Any:
    if isinstance(value, torch.Tensor):
        return value.to(device)
    if isinstance(value, (tuple, list)):
        return type(value)(_move(v, device) for v in value)
    return value


class _Training:
    """A weight and a bias on one device, trained by one optimizer configuration."""

    def __init__(self, info, kwargs: dict, schedulers: list, device: str):
        gen = torch.Generator().manual_seed(0)
        self.leaves = [torch.randn(10, 5, generator=gen).to(device).requires_grad_(),
                       torch.randn(10, generator=gen).to(device).requires_grad_()]
        self.input = torch.randn(5, generator=gen).to(device)
        # differentiable=True steps non-leaf parameters, so that the update is differentiable
        # with respect to what they were computed from (the leaves).
        self.differentiable = bool(kwargs.get("differentiable"))
        self.weight, self.bias = self.leaves
        if self.differentiable:
            self.weight, self.bias = (t.clone() for t in self.leaves)
            self.weight.retain_grad()
            self.bias.retain_grad()
        self.has_bias = info.name not in _MATRICES_ONLY
        self.params = [self.weight, self.bias] if self.has_bias else [self.weight]
        self.info, self.kwargs, self.device = info, kwargs, device
        # Tensor hyperparameters follow the parameters, as a user would place them.
        self.optimizer = info.optim_cls(self.params, **_move(kwargs, device))
        self.schedulers = [make(self.optimizer) for make in schedulers]

    def loss(self) -> torch.Tensor:
        out = self.weight.mv(self.input)
        if self.has_bias:
            out = out + self.bias
        return out.pow(2).sum()

    def step(self) -> None:
        def closure():
            self.optimizer.zero_grad()
            loss = self.loss()
            # Later steps' losses reach the leaves through this step's update.
            loss.backward(retain_graph=self.differentiable)
            return loss

        if self.info.step_requires_closure:
            loss = self.optimizer.step(closure)
        else:
            loss = closure()
            self.optimizer.step()
        for scheduler in self.schedulers:
            if isinstance(scheduler, torch.optim.lr_scheduler.ReduceLROnPlateau):
                scheduler.step(loss.item())
            else:
                scheduler.step()

    def state(self) -> dict:
        """Copies of the parameters and the optimizer state; step counts as float tensors."""
        state = {}
        for i, p in enumerate(self.params):
            state[f"param{i}"] = p.detach().clone()
            for k, v in self.optimizer.state[p].items():
                if k == "step":
                    v = torch.as_tensor(v, dtype=torch.float32)
                if isinstance(v, torch.Tensor):
                    state[f"param{i}.{k}"] = v.detach().clone()
                elif isinstance(v, (int, float)):
                    # A tensor, so that the tolerance applies (LBFGS keeps losses as floats).
                    state[f"param{i}.{k}"] = torch.tensor(v, dtype=torch.float64)
        if self.differentiable:
            total = sum(p.sum() for p in self.params)
            through = torch.autograd.grad(total, self.leaves, retain_graph=True,
                                          allow_unused=True)
            state.update({f"d(params)/d(leaf{i})": g for i, g in enumerate(through)
                          if g is not None})
        return state

    def reloaded(self) -> _Training:
        """A fresh copy of the parameters and an optimizer loaded from a saved state_dict."""
        buffer = io.BytesIO()
        torch.save(self.optimizer.state_dict(), buffer)
        buffer.seek(0)
        copy = _Training(self.info, self.kwargs, [], self.device)
        with torch.no_grad():
            for mine, theirs in zip(copy.params, self.params):
                mine.copy_(theirs)
        copy.optimizer.load_state_dict(torch.load(buffer))
        return copy


@contextlib.contextmanager
def _capturable_on_cpu() -> Iterator[None]:
    """PyTorch refuses capturable=True on CPU by a device check alone; the reference lifts it,
    so CPU runs the very code path that tpu runs."""
    patched = []
    for name, module in list(sys.modules.items()):
        original = getattr(module, "_get_capturable_supported_devices", None)
        if name.startswith("torch.optim") and original is not None:
            patched.append((module, original))
            module._get_capturable_supported_devices = (
                lambda supports_xla=True, f=original: [*f(supports_xla), "cpu"])
    try:
        yield
    finally:
        for module, original in patched:
            module._get_capturable_supported_devices = original


def _check_config(info, desc: str, kwargs: dict, schedulers: list, steps: int,
                  result: Result) -> None:
    tol = LOOSER.get(info.name, _TOL)
    with _capturable_on_cpu():
        try:
            cpu = _Training(info, kwargs, schedulers, "cpu")
            expected = []
            for _ in range(steps):
                cpu.step()
                expected.append(cpu.state())
        except Exception:
            result.skipped += 1  # fails on CPU too: not ours to count
            return
        try:
            # The reference goes through the same round trip: a state that cannot be stepped
            # after loading (differentiable=True saves moments that require grad) is PyTorch's.
            again = cpu.reloaded()
            again.step()
            reloaded = again.state()
        except Exception:
            reloaded = None
    stage, where = "step", f"[{desc}] "
    try:
        tpu = _Training(info, kwargs, schedulers, "tpu")
        for i in range(steps):
            stage = f"step {i + 1}"
            tpu.step()
            assert_same(_cpu_state(tpu), expected[i], atol=tol[0], rtol=tol[1])
        if reloaded is not None:
            stage = "state_dict"
            again = tpu.reloaded()
            again.step()
            assert_same(_cpu_state(again), reloaded, atol=tol[0], rtol=tol[1])
    except Exception as exc:  # one broken configuration must not stop the run
        result.fail(exc, f"{stage} {where}")
        return
    result.passed += 1


def _cpu_state(training: _Training) -> dict:
    state = training.state()
    # PyTorch keeps some scalars (step counts, NAdam's mu_product) on CPU unless capturable.
    on_cpu = [k for k, v in state.items() if isinstance(v, torch.Tensor) and v.is_cpu
              and v.dim() > 0]
    if on_cpu:
        raise AssertionError(f"optimizer state {on_cpu[0]} is on CPU, not tpu")
    return {k: v.cpu() if isinstance(v, torch.Tensor) else v for k, v in state.items()}


def check_optimizer(info, *, max_samples: int = 100, steps: int = 3, configs: str | None = None,
                    timeout: float = 120.0) -> Result:
    """Run up to max_samples configurations of one OptimizerInfo on tpu against CPU (those
    whose description matches the regex configs fully, if given)."""
    result = Result(info.name)
    if info.only_supports_sparse_grads:
        result.first_error = "(skipped: sparse gradients only)"
        return result

    def chosen():
        for config in _configs(info):
            if configs is None or re.fullmatch(configs, config[0]):
                yield config

    def check(config):
        _check_config(info, *config, steps, result)

    return conformance.check_samples(result, chosen(), check, max_samples=max_samples,
                                     timeout=timeout)


def _optim_db():
    from torch.testing._internal.common_optimizers import optim_db

    return optim_db


def run(optimizers: str | None = None, *, max_samples: int = 100, steps: int = 3,
        configs: str | None = None, timeout_per_optimizer: float = 120.0,
        progress: TextIO | None = None) -> Report:
    """Check every OptimizerInfo whose class name (``AdamW``) matches optimizers fully."""

    def check(info):
        return check_optimizer(info, max_samples=max_samples, steps=steps, configs=configs,
                               timeout=timeout_per_optimizer)

    results, seconds = conformance.run_each(_optim_db(), lambda info: (info.name,), check,
                                            optimizers, progress)
    return Report("optimizers", results, seconds, entries="OptimizerInfos",
                  unit="configurations")


def main(argv: list[str] | None = None) -> int:
    parser = conformance.parser("python -m torchtpu.testing.optimizers", __doc__,
                                "--optimizers", 100, unit="configurations", timeout=120.0,
                                dtype=False)
    parser.add_argument("--steps", type=int, default=3, help="steps compared one by one")
    parser.add_argument("--configs", help="regex matched fully against configuration "
                                          "descriptions, e.g. 'capturable.*'")
    args = parser.parse_args(argv)
    return conformance.finish(run(args.optimizers, max_samples=args.max_samples,
                                  steps=args.steps, configs=args.configs,
                                  timeout_per_optimizer=args.timeout_per_op,
                                  progress=args.progress), args.top)


if __name__ == "__main__":
    sys.exit(main())
