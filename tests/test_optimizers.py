"""The OptimizerInfo conformance runner: common optimizers in every implementation must pass, and
its checks catch a wrong step and a state_dict that does not survive the round trip."""

import pytest
import torch
from torch.testing._internal.common_optimizers import OptimizerInfo, OptimizerInput

from torchtpu.testing import optimizers

# A capped subset for the default suite: the default configuration in each implementation
# (for-loop, foreach, differentiable, fused), capturable, and an LR scheduler.
COMMON = "SGD|Adam|Adagrad"
CONFIGS = r"default( & \w+)?|capturable( & \w+)?|default with StepLR.*"


def test_common_optimizers_pass():
    report = optimizers.run(COMMON, configs=CONFIGS)
    table = report.format()
    assert {r.name for r in report.results} == set(COMMON.split("|")), table
    assert report.failed == 0, table
    assert all(r.passed >= 4 for r in report.results), table


class _Broken(torch.optim.SGD):
    """SGD that goes wrong on tpu where ``stage`` says."""

    stage = "step"

    def step(self, closure=None):
        super().step(closure)
        p = self.param_groups[0]["params"][0]
        if p.device.type == "tpu" and self.stage == "step":
            with torch.no_grad():
                p.add_(1e-3)

    def load_state_dict(self, state_dict):
        super().load_state_dict(state_dict)
        buf = self.state[self.param_groups[0]["params"][0]]["momentum_buffer"]
        if buf.device.type == "tpu" and self.stage == "state_dict":
            buf.zero_()


def _info():
    return OptimizerInfo(_Broken, optim_inputs_func=lambda device, dtype=None: [
        OptimizerInput(None, {"lr": 0.1, "momentum": 0.9}, "momentum")],
        supported_impls=(), scheduler_inputs=([],))


@pytest.mark.parametrize("stage", ["step", "state_dict", "none"])
def test_runner_finds_the_stage_that_differs(stage, monkeypatch):
    monkeypatch.setattr(_Broken, "stage", stage)
    result = optimizers.check_optimizer(_info())
    if stage == "none":
        assert (result.passed, result.failed, result.errored) == (1, 0, 0), result
    else:
        assert (result.passed, result.failed) == (0, 1), result
        prefix = "step 1" if stage == "step" else "state_dict"
        assert result.first_error.startswith(f"{prefix} [momentum] AssertionError"), result
