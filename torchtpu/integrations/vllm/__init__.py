"""vLLM on device "tpu": the out-of-tree platform plugin (entry point ``vllm.platform_plugins``).

vLLM calls :func:`register` while it picks its platform; returning a class path makes vLLM use
:class:`torchtpu.integrations.vllm.platform.TpuPlatform`, returning None leaves vLLM to its own
platforms. Nothing here imports vLLM until vLLM itself asks.

Which platform: device "tpu" exists on every machine (XLA:CPU where there is no accelerator), so
a plugin on whenever torchtpu is installed would take vLLM's CPU platform, and its C++ kernels,
away from every environment that has torchtpu in it. So the plugin is on where vLLM was installed
for it: ``python -m torchtpu.integrations.vllm.install`` (the documented way to install the
``vllm`` extra) marks the environment (``MARKER``), as installing vllm-torchtpu selects it.
``TORCHTPU_VLLM=1`` turns it on anywhere, ``TORCHTPU_VLLM=0`` off. vLLM logs "Platform plugin
torchtpu is activated" when it is chosen; :func:`register` logs on which PJRT platform.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

PLATFORM = "torchtpu.integrations.vllm.platform.TpuPlatform"
# written by install.py: this environment's vLLM was installed to run on device "tpu"
MARKER = Path(sys.prefix) / "etc" / "torchtpu" / "vllm-platform-tpu"

log = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether vLLM should run on device "tpu" here (``TORCHTPU_VLLM``, else ``MARKER``)."""
    setting = os.environ.get("TORCHTPU_VLLM", "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"torchtpu.config: TORCHTPU_VLLM={setting!r} is not 0 or 1")
    return setting == "1" if setting else MARKER.exists()


def register() -> str | None:
    if not enabled():
        return None
    import torch

    import torchtpu  # noqa: F401  (registers device "tpu" and torch.tpu)

    if not torch.tpu.is_available():
        return None
    from torchtpu.runtime import platform

    log.info("torchtpu: vLLM runs on device 'tpu' (PJRT platform %s); TORCHTPU_VLLM=0 gives "
             "vLLM's own platforms", platform.platform())
    return PLATFORM
