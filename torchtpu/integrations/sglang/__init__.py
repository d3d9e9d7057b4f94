"""SGLang on device "tpu": the out-of-tree platform plugin (entry point ``sglang.srt.platforms``).

SGLang (0.5.23) resolves ``sglang.srt.platforms.current_platform`` by calling every installed
plugin of that group; one that returns a class path makes SGLang use
:class:`torchtpu.integrations.sglang.platform.TpuSRTPlatform` (``--device tpu``), None leaves
SGLang to its own platforms. Nothing here imports SGLang until SGLang itself asks.

As with vLLM, SGLang keeps its own platforms unless this environment opted in
(``engine_opt_in.py``: the marker ``python -m torchtpu.integrations.sglang.install`` writes, or
``TORCHTPU_SGLANG=1``; ``0`` turns it off).
"""

from __future__ import annotations

from torchtpu import settings
from torchtpu.integrations import engine_opt_in

PLATFORM = "torchtpu.integrations.sglang.platform.TpuSRTPlatform"
# written by install.py: this environment's SGLang was installed to run on device "tpu"
MARKER = engine_opt_in.marker("sglang")


def enabled() -> bool:
    """Whether SGLang should run on device "tpu" here (``TORCHTPU_SGLANG``, else ``MARKER``)."""
    return engine_opt_in.enabled(settings.SGLANG, MARKER)


def activate() -> str | None:
    """SGLang's platform hook: the platform's class path, or None to leave SGLang's own."""
    return engine_opt_in.platform_if_enabled("SGLang", settings.SGLANG, MARKER, PLATFORM)
