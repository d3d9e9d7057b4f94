"""Where a compiled step's time goes, read from the TPU compiler's optimized HLO (compile-only).

For each instruction of the entry computation: what it is (a weight product, the vocabulary
head, the attention kernel, the sampler, a cache write, a prefetch, the rest), its HBM bytes (its
operands and results that live in HBM, not in VMEM: the memory space ``S(1)`` of a layout; a
prefetch ``copy-start``/``slice-start`` reads its HBM source once) and the compiler's own
``estimated_cycles``; grouped by kind, with the HBM rate the cycles imply at v5e's clock.

Two things the figures are read with (bench/RESULTS.md, serving6):
- libtpu's ``optimal_seconds`` is close to its "bytes accessed" over ~650 GB/s, and those bytes
  count a prefetched weight several times (the copy's read and write, then the product's read of
  its VMEM copy). The HBM bytes here count it once: the figure to hold against the roofline.
- ``estimated_cycles`` is a per-instruction schedule estimate, without the overlap of prefetches
  and compute; it is far off for layout-changing copies of large arrays (a transposing cache copy
  of 75 MB: 3 ms) and gives Mosaic kernels (the paged attention) none.

    python bench/step_breakdown.py DUMP.hlo.txt [--top 12] [--json out.json]
"""

from __future__ import annotations

import argparse
import json
import math
import re
from collections import defaultdict

CLOCK_HZ = 1.5e9  # v5e: 197 TFLOP/s of bf16 from 4 MXUs of 128 x 128 (131,072 flops a cycle)
HBM_BYTES_S = 819e9
_BYTES = {"pred": 1, "s8": 1, "u8": 1, "f8e4m3fn": 1, "f8e5m2": 1, "bf16": 2, "f16": 2,
          "s16": 2, "u16": 2, "f32": 4, "s32": 4, "u32": 4, "f64": 8, "s64": 8, "u64": 8}
_ARRAY = re.compile(r"\b(\w+)\[([\d,]*)\](\{[^}]*\})?")
_LINE = re.compile(r"^\s*(?:ROOT )?%([\w.\-]+) = (.+?) ([a-z][a-z\-]*)\((.*)$")
_NO_MOVE = {"parameter", "constant", "get-tuple-element", "tuple", "bitcast", "copy-done",
            "slice-done", "after-all", "partition-id", "replica-id"}
KINDS = ("weight products", "vocab head", "attention kernel", "sampler", "cache writes",
         "prefetch", "layout copies", "other")


def _arrays(text: str) -> list[tuple[int, bool]]:
    """(bytes, in VMEM) of each array type in an HLO result type."""
    out = []
    for dtype, dims, layout in _ARRAY.findall(text):
        if dtype in _BYTES:
            size = _BYTES[dtype] * math.prod(int(d) for d in dims.split(",") if d)
            out.append((size, "S(1)" in (layout or "")))
    return out


def _operands(args: str) -> list[str]:
    """The instruction names an HLO call reads, in order (up to its closing parenthesis)."""
    depth, end = 1, len(args)
    for i, ch in enumerate(args):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0:
            end = i
            break
    return re.findall(r"%([\w.\-]+)", args[:end])


def _computations(hlo: str) -> dict[str, list[str]]:
    """Each computation's instruction lines, by name (``fused_computation.12``, ``main.4``)."""
    out, name = {}, None
    for line in hlo.splitlines():
        head = re.match(r"^(?:ENTRY )?%?([\w.\-]+) .*\{$", line)
        if head and not line.startswith(" "):
            name = head.group(1)
            out[name] = []
        elif name and line.startswith("  "):
            out[name].append(line)
    return out


def _row(line: str) -> dict | None:
    m = _LINE.match(line)
    if not m:
        return None
    cycles = re.search(r'"estimated_cycles":"(\d+)"', line)
    source = re.search(r'op_name="([^"]*)"', line)
    target = re.search(r'custom_call_target="([^"]*)"', line)
    calls = re.search(r"calls=%([\w.\-]+)", line)
    param = re.match(r"(\d+)\)", m.group(4))
    return {"name": m.group(1), "op": m.group(3), "type": m.group(2),
            "result": _arrays(m.group(2)), "operands": _operands(m.group(4)),
            "cycles": int(cycles.group(1)) if cycles else 0,
            "source": source.group(1) if source else "",
            "target": target.group(1) if target else "", "calls": calls and calls.group(1),
            "param": int(param.group(1)) if m.group(3) == "parameter" and param else None}


