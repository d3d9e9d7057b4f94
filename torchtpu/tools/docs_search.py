"""Questions about torchtpu answered from its own documentation, with citations.

The corpus is torchtpu's documentation: the README and, in a checkout, the pages of ``docs/``
(one section per heading, and one per bullet of a long bulleted section such as "What works", so
a citation names the feature, and one per row of a table, so it names the setting), the error
glossary (``torchtpu.errors.GLOSSARY``, one entry per category), ``tools/SKILL.md`` and every
module's docstring. ``search(query)`` ranks sections by BM25 over their words (no network, no
model; the index is built once per process, in well under a second) and cites each hit by file,
section and line. A question is *covered* when the best section holds the terms that carry at
least half of the query's weight (rare words weigh most, words no section has weigh the most),
so a question about something torchtpu does not document comes back ``covered: false`` with the
nearest sections, instead of a confident wrong answer.
``python -m torchtpu.tools.docs_search "question" [--json]`` prints the same.
"""

from __future__ import annotations

import functools
import importlib.metadata
import json
import math
import re
import sys
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

from torchtpu import errors
from torchtpu.commands import ToolError
from torchtpu.commands import main as tool_main

PACKAGE = Path(__file__).resolve().parents[1]
README = PACKAGE.parent / "README.md"
DOCS = PACKAGE.parent / "docs"  # the documentation pages (a checkout's; a wheel has none)
COVERED_SHARE = 0.5
_K1, _B = 1.2, 0.75
_WORD = re.compile(r"[a-z0-9_]+")
_DOCSTRING = re.compile(r'\A(?:\s*#[^\n]*\n)*\s*[rR]?"""(.*?)"""', re.S)
_STOP = frozenset(
    "a an and are as at be by can do does for from has have how i if in into is it its me my "
    "no not of on or so than that the their them then there these this to use used uses using "
    "was what when where which while who why will with without you your".split())


@dataclass
class Section:
    source: str     # file, relative to the package's parent (README.md, torchtpu/errors.py)
    title: str      # the section path ("Distributed: tpu_dist > Collectives")
    line: int       # the line of its file that text starts at
    text: str


def words(text: str) -> list[str]:
    """Lower-case word tokens without stop words; a plural's trailing s is dropped."""
    out = []
    for w in _WORD.findall(text.lower()):
        if w in _STOP or len(w) < 2:
            continue
        out.append(w[:-1] if len(w) > 3 and w.endswith("s") and not w.endswith("ss") else w)
    return out


def _readme_text() -> str | None:
    if README.is_file():
        return README.read_text()
    try:  # an installed wheel carries the README as its long description
        meta = importlib.metadata.metadata("torchtpu")
    except importlib.metadata.PackageNotFoundError:
        return None
    return meta.get("Description") or meta.get_payload() or None


def _bullet_title(bullet: str) -> str:
    bold = re.match(r"- \*\*(.+?)\*\*", bullet)
    return (bold.group(1) if bold else bullet[2:60]).strip(" .:")


def _row(lines: list[str], i: int) -> bool:
    """Whether lines[i] is a table's data row (not its header, which no row precedes, nor the
    row of dashes under it)."""
    line = lines[i]
    return (line.startswith("|") and i > 0 and lines[i - 1].startswith("|")
            and not re.fullmatch(r"[|\s:-]+", line))


def _row_title(row: str) -> str:
    return row.strip("|").split("|")[0].replace("`", "").strip()


def markdown_sections(text: str, source: str) -> list[Section]:
    """One section per heading; a section of top-level bullets gives one per bullet too, and
    a table one per row (titled by its first cell: a setting, an error category)."""
    out: list[Section] = []
    path: list[str] = []
    body: list[str] = []
    start = 1
    in_code = False

    def close() -> None:
        title = " > ".join(path) or source
        firsts = [i for i, line in enumerate(body) if line.startswith("- ") or _row(body, i)]
        intro = body[:firsts[0]] if firsts else body
        if any(line.strip() for line in intro):
            out.append(Section(source, title, start + 1, "\n".join(intro)))
        for a, b in zip(firsts, [*firsts[1:], len(body)]):
            if not _row(body, a):  # a bullet, with the lines that continue it
                out.append(Section(source, f"{title} > {_bullet_title(body[a])}",
                                   start + a + 1, "\n".join(body[a:b])))
                continue
            out.append(Section(source, f"{title} > {_row_title(body[a])}", start + a + 1,
                               body[a]))
            if any(line.strip() for line in body[a + 1:b]):  # text after the table
                out.append(Section(source, title, start + a + 2, "\n".join(body[a + 1:b])))

    for n, line in enumerate(text.splitlines(), 1):
        if line.startswith("```"):
            in_code = not in_code
        heading = re.match(r"(#{1,4}) (.+)", line) if not in_code else None
        if heading:
            close()
            level = len(heading.group(1))
            path[:] = path[:max(0, level - 2)] + [heading.group(2).replace("`", "").strip()]
            body, start = [], n
        else:
            body.append(line)
    close()
    return out


def _docstring_sections() -> list[Section]:
    out = []
    for file in sorted(PACKAGE.rglob("*.py")):
        try:  # the leading string literal alone: a full parse of every module takes seconds
            found = _DOCSTRING.match(file.read_text())
        except UnicodeDecodeError:
            continue
        if found and found.group(1).strip():
            rel = file.relative_to(PACKAGE.parent).as_posix()
            out.append(Section(rel, "module docstring", 1, found.group(1).strip()))
    return out


