"""``torch_tpu._internal``: the reference's internal module names that its documentation and
scripts import (``execution_mode``, ``pallas``, ``sync``, ``profiler``, the single-host launcher),
each mapped onto torchtpu. Owns nothing."""
