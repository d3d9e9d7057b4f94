"""``torchtpu.tune``: ``tune(target, trials=N, budget=S)``; ``python -m torchtpu.tune
script.py:make [--trials N] [--budget S] [--topology T] [--json]``.

See ``torchtpu/tools/tune.py``.
"""

import sys

from torchtpu.tools.tune import Trial, TuneReport, format_report, main, run_setting, tune

__all__ = ["Trial", "TuneReport", "format_report", "main", "run_setting", "tune"]

if __name__ == "__main__":
    sys.exit(main())
