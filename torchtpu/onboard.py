"""``torchtpu.onboard``: ``run(model, inputs)``; ``python -m torchtpu.onboard script.py:factory``.

See ``torchtpu/tools/onboard.py``.
"""

import sys

from torchtpu.tools.onboard import Report, format_report, main, run

__all__ = ["Report", "format_report", "main", "run"]

if __name__ == "__main__":
    sys.exit(main())
