"""``torch.tpu.tools``: the tools' Python API (``torchtpu/tools/``), loaded on first use."""

from torchtpu.tools.diagnose import step as diagnose_step
from torchtpu.tools.doctor import run as doctor
from torchtpu.tools.onboard import run as onboard

__all__ = ["diagnose_step", "doctor", "onboard"]
