"""``torchtpu.aot``: ``report(model, inputs, topology=...)``; ``python -m torchtpu.aot --topology
v5e:2x2 script.py:make``. A model's step compiled for a TPU with libtpu (compile-only) and
estimated; nothing runs on a TPU. See ``torchtpu/tools/aot.py``.
"""

import sys

from torchtpu.tools.aot import format_report, main, report
from torchtpu.tools.aot_step import AotReport

__all__ = ["AotReport", "format_report", "main", "report"]

if __name__ == "__main__":
    sys.exit(main())
