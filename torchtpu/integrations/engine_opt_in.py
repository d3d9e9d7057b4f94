"""Which serving engines run on device "tpu": the opt-in the vLLM and SGLang plugins share.

Device "tpu" exists on every machine (XLA:CPU where there is no accelerator), so a plugin on
whenever torchtpu is installed would take the engine's own CPU platform, and its C++ kernels,
away from every environment that has torchtpu in it. An engine's plugin is on where its installer
(``python -m torchtpu.integrations.<engine>.install``, the documented way to install the extra)
marked the environment, as installing vllm-torchtpu selects it; its variable
(``TORCHTPU_VLLM``, ``TORCHTPU_SGLANG``) turns it on (``1``) or off (``0``) anywhere.
"""

from __future__ import annotations

import logging
import sys
from pathlib import Path

from torchtpu import settings

log = logging.getLogger(__name__)


def marker(engine: str) -> Path:
    """The file an engine's installer writes: this environment's engine runs on "tpu"."""
    return Path(sys.prefix) / "etc" / "torchtpu" / f"{engine.lower()}-platform-tpu"


def enabled(setting: settings.Flag, marked: Path) -> bool:
    """Whether the engine should run on device "tpu" here (the variable, else the marker)."""
    value = setting.get()
    return marked.exists() if value is None else value


def platform_if_enabled(engine: str, setting: settings.Flag, marked: Path,
                        platform: str) -> str | None:
    """An engine's platform hook: platform (its class path) where the engine is opted in and a
    tpu device exists, else None (the engine keeps its own platforms)."""
    if not enabled(setting, marked):
        return None
    import torch

    import torchtpu  # noqa: F401  (registers device "tpu" and torch.tpu)

    if not torch.tpu.is_available():
        return None
    # Named, not probed: asking JAX which platform starts its backend, and an engine probes its
    # platform in child processes too (vLLM's model inspection), where the chip's one owner is
    # the parent: libtpu refuses a second process and the engine would fall back to its own.
    wanted = settings.PLATFORM.get() or "TPU, else GPU, else CPU"
    log.info("torchtpu: %s runs on device 'tpu' (PJRT platform: %s); %s=0 gives %s's own "
             "platforms", engine, wanted, setting.name, engine)
    return platform


def mark(engine: str, setting: settings.Flag, marked: Path) -> None:
    """Opt this environment's engine in (its installer's last step)."""
    marked.parent.mkdir(parents=True, exist_ok=True)
    marked.write_text(f"{engine} in this environment runs on torchtpu's device 'tpu' "
                      f"({setting.name}=0 overrides)\n")
    print(f"{engine} here now runs on device 'tpu' ({marked}; {setting.name}=0 overrides)")
