"""SGLang on device "tpu": the out-of-tree platform plugin (entry point ``sglang.srt.platforms``).

SGLang (0.5.23) resolves ``sglang.srt.platforms.current_platform`` by calling every installed
plugin of that group; one that returns a class path makes SGLang use
:class:`torchtpu.integrations.sglang.platform.TpuSRTPlatform` (``--device tpu``), None leaves
SGLang to its own platforms. Nothing here imports SGLang until SGLang itself asks.

As with vLLM (``torchtpu.integrations.vllm``), device "tpu" exists on every machine, so the
plugin is on only where SGLang was installed for it:
``python -m torchtpu.integrations.sglang.install`` marks the environment (``MARKER``);
``TORCHTPU_SGLANG=1`` turns it on anywhere, ``0`` off.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

PLATFORM = "torchtpu.integrations.sglang.platform.TpuSRTPlatform"
# written by install.py: this environment's SGLang was installed to run on device "tpu"
MARKER = Path(sys.prefix) / "etc" / "torchtpu" / "sglang-platform-tpu"

log = logging.getLogger(__name__)


def enabled() -> bool:
    """Whether SGLang should run on device "tpu" here (``TORCHTPU_SGLANG``, else ``MARKER``)."""
    setting = os.environ.get("TORCHTPU_SGLANG", "").strip()
    if setting not in ("", "0", "1"):
        raise ValueError(f"torchtpu.config: TORCHTPU_SGLANG={setting!r} is not 0 or 1")
    return setting == "1" if setting else MARKER.exists()


def activate() -> str | None:
    """SGLang's platform hook: the platform's class path, or None to leave SGLang's own."""
    if not enabled():
        return None
    import torch

    import torchtpu  # noqa: F401  (registers device "tpu" and torch.tpu)

    if not torch.tpu.is_available():
        return None
    from torchtpu.runtime import platform

    log.info("torchtpu: SGLang runs on device 'tpu' (PJRT platform %s); TORCHTPU_SGLANG=0 gives "
             "SGLang's own platforms", platform.platform())
    return PLATFORM
