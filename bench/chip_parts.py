"""A chip call's parts, each a process of its own within the call's budget, and what of them
comes back: ``serving_chip.py``'s and ``serving_extras.py``'s driver.

A part is ``script --part NAME --json PATH`` with the call's flags; its JSON (saved as it goes,
so a part stopped by its time limit leaves its results so far) and its log are written to
``--work``. :func:`publish` puts the call's summary and one archive of those files in ``--out``,
since a device call returns only a few files of its output folder.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tarfile
import time
from pathlib import Path


def run_part(part: str, args, env: dict, tag: str = "", *, script: str,
             extra: list[str] = (), reserve: float = 0.0) -> dict:
    """One part of ``script`` (``serving_chip.py`` or a sibling taking its flags) in a process of
    its own, within the call's ``--budget`` less ``reserve`` seconds (kept for later parts); its
    JSON. Its JSON and log go to ``--work``, not ``--out``: see :func:`publish`."""
    path = Path(args.work) / f"{part}{tag}.json"
    jax_batches = getattr(args, "jax_concurrency", None)
    cmd = [sys.executable, os.path.abspath(script), "--part", part, "--json", str(path),
           "--models", *args.models, "--models-dir", args.models_dir,
           "--shapes", *args.shapes, "--concurrency",
           *map(str, jax_batches if part == "jax" and jax_batches else args.concurrency),
           *(["--kv-bytes", str(args.kv_bytes)] if args.kv_bytes else []),
           *_diagnose_flag(part, getattr(args, "diagnose", None)),
           *extra]
    timeout = min(args.part_timeout, args.deadline - time.perf_counter() - reserve)
    if timeout < 10:
        print(f"{part}{tag}: skipped, the call's --budget is spent", flush=True)
        return {"rc": "skipped: budget", "seconds": 0.0, "result": {}}
    start = time.perf_counter()
    log = Path(args.work) / f"{part}{tag}.log"
    with open(log, "w") as f:
        try:
            rc = subprocess.run(cmd, env=env, stdout=f, stderr=subprocess.STDOUT,
                                timeout=timeout).returncode
        except subprocess.TimeoutExpired:  # its results so far are in its JSON
            rc = "timeout"
    seconds = time.perf_counter() - start
    result = json.loads(path.read_text()) if path.exists() else {}
    print(f"{part}{tag}: rc {rc}, {seconds:.0f} s", flush=True)
    return {"rc": rc, "seconds": seconds, "result": result}


def _diagnose_flag(part: str, diagnose: list[int] | None) -> list[str]:
    """``--diagnose`` and its concurrencies, for a vLLM part that was asked for it."""
    if diagnose is None or part != "vllm":
        return []
    return ["--diagnose", *map(str, diagnose)]


def publish(args, name: str, summary: dict) -> None:
    """``--out`` gets two files, rewritten after each part: ``{name}.json`` (the summary so
    far, every part's results in it) and ``{name}_logs.tar.gz`` (every part's JSON and log
    from ``--work``). A device call returns only a few files of its output folder (the first
    chip run of session 24 got 8: the vLLM part's JSON and log were not among them)."""
    out = Path(args.out)
    Path(out, f"{name}.json").write_text(json.dumps(summary, indent=1))
    part = Path(out, f"{name}_logs.tar.gz.part")
    with tarfile.open(part, "w:gz") as tar:
        for f in sorted(Path(args.work).iterdir()):
            if f.is_file():
                tar.add(f, arcname=f.name)
    part.replace(Path(out, f"{name}_logs.tar.gz"))
