"""Docs search with citations (tools/docs_search.py) and log triage (tools/triage.py,
``python -m torchtpu.diagnose --log``), directly and through the MCP server."""

import json
import os
import subprocess
import sys
import traceback
from pathlib import Path

import pytest
import torch

from torchtpu.commands import ToolError
from torchtpu.tools import docs_search, triage

ROOT = Path(__file__).resolve().parents[1]


def _line(source: str, n: int) -> str:
    return (ROOT / source).read_text().splitlines()[n - 1]


def test_docs_search_cites_the_section_that_answers():
    found = docs_search.search("DDP find_unused_parameters bucket views", top=3)
    assert found["covered"]
    best = found["results"][0]
    assert best["source"] == "docs/distributed.md" and "Collectives" in best["title"]
    assert "DDP works" in _line(best["source"], best["line"])  # the cited line, and from it:
    assert "find_unused_parameters=True" in best["excerpt"]
    assert best["citation"].startswith(f"docs/distributed.md:{best['line']} (")
    glossary = docs_search.search("what does torchtpu.fallback mean and how do I fix it")
    hit = next(r for r in glossary["results"] if r["source"] == "torchtpu/errors.py")
    assert hit["title"] == "glossary: torchtpu.fallback"
    assert _line(hit["source"], hit["line"]).strip().startswith('"fallback":')
    doc = docs_search.search("persistent compile cache eviction least recently used")
    assert doc["covered"] and any(r["source"].startswith("torchtpu/cache/")
                                  for r in doc["results"]), doc
    # A table row is a section of its own, cited by its first cell: the setting that answers
    # (the whole Settings table, ~40 rows, weighed too little for its length).
    assert doc["results"][0]["title"] == "Settings > TORCHTPU_CACHE_MAX_BYTES", doc
    assert _line(doc["results"][0]["source"], doc["results"][0]["line"]).startswith(
        "| `TORCHTPU_CACHE_MAX_BYTES` |")


def test_docs_search_says_when_a_topic_is_not_covered():
    found = docs_search.search("kubernetes autoscaling helm chart")
    assert not found["covered"]
    assert "not covered" in found["note"] and "kubernete" in found["note"]
    partly = docs_search.search("torch.compile with a quantum annealer backend")
    assert not partly["covered"], partly  # common words alone do not make a topic covered
    with pytest.raises(ToolError, match="torchtpu.tool: docs search needs a question"):
        docs_search.search("  ")


def _placement_error() -> str:
    try:
        torch.ones(2, device="tpu") + torch.ones(2)
    except RuntimeError:
        return "step 3\n" + traceback.format_exc()
    raise AssertionError("adding a cpu tensor to a tpu tensor did not raise")


def test_triage_names_category_cause_fix_and_user_line():
    log = ("torchtpu.fallback: aten::foo ran on CPU (warning)\n" + _placement_error())
    t = triage.triage(log)
    assert t.primary.category == "placement" and t.exception == "RuntimeError"
    assert t.primary.fix.startswith("Move the tensor")
    assert t.user_frame.startswith(f"{__file__}:") and "_placement_error" in t.user_frame
    assert [f.category for f in t.findings] == ["fallback", "placement"]
    oom = triage.triage("2026 ... XlaRuntimeError: RESOURCE_EXHAUSTED: Out of memory while "
                        "trying to allocate 12.00G")
    assert oom.primary.category == "device" and "memory" in oom.primary.cause
    xla = triage.triage("Traceback (most recent call last):\n  File \"t.py\", line 1, in "
                        "<module>\nModuleNotFoundError: No module named 'torch_xla'")
    assert xla.primary.category == "unsupported" and "torch_xla.install" in xla.primary.fix
    assert triage.triage("all good\n").primary is None


def test_diagnose_log_command(tmp_path):
    log = tmp_path / "run.log"
    log.write_text(_placement_error())
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    run = [sys.executable, "-m", "torchtpu.diagnose"]
    out = subprocess.run([*run, "--log", str(log), "--json"], capture_output=True, text=True,
                         timeout=180, env=env)
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["primary"]["category"] == "placement"
    bad = subprocess.run([*run, "--log", str(tmp_path / "missing.log")], capture_output=True,
                         text=True, timeout=180, env=env)
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert bad.stderr.strip() == f"torchtpu.tool: log {tmp_path / 'missing.log'} does not exist"


def test_mcp_server_answers_docs_and_triages_logs(tmp_path):
    mcp = pytest.importorskip("mcp")
    anyio = pytest.importorskip("anyio")
    log = tmp_path / "run.log"
    log.write_text(_placement_error())
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    params = mcp.StdioServerParameters(command=sys.executable, args=["-m", "torchtpu.mcp"],
                                       env=env)

    def result(call) -> dict:
        assert not call.is_error, call.content
        s = call.structured_content
        if isinstance(s, dict):
            return s if "ok" in s else s["result"]
        return json.loads(call.content[0].text)

    async def session():
        with anyio.fail_after(240):
            async with mcp.stdio_client(params) as (read, write):
                async with mcp.ClientSession(read, write) as s:
                    await s.initialize()
                    return [result(await s.call_tool(name, args)) for name, args in [
                        ("docs_search", {"query": "DeferAndFuse pending_hlo", "top": 2}),
                        ("docs_search", {"query": "kubernetes helm chart"}),
                        ("triage_log", {"path": str(log)}),
                        ("triage_log", {}),
                    ]]

    docs, uncovered, triaged, neither = anyio.run(session)
    assert docs["ok"] and docs["covered"] and len(docs["results"]) == 2
    assert "pending_hlo" in docs["results"][0]["excerpt"] + docs["results"][1]["excerpt"]
    assert uncovered["ok"] and not uncovered["covered"]
    assert triaged["ok"] and triaged["primary"]["category"] == "placement"
    assert not neither["ok"] and neither["error"].startswith("torchtpu.tool: triage_log takes")
