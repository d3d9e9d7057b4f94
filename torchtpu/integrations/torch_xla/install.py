"""``python -m torchtpu.integrations.torch_xla.install [--target DIR] [--uninstall]``.

Makes ``import torch_xla`` resolve to torchtpu's PyTorch/XLA layer, as an opt-in step (the
torchtpu wheel itself never takes the name): it writes a stub package ``torch_xla/__init__.py``
into site-packages (or ``--target DIR``, any folder on ``sys.path``) whose only work is
``alias.take_over()``. It cannot sit beside a real PyTorch/XLA (both are ``torch_xla``), so it
refuses where one is installed or importable, and ``--uninstall`` removes only its own stub
(marked by ``MARK``). Problems print one ``torchtpu.tool:`` line and exit 2.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import importlib.util
import shutil
import sys
import sysconfig
from pathlib import Path

from torchtpu.commands import ToolError
from torchtpu.commands import main as tool_main

MARK = "# torchtpu: PyTorch/XLA names on torchtpu (torchtpu.integrations.torch_xla.install)"
STUB = f'''{MARK}
"""torch_xla resolves to torchtpu.integrations.torch_xla (torchtpu's PyTorch/XLA layer)."""
from torchtpu.integrations.torch_xla import alias as _alias

_alias.take_over(__name__)
'''


def _ours(init: Path) -> bool:
    return init.is_file() and init.read_text().startswith(MARK)


def real_torch_xla() -> str | None:
    """Where a real PyTorch/XLA is (its distribution or an importable non-stub), or None."""
    for name in ("torch-xla", "torch_xla"):
        try:
            dist = importlib.metadata.distribution(name)
        except importlib.metadata.PackageNotFoundError:
            continue
        return f"the {dist.metadata['Name']} {dist.version} distribution"
    spec = importlib.util.find_spec("torch_xla") if "torch_xla" not in sys.modules else None
    if spec is not None and spec.origin and not _ours(Path(spec.origin)):
        return spec.origin
    return None


def install(target: Path) -> Path:
    """Write the stub into target; its path. ToolError where a real torch_xla is."""
    real = real_torch_xla()
    init = target / "torch_xla" / "__init__.py"
    if real is not None:
        raise ToolError(f"a real PyTorch/XLA is installed ({real}): torchtpu's layer takes the "
                        "same import name and cannot sit beside it; use one or the other "
                        "(pip uninstall torch_xla first)")
    if init.parent.exists() and not _ours(init):
        raise ToolError(f"{init.parent} exists and is not torchtpu's stub; remove it first")
    init.parent.mkdir(parents=True, exist_ok=True)
    init.write_text(STUB)
    return init


def uninstall(target: Path) -> Path | None:
    """Remove torchtpu's stub from target (nothing else); its folder, None if there was none."""
    folder = target / "torch_xla"
    if not folder.exists():
        return None
    if not _ours(folder / "__init__.py"):
        raise ToolError(f"{folder} is not torchtpu's stub (a real PyTorch/XLA?); not removing it")
    shutil.rmtree(folder)
    return folder


def main(argv: list | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m torchtpu.integrations.torch_xla.install",
                                     description="make `import torch_xla` run on torchtpu")
    parser.add_argument("--target", type=Path, default=Path(sysconfig.get_paths()["purelib"]),
                        help="folder on sys.path to write torch_xla/ into (default: "
                             "site-packages)")
    parser.add_argument("--uninstall", action="store_true", help="remove torchtpu's stub")
    args = parser.parse_args(argv)

    def run() -> int:
        if args.uninstall:
            folder = uninstall(args.target)
            print(f"removed {folder}" if folder else f"no torch_xla stub in {args.target}")
        else:
            print(f"wrote {install(args.target)}: `import torch_xla` now runs on torchtpu")
        return 0

    return tool_main(run)


if __name__ == "__main__":
    sys.exit(main())
