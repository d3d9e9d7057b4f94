"""``torch.tpu.profiler.TpuProfilerConfig``: what a profiler with ``ProfilerActivity.TPU`` also
writes, an XProf directory for TensorBoard / ``xprof --logdir``.

It is an ``experimental_config`` as PyTorch's profiler takes one (a subclass of its
``_ExperimentalConfig``, so PyTorch's own options keep working), carrying the JAX profiler's
levels and the directory the XProf runs go to.
"""

from __future__ import annotations

import os
import warnings

from torch._C._profiler import _ExperimentalConfig

# Where XProf runs go when run_dir is None, relative to the working directory.
DEFAULT_RUN_DIR = "tpu_profile"

_warned: list = []


def _level(name: str, value: int, allowed: range) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value not in allowed:
        raise ValueError(f"torchtpu.profiler: TpuProfilerConfig: {name} must be one of "
                         f"{list(allowed)}, "
                         f"not {value!r}")
    return value


class TpuProfilerConfig(_ExperimentalConfig):
    """XProf output for ``torch.profiler.profile(..., experimental_config=...)``.

    ``host_tracer_level``: 1 (critical), 2 (info) or 3 (verbose) host events; at least 1, since
    the device track is aligned to PyTorch's through a host annotation. ``device_tracer_level``:
    1 records the device's programs, 0 leaves the device track out. ``python_tracer_level``: 1
    also traces every Python call into the XProf run (slow). ``run_dir``: the TensorBoard log
    directory the run is written under (``<run_dir>/plugins/profile/<run>/*.xplane.pb``);
    None means ``./tpu_profile``. ``experimental_options``: passed to the JAX profiler's
    ``advanced_configuration``. Experimental: warns once.
    """

    def __init__(self, *, host_tracer_level: int = 2, device_tracer_level: int = 1,
                 python_tracer_level: int = 0, run_dir: str | os.PathLike | None = None,
                 experimental_options: dict | None = None, **torch_options) -> None:
        super().__init__(**torch_options)
        self.host_tracer_level = _level("host_tracer_level", host_tracer_level, range(1, 4))
        self.device_tracer_level = _level("device_tracer_level", device_tracer_level, range(2))
        self.python_tracer_level = _level("python_tracer_level", python_tracer_level, range(2))
        if run_dir is not None and not isinstance(run_dir, (str, os.PathLike)):
            raise TypeError(f"torchtpu.profiler: TpuProfilerConfig: run_dir must be a path or "
                            f"None, not {run_dir!r}")
        self.run_dir = os.fspath(run_dir) if run_dir is not None else None
        if experimental_options is not None and not isinstance(experimental_options, dict):
            raise TypeError("torchtpu.profiler: TpuProfilerConfig: experimental_options must be a "
                            "dict, not "
                            f"{experimental_options!r}")
        self.experimental_options = dict(experimental_options or {})
        if not _warned:
            _warned.append(True)
            warnings.warn("torchtpu.profiler: TpuProfilerConfig is experimental; its options "
                          "may change", UserWarning, stacklevel=2)

    def directory(self) -> str:
        """The TensorBoard log directory XProf runs are written under."""
        return os.path.abspath(self.run_dir if self.run_dir is not None else DEFAULT_RUN_DIR)

    def __repr__(self) -> str:
        return (f"TpuProfilerConfig(host_tracer_level={self.host_tracer_level}, "
                f"device_tracer_level={self.device_tracer_level}, "
                f"python_tracer_level={self.python_tracer_level}, run_dir={self.run_dir!r})")
