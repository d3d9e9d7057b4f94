"""``python -m torchtpu.doctor [--json]``: see ``torchtpu/tools/doctor.py``."""

import sys

from torchtpu.tools.doctor import main, run

__all__ = ["main", "run"]

if __name__ == "__main__":
    sys.exit(main())
