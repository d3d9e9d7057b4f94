"""Two compiled steps' optimized programs side by side, instruction by instruction (compile-only).

The whole step and its JAX twin (``bench/aot_llama.py --dump DIR``: each program's optimized HLO)
name their fusions differently and hold their arrays in different ranks ((b * t, n) against (b,
t, n)), so they are matched here by what an instruction does, not by its name: its step part
(``layout_bisect._part``: attention, MLP, head, loss, norms, optimizer, told by the shapes it
touches), its kind (a product, a reduction, a layout copy, a custom call, the rest), and the
element counts of its result and operands (rank- and layout-free). Per signature: how many
instructions and their estimated cycles on each side; printed largest difference first, with
each side's largest instruction of that signature (its name, and for ours the ATen op it came
from). The TPU compiler gives Mosaic kernels (the splash attention) no cycles: both sides call
the same kernel, so the comparison is of everything around it.

    python bench/fusion_diff.py OURS.hlo.txt TWIN.hlo.txt [--top 25] [--json out.json]
"""

from __future__ import annotations

import argparse
import collections
import json
import math
import os
import re
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import layout_bisect  # noqa: E402  (bench/ is no package)
import step_breakdown  # noqa: E402

_DIMS = re.compile(r"\b(?:pred|[a-z]+\d+)\[([\d,]*)\]")


def _shapes(type_text: str) -> list[tuple]:
    return [tuple(int(d) for d in dims.split(",") if d) for dims in _DIMS.findall(type_text)]


def _kind(row: dict, bodies: dict) -> str:
    body = " ".join(bodies.get(row["calls"] or "", [])) if row["op"] == "fusion" else ""
    if row["op"] in ("convolution", "dot") or " convolution(" in body or " dot(" in body:
        return "product"
    if row["op"] == "custom-call":
        return f"custom-call {row['target']}"
    if row["op"] in ("reduce", "reduce-window") or " reduce(" in body:
        return "reduction"
    if row["op"] in ("copy", "transpose", "copy-start") or (
            body and not re.search(r" (?!copy|transpose|bitcast|parameter)[a-z\-]+\(", body)):
        return "layout copy"
    return row["op"] if row["op"] != "fusion" else "pointwise"


def signatures(hlo: str) -> list[dict]:
    """Each entry instruction with estimated cycles: its part, kind, signature and source."""
    bodies = step_breakdown._computations(hlo)
    rows = step_breakdown.instructions(hlo)
    shape_of = {r["name"]: _shapes(r["type"]) for r in rows}
    out = []
    for r in rows:
        if not r["cycles"]:
            continue
        result = shape_of[r["name"]]
        operands = [s for o in r["operands"] for s in shape_of.get(o, [])]
        kind = _kind(r, bodies)
        part = layout_bisect._part(kind == "product", kind.startswith("custom"),
                                   result + operands)
        counts = (tuple(sorted(math.prod(s) for s in result)),
                  tuple(sorted((math.prod(s) for s in operands), reverse=True)[:3]))
        aten = re.search(r"jit\((aten_\w+?)(?:_default|_Tensor|_Scalar)?\)", r["source"])
        out.append({"name": r["name"], "part": part, "kind": kind, "counts": counts,
                    "cycles": r["cycles"], "aten": aten.group(1) if aten else "",
                    "type": r["type"].split("{")[0][:60]})
    return out


def _m(n: int) -> float:
    return round(n / 1e6, 3)


def compare(ours: str, twin: str, top: int = 25) -> dict:
    """Parts and signatures of two optimized programs, with their estimated M cycles."""
    sides = {"ours": signatures(ours), "twin": signatures(twin)}
    parts = {side: collections.Counter() for side in sides}
    groups: dict = collections.defaultdict(lambda: {s: [0, 0, None] for s in sides})
    for side, rows in sides.items():
        for r in rows:
            parts[side][r["part"]] += r["cycles"]
            g = groups[(r["part"], r["kind"], r["counts"])][side]
            g[0], g[1] = g[0] + 1, g[1] + r["cycles"]
            if g[2] is None or r["cycles"] > g[2]["cycles"]:
                g[2] = r
    rows = sorted(groups.items(), key=lambda kv: -abs(kv[1]["ours"][1] - kv[1]["twin"][1]))
    return {
        "total": {s: _m(sum(parts[s].values())) for s in sides},
        "parts": {p: {s: _m(parts[s][p]) for s in sides}
                  for p in sorted(set(parts["ours"]) | set(parts["twin"]))},
        "signatures": [{"part": p, "kind": k, "counts": c,
                        **{s: {"n": v[s][0], "mcycles": _m(v[s][1]),
                               "largest": v[s][2] and {x: v[s][2][x] for x in
                                                       ("name", "aten", "type", "cycles")}}
                           for s in sides}} for (p, k, c), v in rows[:top]]}


def main(argv: list | None = None) -> dict:
    p = argparse.ArgumentParser(prog="bench/fusion_diff.py", description=__doc__.splitlines()[0])
    p.add_argument("ours")
    p.add_argument("twin")
    p.add_argument("--top", type=int, default=25)
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    with open(args.ours) as f, open(args.twin) as g:
        out = compare(f.read(), g.read(), args.top)
    print(f"total M cycles: ours {out['total']['ours']}  twin {out['total']['twin']}")
    for part, v in out["parts"].items():
        print(f"  {part:24s} ours {v['ours']:8.3f}  twin {v['twin']:8.3f}  "
              f"diff {v['ours'] - v['twin']:+8.3f}")
    for s in out["signatures"]:
        o, t = s["ours"], s["twin"]
        print(f"{o['mcycles'] - t['mcycles']:+7.3f}  {s['part']:12s} {s['kind']:14s} "
              f"{s['counts']}  ours {o['n']} x {o['mcycles']:.3f}  twin {t['n']} x "
              f"{t['mcycles']:.3f}")
        for side in ("ours", "twin"):
            if s[side]["largest"]:
                big = s[side]["largest"]
                print(f"          {side}: {big['name']} {big['type']} {big['aten']} "
                      f"{_m(big['cycles'])}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1, default=str)
    return out


if __name__ == "__main__":
    main()
