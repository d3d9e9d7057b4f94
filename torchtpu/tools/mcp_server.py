"""``python -m torchtpu.mcp``: the tools as a Model Context Protocol server on stdio.

Tools, each returning JSON: ``doctor``, ``onboard``, ``diagnose``, ``aot`` (a step compiled
for a TPU topology and estimated), ``plan`` and ``tune`` (the fastest settings, by trials) on a
``path/to/script.py:factory`` target, ``metrics``
(this server process's ``torchtpu.metrics``), ``trace_summary`` (a profiler trace file),
``docs_search`` (torchtpu's README, docs/ pages, glossary and docstrings, cited by file, section
and line, with ``covered: false`` for what they do not cover) and ``triage_log`` (a traceback or
log: glossary category, cause, fix). A problem with the arguments comes back as
``{"ok": false, "error": "torchtpu.tool: ..."}``, not as a crash of the server. Needs the
``mcp`` package: ``pip install 'torchtpu[mcp]'``. ``SKILL.md`` beside this file tells an
assistant when to call which tool.
"""

from __future__ import annotations

import sys
from pathlib import Path

from torchtpu import metrics as _metrics
from torchtpu.commands import ToolError, describe
from torchtpu.tools import aot as _aot
from torchtpu.tools import diagnose as _diagnose
from torchtpu.tools import docs_search as _docs
from torchtpu.tools import doctor as _doctor
from torchtpu.tools import onboard as _onboard
from torchtpu.tools import plan as _plan
from torchtpu.tools import trace as _trace
from torchtpu.tools import triage as _triage
from torchtpu.tools import tune as _tune
from torchtpu.tools.target import load

SKILL = Path(__file__).with_name("SKILL.md")


def _guarded(fn, *args, **kwargs) -> dict:
    try:
        return {"ok": True, **fn(*args, **kwargs)}
    except ToolError as e:
        return {"ok": False, "error": str(e)}
    except Exception as e:
        return {"ok": False, "error": f"torchtpu.tool: failed: {describe(e)}"}


def _onboard_target(target, backward, modes, atol, rtol) -> dict:
    model, inputs = load(target)
    report = _onboard.run(model, inputs, backward=backward,
                          modes=tuple(modes) if modes else _onboard.MODES, atol=atol, rtol=rtol)
    return report.to_dict()


def _diagnose_target(target, backward, profile) -> dict:
    model, inputs = load(target)
    return _diagnose.step_of_model(model, inputs, backward, profile).to_dict()


def _triage_log(path: str | None, text: str | None) -> dict:
    if (path is None) == (text is None):
        raise ToolError("triage_log takes a log file's path or its text, one of the two")
    return _triage.triage(_triage.read_log(path) if path is not None else text).to_dict()


def _aot_target(target, topology, step, mode, world=1, tp=1) -> dict:
    model, inputs = load(target)
    return _aot.report(model, inputs, topology=topology, step=step, mode=mode, world=world,
                       tp=tp, script=target).to_dict()


def _plan_target(target, chips, topology, hbm_gib) -> dict:
    model, inputs = load(target)
    hbm = int(hbm_gib * (1 << 30)) if hbm_gib is not None else None
    return _plan.plan(model, inputs, chips=chips, hbm_bytes=hbm, topology=topology).to_dict()


def _tune_target(target, trials, budget, step, topology) -> dict:
    return _tune.tune(target, trials=trials, budget=budget, step=step, topology=topology).to_dict()


def _metrics_report() -> dict:
    return {"metrics": _metrics.snapshot(), "report": _metrics.report()}


