"""``torchtpu.plan``: ``plan(model, inputs, chips=N, ...)``; ``python -m torchtpu.plan
script.py:make --chips N [--topology T] [--hbm GiB]``.

See ``torchtpu/tools/plan.py``.
"""

import sys

from torchtpu.tools.plan import Layout, Plan, format_plan, main, plan

__all__ = ["Layout", "Plan", "format_plan", "main", "plan"]

if __name__ == "__main__":
    sys.exit(main())
