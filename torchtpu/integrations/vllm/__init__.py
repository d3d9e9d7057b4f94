"""vLLM on device "tpu": the out-of-tree platform plugin (entry point ``vllm.platform_plugins``).

vLLM calls :func:`register` while it picks its platform; returning a class path makes vLLM use
:class:`torchtpu.integrations.vllm.platform.TpuPlatform`, returning None leaves vLLM to its own
platforms. Nothing here imports vLLM until vLLM itself asks.

The platform is opt-in (``TORCHTPU_VLLM=1``): device "tpu" exists on every machine (XLA:CPU
where there is no accelerator), so an always-on plugin would take vLLM's CPU platform, and its
C++ kernels, away from every environment that has torchtpu installed.
"""

from __future__ import annotations

import os

PLATFORM = "torchtpu.integrations.vllm.platform.TpuPlatform"


def register() -> str | None:
    if os.environ.get("TORCHTPU_VLLM", "0") != "1":
        return None
    import torch

    import torchtpu  # noqa: F401  (registers device "tpu" and torch.tpu)

    if not torch.tpu.is_available():
        return None
    return PLATFORM