def build():
    """The server, its tools registered (imports ``mcp``)."""
    from mcp.server.mcpserver import MCPServer

    server = MCPServer("torchtpu", instructions=SKILL.read_text())

    @server.tool()
    def doctor(self_test: bool = True) -> dict:
        """What this machine gives torchtpu (platform, versions, compile cache, settings) and
        every problem with its fix; self_test runs an op in each eager mode, a compiled graph
        and a cache round trip (about 10 s)."""
        return _guarded(_doctor.run, self_test)

    @server.tool()
    def onboard(target: str, backward: bool = False, modes: list[str] | None = None,
                atol: float = 1e-4, rtol: float = 1e-4) -> dict:
        """Run the model from target ("path/to/script.py:factory", factory() returning
        (model, inputs)) on CPU and on tpu in each mode (strict, debug, defer_and_fuse,
        compile): first diverging submodule, CPU fallbacks by module, graph breaks,
        recompiles, ms per step."""
        return _guarded(_onboard_target, target, backward, modes, atol, rtol)

    @server.tool()
    def diagnose(target: str, backward: bool = False, profile: bool = True) -> dict:
        """Run the target's forward (and backward) a few times on tpu and name the top
        problem with its fix: recompiles, new shapes per step, CPU fallbacks, host syncs with
        their lines, transfers, host-bound steps; profile adds one profiled step (device time
        by program)."""
        return _guarded(_diagnose_target, target, backward, profile)

    @server.tool()
    def aot(target: str, topology: str = "v5e:2x2", step: str = "forward",
            mode: str = "compile", world: int = 1, tp: int = 1) -> dict:
        """Compile the target's step (forward or train; mode strict, defer, compile or
        captured) for a TPU topology with libtpu, compile-only (nothing runs on a TPU): per
        program whether the TPU compiler takes it, HBM, flops, bytes and cost-model seconds;
        per step seconds on one chip, MFU, HBM peak against the chip's. world > 1: the step
        sharded over that many ranks, one chip each (FSDP; tp of them tensor parallel), per
        chip. Needs the tpu-aot extra; one topology per server process."""
        return _guarded(_aot_target, target, topology, step, mode, world, tp)

    @server.tool()
    def plan(target: str, chips: int | None = None, topology: str | None = None,
             hbm_gib: float | None = None) -> dict:
        """Rank the layouts (DDP, FSDP2, FSDP2 x TP, HSDP) of the target's training step over
        N chips (or a TPU topology's) by what fits each chip's memory and the bytes each chip
        sends per step, from sizes measured on CPU; the best layout's mesh and sharding code."""
        return _guarded(_plan_target, target, chips, topology, hbm_gib)

    @server.tool()
    def tune(target: str, trials: int = 6, budget: float = 300.0, step: str = "train",
             topology: str | None = None) -> dict:
        """Search the settings that run the target's step fastest (eager mode strict / defer,
        torch.compile whole step, captured, buckets; matmul precision; XLA option sets), each
        trial in a child process, at most trials trials in budget seconds: ms/step per trial
        (with a TPU topology the cost model's), the best setting, the command that reproduces
        it and the code that sets it."""
        return _guarded(_tune_target, target, trials, budget, step, topology)

    @server.tool()
    def metrics() -> dict:
        """torchtpu.metrics of this server process: compiles, cache hits, executions, CPU
        fallbacks by op, bytes each way (cumulative over the tools run so far)."""
        return _guarded(_metrics_report)

    @server.tool()
    def trace_summary(path: str, top: int = 15) -> dict:
        """Summary of a profiler trace (Chrome trace JSON, .json.gz, or a folder holding
        one): span and the events with the most total time."""
        return _guarded(_trace.summarize, path, top)

    @server.tool()
    def docs_search(query: str, top: int = 5) -> dict:
        """Answer a question about torchtpu from its own README, docs/ pages, error glossary and
        module docstrings: the best sections, each with a citation (file:line and section) and an
        excerpt; covered false means the documentation does not cover the topic (say so rather
        than guess)."""
        return _guarded(_docs.search, query, top)

    @server.tool()
    def triage_log(path: str | None = None, text: str | None = None) -> dict:
        """Read a failed run's traceback or log (a file path, or the text itself) and name the
        torchtpu error category, the likely cause, the fix and the user line it points at."""
        return _guarded(_triage_log, path, text)

    return server


def main(argv: list | None = None) -> int:
    if argv:
        print("usage: python -m torchtpu.mcp  (an MCP server on stdin/stdout; no arguments)",
              file=sys.stderr)
        return 2
    try:
        import mcp  # noqa: F401
    except ImportError:
        print("torchtpu.tool: the MCP server needs the mcp package: "
              "pip install 'torchtpu[mcp]'", file=sys.stderr)
        return 2
    build().run("stdio")
    return 0
