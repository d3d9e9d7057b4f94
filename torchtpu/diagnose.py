"""``torchtpu.diagnose.step(fn, *args)``: where a training step's time goes;
``python -m torchtpu.diagnose script.py:factory`` or ``--log FILE`` (a failed run's log triaged).

See ``torchtpu/tools/diagnose.py``.
"""

import sys

from torchtpu.tools.diagnose import Diagnosis, format_report, main, step

__all__ = ["Diagnosis", "format_report", "main", "step"]

if __name__ == "__main__":
    sys.exit(main())
