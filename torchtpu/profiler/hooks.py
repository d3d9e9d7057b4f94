"""Plugging the device trace into PyTorch's profiler, which a Python backend cannot extend
otherwise (its PrivateUse1 hooks, ``ProfilerStubs`` and Kineto's ``IActivityProfiler``, are
C++ only).

``install()`` wraps three methods of ``torch.autograd.profiler.profile``, the object behind both
``torch.profiler.profile`` and the legacy ``torch.autograd.profiler.profile(use_device="tpu",
use_kineto=True)``,
for profilers whose device is "tpu" (``ProfilerActivity.TPU``, PyTorch's renamed
``PrivateUse1``); other profilers run PyTorch's code untouched:
- ``_start_trace``: a ``session.Window`` starts before PyTorch's collection does;
- ``__exit__``: after PyTorch stops (it waits for the device first), the window stops and its
  device trace is kept on the profiler;
- ``export_chrome_trace``: the device trace is merged into the file PyTorch wrote (``chrome.py``);
- ``_parse_kineto_results``: the events behind ``key_averages()`` and ``events()`` get the
  device times (``events.py``).
``schedule`` and ``tensorboard_trace_handler`` go through these too, one window per cycle.
"""

from __future__ import annotations

import threading

import torch.autograd.profiler as autograd_profiler
from torch._C._profiler import ProfilerState

from torchtpu.profiler import chrome, events, session
from torchtpu.profiler.config import TpuProfilerConfig

_lock = threading.Lock()
_installed: list = []


def _is_tpu(prof) -> bool:
    return getattr(prof, "use_device", None) == "tpu" and prof.enabled


def device_trace(prof) -> session.DeviceTrace | None:
    """The device trace of a finished profiler's last window (None without the TPU activity)."""
    inner = getattr(prof, "profiler", prof)  # torch.profiler.profile wraps the autograd one
    return getattr(inner, "_tpu_trace", None)


def _device() -> tuple[str, int]:
    from torchtpu.runtime import platform

    device = platform.local_device()
    return device.platform, device.id


def install() -> None:
    with _lock:
        if _installed:
            return
        cls = autograd_profiler.profile
        start_trace, exit_, export = cls._start_trace, cls.__exit__, cls.export_chrome_trace
        parse = cls._parse_kineto_results

        def _start_trace(self):
            window = None
            if _is_tpu(self):
                if self.profiler_kind == ProfilerState.KINETO_PRIVATEUSE1_FALLBACK:
                    raise RuntimeError(
                        "torchtpu.profiler: torch.autograd.profiler.profile(use_device='tpu') "
                        "needs "
                        "use_kineto=True: without it PyTorch asks C++ profiler stubs that a "
                        "Python backend cannot register (torch.profiler.profile uses Kineto)")
                config = self.experimental_config
                window = session.Window(config if isinstance(config, TpuProfilerConfig)
                                        else None)
                window.start()
            self._tpu_window = window
            try:
                return start_trace(self)
            except BaseException:
                if window is not None:
                    self._tpu_window = None
                    window.abort()
                raise

        def __exit__(self, exc_type, exc_val, exc_tb):
            try:
                return exit_(self, exc_type, exc_val, exc_tb)
            finally:
                window = getattr(self, "_tpu_window", None)
                if window is not None:
                    self._tpu_window = None
                    self._tpu_trace = window.stop()

        def export_chrome_trace(self, path, metadata=None, use_python_export=False):
            trace = getattr(self, "_tpu_trace", None)
            if trace is not None:
                try:
                    open(path, "a").close()
                except OSError as e:
                    raise type(e)(e.errno, "torch.profiler: cannot write the Chrome trace "
                                  f"({e.strerror}); export to a path you can write",
                                  str(path)) from None
            out = export(self, path, metadata, use_python_export)
            if trace is not None:
                chrome.merge(path, trace, *_device())
            return out

        def _parse_kineto_results(self, result, *args, **kwargs):
            parsed = parse(self, result, *args, **kwargs)
            trace = getattr(self, "_tpu_trace", None)
            if trace is None:
                return parsed
            return events.add_device_times(parsed, trace, result.trace_start_ns(),
                                           self.use_device)

        export_chrome_trace.__doc__ = export.__doc__
        cls._start_trace = _start_trace
        cls.__exit__ = __exit__
        cls.export_chrome_trace = export_chrome_trace
        cls._parse_kineto_results = _parse_kineto_results
        _installed.append((start_trace, exit_, export, parse))
