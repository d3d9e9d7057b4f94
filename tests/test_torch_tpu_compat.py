"""The ``torch_tpu`` compatibility package: the reference's import names run on torchtpu."""

import subprocess
import sys

import pytest
import torch


def test_loader_and_api_as_ray_and_user_code_call_them():
    import torch_tpu._loader
    from torch_tpu.api import tpu_device

    torch_tpu._loader.load()
    assert torch_tpu._loader._LOADED
    assert torch_tpu._loader._init_device("tpu") == torch.device("tpu")
    device = tpu_device()
    assert device.type == "tpu" and device.index == torch.tpu.current_device()
    x = torch.arange(6.0, device=device)
    torch.testing.assert_close((x * 2).cpu(), torch.arange(6.0) * 2)
    with pytest.raises(ValueError, match="unknown device 'cuda'"):
        torch_tpu._loader._init_device("cuda")


def test_import_torch_tpu_alone_registers_the_device():
    code = ("import os; os.environ['TORCH_DEVICE_BACKEND_AUTOLOAD'] = '0'\n"
            "import torch, torch_tpu\n"
            "print((torch.ones(2, device='tpu') + 1).sum().item())")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         timeout=120, check=True).stdout
    assert out.strip().splitlines()[-1] == "4.0"


def test_submodules_forward_to_torch_tpu():
    import torch_tpu.ops
    from torch_tpu.pallas import jax_op

    assert jax_op is torch.tpu.pallas.jax_op
    assert torch_tpu.ops.optimization_barrier is torch.tpu.ops.optimization_barrier
    with pytest.raises(AttributeError):
        torch_tpu.pallas.no_such_name  # noqa: B018
