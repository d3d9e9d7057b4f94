"""The manifest of a chip pack (bench/tpu_vllm.sh, bench/tpu_sglang.sh): a line a distribution,
``GROUP NAME==VERSION TOP...``, its top-level files and folders from its RECORD, read from the
venv this runs in (its files are what is carried).

    python bench/pack_manifest.py [--check-index] INDEX_NAME... -- CARRIED_NAME...

An INDEX_NAME is installed there from the machine's index (group ``index``), a CARRIED_NAME
travels (group ``carried``). A name may pin the version the index holds (``pillow==12.3.0``),
else the venv's is written. ``--check-index``: each INDEX_NAME's venv version must be
in this workplace's copy of the machine's index (/opt/pypi/simple), refused here rather than
found missing there.
"""

from __future__ import annotations

import importlib.metadata as md
import os
import re
import sys

INDEX = "/opt/pypi/simple"


def _in_index(dist) -> bool:
    folder = os.path.join(INDEX, re.sub(r"[-_.]+", "-", dist.name).lower())
    page = os.path.join(folder, "index.html")
    files = re.findall(r">([^<]+)</a>", open(page).read()) if os.path.exists(page) else []
    stem = re.sub(r"[-_.]+", "_", dist.name).lower() + "-" + dist.version + "-"
    return any(f.lower().startswith(stem) for f in files)


def main(argv: list[str]) -> None:
    check = argv[:1] == ["--check-index"]
    group = "index"
    for name in argv[1:] if check else argv:
        if name == "--":
            group = "carried"
            continue
        dist = md.distribution(name.split("==")[0])
        if check and group == "index" and not _in_index(dist):
            sys.exit(f"{dist.name}=={dist.version} is not in {INDEX}: carry it")
        tops = sorted({str(f).split("/")[0] for f in dist.files or []
                       if not str(f).startswith(("..", "bin/")) and "__pycache__" not in str(f)})
        print(group, name if "==" in name else f"{dist.name}=={dist.version}", *tops)


if __name__ == "__main__":
    main(sys.argv[1:])
