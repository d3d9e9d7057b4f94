"""``torchtpu.diagnose.step(fn, *args)``: where a training step's time goes.

See ``torchtpu/tools/diagnose.py``.
"""

from torchtpu.tools.diagnose import Diagnosis, format_report, step

__all__ = ["Diagnosis", "format_report", "step"]
