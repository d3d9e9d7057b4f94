"""``torch_tpu._internal.profiler``: ``torch.tpu.profiler``'s names."""

from torchtpu.tpu.profiler import *  # noqa: F403
from torchtpu.tpu.profiler import __all__  # noqa: F401
