"""The ModuleInfo conformance runner: common torch.nn modules must pass, and its checks catch a
module whose forward, gradients or state differ on tpu."""

import re

import pytest
import torch
from torch.testing import make_tensor
from torch.testing._internal.common_modules import FunctionInput, ModuleInfo, ModuleInput

from torchtpu.testing import modules

# A capped subset for the default suite (the GRU and more LSTM variants are in test_rnn.py).
COMMON_MODULES = [
    "nn.Linear", "nn.Conv2d", "nn.BatchNorm2d", "nn.LayerNorm", "nn.Embedding", "nn.ReLU",
    "nn.GELU", "nn.CrossEntropyLoss", "nn.LSTM",
]


def test_common_modules_pass():
    pattern = "|".join(re.escape(name) for name in COMMON_MODULES)
    report = modules.run(pattern, max_samples=2)
    table = report.format()
    assert {r.name for r in report.results} == set(COMMON_MODULES), table
    assert report.failed == 0, table
    assert all(r.passed > 0 for r in report.results), table


class _Differs(torch.nn.Module):
    """Differs on tpu where the stage says: the output, the gradient or a buffer."""

    stage = "forward"

    def __init__(self, inplace=False):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.ones(3))
        self.register_buffer("steps", torch.zeros(()))
        self.inplace = inplace

    def forward(self, x):
        tpu = x.device.type == "tpu"
        if self.training:
            self.steps += 1 + (tpu and self.stage == "state")
        y = x.mul_(2) if self.inplace else x * 2
        if tpu and self.stage == "backward":
            y = y + (self.weight - self.weight.detach()) * 2  # same value, twice the gradient
        return y * self.weight + (tpu and self.stage == "forward")


def _inputs(info, device, dtype, requires_grad, training, **kwargs):
    x = make_tensor((3,), device=device, dtype=dtype, requires_grad=requires_grad)
    return [ModuleInput(FunctionInput(), FunctionInput(x))]


@pytest.mark.parametrize("stage", ["forward", "backward", "state", "none"])
def test_runner_finds_the_stage_that_differs(stage, monkeypatch):
    monkeypatch.setattr(_Differs, "stage", stage)
    result = modules.check_module(ModuleInfo(_Differs, module_inputs_func=_inputs))
    # Two samples: the module as built, and with inplace=True on a non-leaf copy of x.
    if stage == "none":
        assert (result.passed, result.failed, result.errored) == (2, 0, 0), result
    else:
        assert (result.passed, result.failed) == (0, 2), result
        assert result.first_error.startswith(f"{stage} [sample] AssertionError"), result