def _indexed(body: list[dict]) -> tuple[dict, int | None]:
    """What a fused computation reads of each parameter it only slices or updates in place
    ({index: bytes}: the slices' bytes, 0 for an updated one), and the bytes its in-place
    updates write (None when it updates nothing in place)."""
    rows = {r["name"]: r for r in body}
    params = {r["name"]: r["param"] for r in body if r["op"] == "parameter"}
    uses: dict[str, list] = {n: [] for n in params}
    updates = None
    for r in body:
        for i, operand in enumerate(r["operands"]):
            if operand in uses:
                uses[operand].append((r, i))
        if r["op"] in ("dynamic-update-slice", "scatter"):
            update = rows.get(r["operands"][1 if r["op"] == "dynamic-update-slice" else -1])
            updates = (updates or 0) + sum(s for s, _ in update["result"]) if update else updates
    out = {}
    for name, index in params.items():
        if uses[name] and all(i == 0 and r["op"] in ("dynamic-slice", "gather",
                                                     "dynamic-update-slice", "scatter")
                              for r, i in uses[name]):
            out[index] = sum(sum(s for s, _ in r["result"]) for r, _ in uses[name]
                             if r["op"] in ("dynamic-slice", "gather"))
    return out, updates


def instructions(hlo: str) -> list[dict]:
    """The entry computation's instructions: name, op, result bytes and memory space, operands,
    estimated cycles, the JAX op they came from, the custom call's target, and for a fusion
    what it reads of each parameter it only slices (``indexed``) and what its in-place updates
    write (``updates``)."""
    comps = _computations(hlo)
    entry = next((n for n in comps if hlo.find(f"ENTRY %{n} ") >= 0), None)
    rows = [r for r in map(_row, comps.get(entry, [])) if r]
    by_name = {r["name"]: r for r in rows}
    for r in rows:
        r["indexed"], r["updates"] = {}, None
        if r["op"] == "fusion":
            r["indexed"], r["updates"] = _indexed(
                [b for b in map(_row, comps.get(r["calls"] or "", [])) if b])
        elif r["op"] in ("dynamic-slice", "gather"):
            r["indexed"] = {0: sum(s for s, _ in r["result"])}
        elif r["op"] in ("dynamic-update-slice", "scatter"):
            update = by_name.get(r["operands"][1 if r["op"] == "dynamic-update-slice" else -1])
            r["indexed"], r["updates"] = {0: 0}, sum(s for s, _ in update["result"]) \
                if update else 0
    return rows


def _hbm_bytes(row: dict, by_name: dict) -> int:
    """Bytes the instruction moves to or from HBM: its HBM operands read and HBM results
    written; a prefetch's start reads its source (its VMEM destination is no HBM write); a
    slice or in-place update of an operand moves the slice or the update only; the paged
    kernel's pages (its largest operand) are left to ``serving_aot.kernel_kv_bytes``."""
    if row["op"] in _NO_MOVE:
        return 0
    if row["op"] in ("copy-start", "slice-start"):
        # (destination in VMEM, source, context): the part it copies is the destination's size
        return sum(size for size, vmem in row["result"] if vmem)
    sizes = []
    for i, name in enumerate(row["operands"]):
        src = by_name.get(name)
        hbm = 0 if src is None or src["op"] == "constant" else \
            sum(size for size, vmem in src["result"] if not vmem)
        sizes.append(min(hbm, row["indexed"].get(i, hbm)))
    if row["target"] == "tpu_custom_call" and sizes:
        sizes.remove(max(sizes))
    written = sum(size for size, vmem in row["result"] if not vmem)
    if row["updates"] is not None:
        written = min(written, row["updates"])
    return sum(sizes) + written


def _source_param(name: str, by_name: dict, depth: int = 0):
    """The entry parameter an operand is (through prefetches, bitcasts and the prefetch's
    concatenating custom call), or None."""
    row = by_name.get(name)
    if row is None or depth > 6:
        return None
    if row["op"] == "parameter":
        return row
    if row["op"] in ("copy-done", "slice-done", "copy-start", "slice-start", "bitcast",
                     "get-tuple-element") or (row["op"] == "custom-call"
                                              and row["target"] != "tpu_custom_call"):
        for operand in row["operands"]:
            found = _source_param(operand, by_name, depth + 1)
            if found is not None:
                return found
    return None


