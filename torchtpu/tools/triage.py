"""Log triage: a traceback or a log in, the glossary category, the likely cause and the fix out.

``triage(text)`` reads what a failed run printed. Every torchtpu message starts with its
category (``torchtpu.fallback: ...``), so each one found is looked up in the glossary
(``torchtpu.errors.GLOSSARY``); failures that come from below torchtpu without its prefix (XLA's
out-of-memory, a backward before the device was registered, a rank that died, PyTorch/XLA names
with no torch_xla installed) are matched by their own words and given the category they belong
to. The *primary* finding is the exception a traceback ends with when it is one of those, else
the last error-like line found; the traceback's innermost frame outside torch, JAX and torchtpu
is the user line it names. ``python -m torchtpu.diagnose --log FILE [--json]`` prints it.
"""

from __future__ import annotations

import re
from dataclasses import asdict, dataclass, field
from pathlib import Path

from torchtpu import errors
from torchtpu.commands import ToolError

MAX_BYTES = 64 << 20

# Failures without a torchtpu prefix: (pattern, category, likely cause, fix).
KNOWN: list[tuple[re.Pattern, str, str, str]] = [(re.compile(p, re.I), c, cause, fix) for p, c,
                                                  cause, fix in [
    (r"RESOURCE_EXHAUSTED|out of memory|\bOOM\b", "device",
     "the device ran out of memory (XLA's allocator could not place a buffer)",
     "shrink the batch or the model, use bfloat16 (torch.autocast('tpu')), shard with FSDP2, or "
     "check torch.tpu.memory_summary() for what is live"),
    (r"not linked with support for tpu devices", "device",
     "a tpu tensor was used before torchtpu registered the device (TORCH_DEVICE_BACKEND_AUTOLOAD=0 "
     "without `import torchtpu`)",
     "import torchtpu first, or leave TORCH_DEVICE_BACKEND_AUTOLOAD unset"),
    (r"No module named '?torch_xla", "unsupported",
     "a PyTorch/XLA script, and no torch_xla is installed",
     "python -m torchtpu.integrations.torch_xla.install (docs, PyTorch/XLA scripts) makes "
     "`import torch_xla` run on torchtpu"),
    (r"DistBackendError|timed out|Connection (closed|reset) by peer", "distributed",
     "a rank died or did not answer within the process group's timeout",
     "look at the other ranks' logs for the first failure; check that every rank started and "
     "calls the same collectives (init_process_group(timeout=) bounds the wait)"),
    (r"CollectiveMismatchError", "distributed",
     "ranks called different collectives (op, shape, dtype or order differ)",
     "make every rank call the same collectives in the same order"),
    (r"Unable to initialize backend|No visible (TPU|GPU|XLA) devices|failed to open libtpu",
     "device", "JAX could not open the accelerator (another process holds it, or its runtime "
     "is missing)", "python -m torchtpu.doctor; stop other processes on the chip, or "
     "TORCHTPU_PLATFORM=cpu to run on the host"),
]]
_PREFIXED = re.compile(r"torchtpu\.([a-z]+): (.*)")
_FINAL = re.compile(r"^([A-Za-z_][\w.]*(?:Error|Exception|Warning|Interrupt|Exit)): ?(.*)$")
_FRAME = re.compile(r'^\s*File "([^"]+)", line (\d+), in (.+)$')
_LIBRARY = re.compile(r"site-packages|dist-packages|/torchtpu/|/torch/|/jax/|/jaxlib/|<frozen")


@dataclass
class Finding:
    category: str
    message: str
    line: int                 # 1-based line of the log
    cause: str
    fix: str


@dataclass
class Triage:
    primary: Finding | None
    exception: str | None     # the type a traceback ends with
    user_frame: str | None    # file:line in function, the innermost outside the libraries
    findings: list = field(default_factory=list)

    def to_dict(self) -> dict:
        return asdict(self)


def _frames(lines: list[str]) -> str | None:
    user = None
    for i, line in enumerate(lines):
        m = _FRAME.match(line)
        if m and not _LIBRARY.search(m.group(1)):
            code = lines[i + 1].strip() if i + 1 < len(lines) else ""
            user = f"{m.group(1)}:{m.group(2)} in {m.group(3)}" + (f": {code}" if code else "")
    return user


def _finding(line: str, n: int) -> Finding | None:
    prefixed = _PREFIXED.search(line)
    if prefixed and prefixed.group(1) in errors.GLOSSARY:
        entry = errors.GLOSSARY[prefixed.group(1)]
        return Finding(prefixed.group(1), line.strip(), n, entry.cause, entry.fix)
    for pattern, category, cause, fix in KNOWN:
        if pattern.search(line):
            return Finding(category, line.strip(), n, cause, fix)
    return None


def triage(text: str) -> Triage:
    """The findings of a log (see the module)."""
    lines = text.splitlines()
    findings, seen = [], set()
    for n, line in enumerate(lines, 1):
        found = _finding(line, n)
        if found and (found.category, found.message) not in seen:
            seen.add((found.category, found.message))
            findings.append(found)
    finals = [(n, m) for n, line in enumerate(lines, 1) if (m := _FINAL.match(line.strip()))]
    exception = finals[-1][1].group(1) if finals else None
    primary = None
    if finals:
        at = finals[-1][0]
        primary = next((f for f in findings if f.line == at), None)
    if primary is None and findings:
        primary = findings[-1]
    return Triage(primary, exception, _frames(lines), findings)


def read_log(path: str | Path) -> str:
    """The text of a log file; ToolError for one that is missing, empty, too big or binary."""
    file = Path(path)
    if not file.is_file():
        raise ToolError(f"log {path} does not exist")
    if file.stat().st_size > MAX_BYTES:
        raise ToolError(f"log {path} is over {MAX_BYTES >> 20} MiB; pass its last part "
                        "(tail -n 2000)")
    data = file.read_bytes()
    if b"\0" in data[:4096]:
        raise ToolError(f"{path} is not a text log (it holds NUL bytes)")
    text = data.decode("utf-8", errors="replace")
    if not text.strip():
        raise ToolError(f"log {path} is empty")
    return text


def format_triage(t: Triage) -> str:
    if t.primary is None:
        head = ["no torchtpu category found in the log"
                + (f" (it ends with {t.exception})" if t.exception else "")
                + "; search the docs (python -m torchtpu.tools.docs_search ...) or run "
                "python -m torchtpu.doctor"]
    else:
        p = t.primary
        head = [f"category: torchtpu.{p.category} (log line {p.line})",
                f"  message: {p.message}", f"  likely cause: {p.cause}", f"  fix: {p.fix}"]
    if t.user_frame:
        head.append(f"  at your line: {t.user_frame}")
    others = [f for f in t.findings if f is not t.primary]
    if others:
        head.append("also in the log:")
        head += [f"- torchtpu.{f.category} (line {f.line}): {f.message[:160]}" for f in others]
    return "\n".join(head)
