"""``torch.profiler`` on device "tpu": a device track of program runs, aligned with PyTorch's
host events, in the Chrome trace, and an XProf run with ``TpuProfilerConfig``.

Layers: ``session`` (one profiling window: the JAX trace and the launch observer), ``xplane``
(reading program runs from the JAX profile), ``chrome`` (merging into PyTorch's Chrome trace),
``hooks`` (wiring these into ``torch.autograd.profiler.profile``), ``config``.
"""

from torchtpu.profiler.config import TpuProfilerConfig
from torchtpu.profiler.hooks import device_trace, install

__all__ = ["TpuProfilerConfig", "device_trace", "install"]