def classify(rows: list[dict], vocab: int, weight_min: int) -> list[dict]:
    """Each row with its ``kind`` (one of KINDS), ``hbm_bytes`` and ``weight_bytes`` (the
    weight parameters it reads, for products)."""
    by_name = {r["name"]: r for r in rows}
    vocab_re = re.compile(rf"\[(?:[\d,]*,)?{vocab}(?:,[\d,]*)?\]")
    for r in rows:
        r["hbm_bytes"] = _hbm_bytes(r, by_name)
        # an operand the fusion only slices (the embedding's row) is a lookup, no product
        weights = {p["name"]: sum(s for s, _ in p["result"]) for p in
                   (_source_param(o, by_name) for i, o in enumerate(r["operands"])
                    if i not in r["indexed"]) if p is not None}
        weights = {n: b for n, b in weights.items() if b >= weight_min}
        r["weight_bytes"] = 0
        src = r["source"]
        if r["op"] == "custom-call" and r["target"] == "tpu_custom_call":
            r["kind"] = "attention kernel"
        elif r["op"] in ("copy-start", "copy-done", "slice-start", "slice-done") or (
                r["op"] == "custom-call" and weights):
            r["kind"] = "prefetch"
        elif weights and ("dot_general" in src or "convolution" in r["name"]
                          or "multiply_reduce" in r["name"]):
            r["weight_bytes"] = sum(weights.values())
            r["kind"] = "vocab head" if vocab_re.search(r["type"]) else "weight products"
        elif vocab_re.search(r["type"]):
            r["kind"] = "sampler"
        elif r["updates"] is not None:  # an in-place update of an operand: the cache's row
            r["kind"] = "cache writes"
        elif r["op"] in ("copy", "transpose"):
            r["kind"] = "layout copies"
        else:
            r["kind"] = "other"
    return rows


def summary(rows: list[dict]) -> dict:
    """Per kind: instructions, estimated cycles and their ms at v5e's clock, HBM bytes, the
    weights read, and the HBM rate the cycles imply."""
    out = defaultdict(lambda: {"count": 0, "cycles": 0, "hbm_bytes": 0, "weight_bytes": 0})
    for r in rows:
        k = out[r["kind"]]
        k["count"] += 1
        k["cycles"] += r["cycles"]
        k["hbm_bytes"] += r["hbm_bytes"]
        k["weight_bytes"] += r["weight_bytes"]
    for k in out.values():
        k["ms"] = k["cycles"] / CLOCK_HZ * 1e3
        k["hbm_ms"] = k["hbm_bytes"] / HBM_BYTES_S * 1e3
        # a product reads its weight from the VMEM copy a prefetch made: its rate is the weight's
        moved = max(k["hbm_bytes"], k["weight_bytes"])
        k["gb_s"] = moved / (k["cycles"] / CLOCK_HZ) / 1e9 if k["cycles"] and moved else None
    return {kind: dict(out[kind]) for kind in KINDS if kind in out}


def breakdown(hlo: str, vocab: int, weight_min: int = 1 << 20, top: int = 12) -> dict:
    """The step's summary by kind, its totals and its ``top`` instructions by cycles."""
    rows = classify(instructions(hlo), vocab, weight_min)
    kinds = summary(rows)
    total = {k: sum(r[k] for r in rows) for k in ("cycles", "hbm_bytes", "weight_bytes")}
    total["ms"] = total["cycles"] / CLOCK_HZ * 1e3
    total["hbm_ms"] = total["hbm_bytes"] / HBM_BYTES_S * 1e3
    biggest = sorted(rows, key=lambda r: -r["cycles"])[:top]
    return {"kinds": kinds, "total": total,
            "top": [{k: r[k] for k in ("name", "op", "kind", "cycles", "hbm_bytes",
                                        "weight_bytes")} | {"type": r["type"][:80]}
                    for r in biggest]}


def table(b: dict) -> str:
    """Markdown rows of a breakdown's kinds."""
    lines = ["| kind | ops | est. cycles (M) | at 1.5 GHz (ms) | HBM bytes (MB) | "
             "at 819 GB/s (ms) | weights read (MB) | rate the cycles imply (GB/s) |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for kind, k in [*b["kinds"].items(), ("total", b["total"] | {"count": "", "gb_s": None})]:
        rate = f"{k['gb_s']:.0f}" if k.get("gb_s") else "-"
        lines.append(f"| {kind} | {k['count']} | {k['cycles'] / 1e6:.3f} | {k['ms']:.3f} | "
                     f"{k['hbm_bytes'] / 1e6:.1f} | {k['hbm_ms']:.3f} | "
                     f"{k.get('weight_bytes', 0) / 1e6:.1f} | {rate} |")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("hlo", help="an optimized HLO dump (TORCHTPU_TPU_DUMP's *.hlo.txt)")
    ap.add_argument("--vocab", type=int, default=151936)
    ap.add_argument("--top", type=int, default=12)
    ap.add_argument("--json")
    args = ap.parse_args(argv)
    with open(args.hlo) as f:
        b = breakdown(f.read(), args.vocab, top=args.top)
    print(table(b))
    for r in b["top"]:
        print(f"  {r['cycles']:>10,} {r['kind']:16s} {r['op']:12s} {r['name'][:34]:34s} "
              f"{r['hbm_bytes'] / 1e6:8.1f} MB  {r['type'][:60]}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(b, f, indent=1)
    return b


if __name__ == "__main__":
    main()