def _glossary_sections() -> list[Section]:
    source = (PACKAGE / "errors.py").read_text().splitlines()
    out = []
    for name, entry in errors.GLOSSARY.items():
        line = next((i for i, s in enumerate(source, 1) if s.strip().startswith(f'"{name}":')), 1)
        out.append(Section("torchtpu/errors.py", f"glossary: torchtpu.{name}", line,
                           f"torchtpu.{name} error category. Cause: {entry.cause} "
                           f"Fix: {entry.fix}"))
    return out


class Index:
    """BM25 over sections."""

    def __init__(self, sections: list[Section]) -> None:
        self.sections = sections
        self.counts = [Counter(words(f"{s.title} {s.title} {s.text}")) for s in sections]
        self.lengths = [sum(c.values()) for c in self.counts]
        self.mean = sum(self.lengths) / max(1, len(self.lengths))
        frequency: Counter = Counter()
        for c in self.counts:
            frequency.update(c.keys())
        n = len(sections)
        self.idf = {w: math.log(1 + (n - f + 0.5) / (f + 0.5)) for w, f in frequency.items()}
        self.unknown = math.log(1 + (n + 0.5) / 0.5)  # a word no section has

    def score(self, i: int, terms: list[str]) -> float:
        c, total = self.counts[i], 0.0
        norm = _K1 * (1 - _B + _B * self.lengths[i] / self.mean)
        for w in terms:
            if w in c:
                total += self.idf[w] * c[w] * (_K1 + 1) / (c[w] + norm)
        return total

    def weight(self, w: str) -> float:
        return self.idf.get(w, self.unknown)


@functools.cache
def index() -> Index:
    sections = []
    readme = _readme_text()
    if readme:
        sections += markdown_sections(readme, "README.md")
    for page in sorted(DOCS.glob("*.md")) if DOCS.is_dir() else ():
        sections += markdown_sections(page.read_text(), f"docs/{page.name}")
    skill = PACKAGE / "tools" / "SKILL.md"
    if skill.is_file():
        sections += markdown_sections(skill.read_text(), "torchtpu/tools/SKILL.md")
    return Index(sections + _glossary_sections() + _docstring_sections())


def _excerpt(text: str, terms: dict[str, float], width: int = 320) -> tuple[int, str]:
    """(offset of the line, the text from there) for the first line whose terms weigh most."""
    lines = text.splitlines()
    filled = [i for i, line in enumerate(lines) if line.strip()]
    if not filled:
        return 0, ""
    best = max(filled, key=lambda i: (sum(terms.get(w, 0) for w in set(words(lines[i]))), -i))
    out = " ".join(line.strip() for line in lines[best:best + 4] if line.strip())
    return best, out if len(out) <= width else out[:width].rsplit(" ", 1)[0] + " ..."


def search(query: str, top: int = 5) -> dict:
    """The sections that answer query, best first, each cited; ``covered`` says whether any does."""
    if not isinstance(query, str) or not query.strip():
        raise ToolError("docs search needs a question or some keywords")
    if top < 1:
        raise ToolError(f"top must be at least 1, got {top}")
    idx = index()
    terms = list(dict.fromkeys(words(query)))
    if not terms:
        raise ToolError(f"{query!r} has no words to search for (only stop words)")
    weight = sum(idx.weight(w) for w in terms)

    def share_of(i: int) -> float:
        return sum(idx.weight(w) for w in terms if w in idx.counts[i]) / weight

    # BM25 weighed by the share of the question's weight a section holds: BM25 alone lets a
    # short section that repeats one term outrank the section that holds every term.
    scored = sorted(((idx.score(i, terms) * share_of(i), i)
                     for i in range(len(idx.sections))), reverse=True)
    hits = [(s, i) for s, i in scored[:top] if s > 0]
    share = share_of(hits[0][1]) if hits else 0.0
    results = []
    for s, i in hits:
        sec = idx.sections[i]
        offset, excerpt = _excerpt(sec.text, {w: idx.weight(w) for w in terms})
        line = sec.line + offset
        results.append({"source": sec.source, "title": sec.title, "line": line,
                        "citation": f"{sec.source}:{line} ({sec.title})",
                        "score": round(s, 3), "excerpt": excerpt})
    covered = share >= COVERED_SHARE
    missing = [w for w in terms if w not in idx.idf]
    note = ("" if covered else
            "not covered by torchtpu's documentation"
            + (f" (no section mentions {', '.join(missing)})" if missing else "")
            + ("; the nearest sections are listed" if results else ""))
    return {"query": query, "covered": covered, "matched_share": round(share, 3),
            "results": results, "note": note}


def format_result(found: dict) -> str:
    lines = [f"{'covered' if found['covered'] else found['note']}: {found['query']!r}"]
    for r in found["results"]:
        lines.append(f"- {r['citation']}")
        lines.append(f"    {r['excerpt']}")
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    import argparse

    parser = argparse.ArgumentParser(prog="python -m torchtpu.tools.docs_search",
                                     description="search torchtpu's own documentation")
    parser.add_argument("query", nargs="+")
    parser.add_argument("--top", type=int, default=5)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)

    def run() -> int:
        found = search(" ".join(args.query), args.top)
        print(json.dumps(found, indent=1) if args.json else format_result(found))
        return 0

    return tool_main(run)


if __name__ == "__main__":
    sys.exit(main())
