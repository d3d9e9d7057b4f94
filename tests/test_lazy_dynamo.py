"""``import torch`` does not import Dynamo; "tpu" is registered the moment Dynamo is imported."""

import subprocess
import sys

import pytest


def _run(code: str) -> str:
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True).stdout.strip()


def test_import_torch_leaves_dynamo_unloaded():
    assert _run("import sys, torch; torch.ones(1, device='tpu');"
                "print('torch._dynamo' in sys.modules)") == "False"


@pytest.mark.parametrize("first", ["import torch._dynamo", "import torchtpu.compile.backend"])
def test_registered_once_dynamo_loads(first):
    out = _run(
        f"import torch; {first}\n"
        "from torch._dynamo.backends.registry import list_backends\n"
        "from torch._dynamo.device_interface import get_interface_for_device\n"
        "print('tpu' in list_backends(), get_interface_for_device('tpu').__name__)\n"
        "m = torch.nn.Linear(3, 2).to('tpu'); x = torch.randn(4, 3, device='tpu')\n"
        # against CPU: a lowering wrong in eager and compiled alike must not pass
        "ref = torch.nn.functional.linear(x.cpu(), m.weight.cpu(), m.bias.cpu())\n"
        "print(torch.allclose(torch.compile(m)(x).cpu(), ref, atol=1e-6))\n"
    )
    assert out.splitlines() == ["True TpuInterface", "True"]
