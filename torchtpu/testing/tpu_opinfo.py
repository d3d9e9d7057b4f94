"""OpInfo samples compiled for a TPU: which of each lowering family's programs the TPU compiler
takes, and what it refuses.

``python -m torchtpu.testing.tpu_opinfo [--topology v5e:2x2] [--ops REGEX] [--max-samples N]
[--dtype float64] [--json FILE]`` runs PyTorch's OpInfo samples on tpu against CPU
(``testing/opinfo.py``, forward mode) in Strict mode, one program per op, with the TPU target on
(``targets/tpu_hook.py``, refusals kept, not raised): every program the samples build is also
compiled for one chip of the target with libtpu (compile-only; nothing runs on a TPU). Each
program is put in the family of the lowering it runs (the ``torchtpu.lowering`` module that
registered its aten op: elementwise, reduction, linalg, ...); programs that run no lowering (view
reads and writes, copies, factories of the executor) are family ``executor``. Per family:
programs, how many compile, and the refusals with the compiler's words.

A refusal of a program lowered for the host with a host-only call (LAPACK, DUCC FFT, CPU custom
calls) is counted apart as ``host-lowered``: the host's StableHLO is what the target compiles, and
JAX lowers such ops another way for a TPU (on a TPU torchtpu traces them for it), so it says
nothing of the TPU.
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
from dataclasses import asdict, dataclass, field

import torch

_HOST_ONLY = ("lapack", "ducc", "cpu_", "Custom emitter", "lowered for the host")


@dataclass
class Family:
    """One lowering family's programs on the target."""

    programs: int = 0
    compiles: int = 0
    host_lowered: int = 0                          # refused only for a host-only call
    refused: list = field(default_factory=list)    # [{"op", "error"}], the TPU's refusals

    @property
    def rate(self) -> float:
        counted = self.programs - self.host_lowered
        return self.compiles / counted if counted else 1.0


def program_families() -> dict:
    """The host program name eager gives each lowered aten op (``jit_aten_mm_default``) -> the
    name of the lowering module that registered it."""
    from torchtpu.lowering import registry

    return {"jit_" + str(op).replace(".", "_"): low.family for op, low in registry.TABLE.items()}


def classify(reports: list, families: dict) -> dict:
    """{family: Family} of the target's reports (one per program)."""
    out: dict = collections.defaultdict(Family)
    for r in reports:
        fam = out[families.get(r.name, "executor")]
        fam.programs += 1
        if r.compiles:
            fam.compiles += 1
        elif any(s in (r.error or "") for s in _HOST_ONLY):
            fam.host_lowered += 1
        else:
            fam.refused.append({"op": r.name.removeprefix("jit_"),
                                "error": (r.error or "")[:300]})
    return dict(sorted(out.items()))


def run(ops: str | None = None, *, topology: str | None = None, max_samples: int = 1,
        dtype: torch.dtype = torch.float32, progress=None) -> dict:
    """OpInfos matching ops (all when None) through the target; see the module doc."""
    from torchtpu.targets import tpu_hook, tpu_target
    from torchtpu.testing import opinfo

    name = tpu_target.target(topology).name
    tpu_hook.install(name, on_error="keep")
    before = {id(r) for r in tpu_hook.reports()}
    with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_NEVER):
        host = opinfo.run(ops, mode="forward", max_samples=max_samples, dtype=dtype,
                          progress=progress)
    reports = [r for r in tpu_hook.wait() if id(r) not in before]
    fams = classify(reports, program_families())
    counted = sum(f.programs - f.host_lowered for f in fams.values())
    compiles = sum(f.compiles for f in fams.values())
    return {"topology": name, "dtype": str(dtype).removeprefix("torch."),
            "opinfos": len(host.results), "host_passed": host.passed,
            "programs": sum(f.programs for f in fams.values()), "compiles": compiles,
            "host_lowered": sum(f.host_lowered for f in fams.values()),
            "rate": compiles / counted if counted else 1.0,
            "families": {k: {**asdict(f), "rate": f.rate} for k, f in fams.items()}}


def format_result(out: dict) -> str:
    lines = [f"{out['opinfos']} OpInfos in {out['dtype']} on {out['topology']}: "
             f"{out['compiles']} of "
             f"{out['programs'] - out['host_lowered']} programs compile for TPU "
             f"({out['rate'] * 100:.1f}%); {out['host_lowered']} host-lowered (host-only calls, "
             "not a TPU verdict)",
             "| family | programs | compile | host-lowered | rate |",
             "| --- | ---: | ---: | ---: | ---: |"]
    for k, f in out["families"].items():
        lines.append(f"| {k} | {f['programs']} | {f['compiles']} | {f['host_lowered']} | "
                     f"{f['rate'] * 100:.1f}% |")
    for k, f in out["families"].items():
        for r in f["refused"]:
            lines.append(f"refused ({k}): {r['op']}: {r['error']}")
    return "\n".join(lines)


def main(argv: list | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m torchtpu.testing.tpu_opinfo",
                                description=__doc__.split("\n\n")[0])
    p.add_argument("--ops", help="regex matched fully against the OpInfos' names")
    p.add_argument("--topology", default=None)
    p.add_argument("--max-samples", type=int, default=1)
    p.add_argument("--dtype", default="float32",
                   help="the samples' dtype (float64: a TPU emulates it, libtpu lowers it apart)")
    p.add_argument("--json", help="also write the figures to this file")
    p.add_argument("--progress", action="store_const", const=sys.stderr, default=None)
    args = p.parse_args(argv)
    dtype = getattr(torch, args.dtype, None)
    if not isinstance(dtype, torch.dtype):
        p.error(f"torchtpu.argument: --dtype {args.dtype!r} is not a torch dtype")
    out = run(args.ops, topology=args.topology, max_samples=args.max_samples, dtype=dtype,
              progress=args.progress)
    print(format_result(out))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0 if out["rate"] == 1.0 else 1


if __name__ == "__main__":
    sys.exit(main())
