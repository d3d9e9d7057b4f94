"""One home per op (issue 36): an op's rules live in its lowering record, and only
``registration.py`` registers anything with PyTorch."""

import subprocess
import sys

_IMPORT_REGISTERS_NOTHING = """
import torch
import torchtpu.lowering
from torchtpu import registration

has = torch._C._dispatch_has_kernel_for_dispatch_key
declared = [("aten::geqrf", "Meta"), ("aten::_fused_sgd_", "Meta"),
            ("aten::_thnn_fused_gru_cell", "Meta"), ("aten::equal", "PrivateUse1"),
            ("aten::rrelu_with_noise", "PrivateUse1")]
assert not registration._state["loaded"]
before = [k for k in declared if has(*k)]
registration.ensure_loaded()
after = [k for k in declared if has(*k)]
print(before, len(after) == len(declared))
"""


def test_importing_the_lowering_modules_registers_nothing():
    # A fresh process: the suite's own has long loaded the device.
    out = subprocess.run([sys.executable, "-c", _IMPORT_REGISTERS_NOTHING], capture_output=True,
                         text=True, timeout=300, check=True).stdout
    assert out.split("\n")[-2] == "[] True", out
