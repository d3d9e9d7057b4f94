"""Plain-text tables and figures for the tools' reports to people (programs get JSON)."""

from __future__ import annotations


def size(nbytes: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(nbytes) < 1024 or unit == "GiB":
            return f"{nbytes:.0f} {unit}" if unit == "B" else f"{nbytes:.1f} {unit}"
        nbytes /= 1024
    raise AssertionError("unreachable")


def table(headers: list, rows: list, width: int = 100) -> list:
    """Lines of a left-aligned table; cells longer than width are cut with "..."."""
    cells = [[str(h) for h in headers]] + [
        [s if len(s) <= width else s[:width - 3] + "..." for s in map(str, r)] for r in rows]
    widths = [max(len(r[i]) for r in cells) for i in range(len(headers))]
    lines = ["  " + "  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in cells]
    lines.insert(1, "  " + "  ".join("-" * w for w in widths))
    return lines
