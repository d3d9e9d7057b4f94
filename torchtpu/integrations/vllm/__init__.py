"""vLLM on device "tpu": the out-of-tree platform plugin (entry point ``vllm.platform_plugins``).

vLLM calls :func:`register` while it picks its platform; returning a class path makes vLLM use
:class:`torchtpu.integrations.vllm.platform.TpuPlatform`, returning None leaves vLLM to its own
platforms. Nothing here imports vLLM until vLLM itself asks.

Which platform: vLLM's own unless this environment opted in (``engine_opt_in.py``: the marker
``python -m torchtpu.integrations.vllm.install`` writes, or ``TORCHTPU_VLLM=1``; ``0`` turns it
off). vLLM logs "Platform plugin torchtpu is activated" when it is chosen; :func:`register` logs
on which PJRT platform.
"""

from __future__ import annotations

from torchtpu import settings
from torchtpu.integrations import engine_opt_in

PLATFORM = "torchtpu.integrations.vllm.platform.TpuPlatform"
# written by install.py: this environment's vLLM was installed to run on device "tpu"
MARKER = engine_opt_in.marker("vllm")


def enabled() -> bool:
    """Whether vLLM should run on device "tpu" here (``TORCHTPU_VLLM``, else ``MARKER``)."""
    return engine_opt_in.enabled(settings.VLLM, MARKER)


def register() -> str | None:
    """vLLM's platform hook: the platform's class path, or None to leave vLLM's own."""
    return engine_opt_in.platform_if_enabled("vLLM", settings.VLLM, MARKER, PLATFORM)
