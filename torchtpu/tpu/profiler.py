"""``torch.tpu.profiler``: options for ``torch.profiler`` on device "tpu"."""

from torchtpu.profiler import TpuProfilerConfig, device_trace

__all__ = ["TpuProfilerConfig", "device_trace"]
