"""The MCP server: started with the mcp client library on stdio, each tool called once; it
listens on no network address.

Skipped where the optional ``mcp`` package (``pip install -e '.[mcp]'``) is absent.
"""

import json
import os
import sys
import textwrap
from pathlib import Path

import pytest
import torch

from torchtpu.testing import network

mcp = pytest.importorskip("mcp")
anyio = pytest.importorskip("anyio")

ROOT = Path(__file__).resolve().parents[1]


def _result(call) -> dict:
    assert not call.is_error, call.content
    if isinstance(call.structured_content, dict) and "ok" in call.structured_content:
        return call.structured_content
    if isinstance(call.structured_content, dict) and "result" in call.structured_content:
        return call.structured_content["result"]
    return json.loads(call.content[0].text)


def _server_sockets() -> list:
    """The TCP sockets the MCP server process (a child of this one) listens on."""
    me = os.getpid()
    (server,) = [pid for pid in network.descendants(me) - {me}
                 if b"torchtpu.mcp" in Path(f"/proc/{pid}/cmdline").read_bytes()]
    return network.sockets_of(network.descendants(server))


def test_mcp_server_serves_every_tool(tmp_path):
    target = tmp_path / "tiny.py"
    target.write_text(textwrap.dedent("""
        import torch
        def make():
            torch.manual_seed(0)
            return torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.ReLU()), (torch.ones(2, 4),)
        """))
    with torch.profiler.profile() as prof:
        (torch.ones(8) * 2).sum()
    trace = tmp_path / "trace.json"
    prof.export_chrome_trace(str(trace))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *filter(None, [os.environ.get("PYTHONPATH")])])}
    params = mcp.StdioServerParameters(command=sys.executable, args=["-m", "torchtpu.mcp"],
                                       env=env)

    async def session():
        results = {}
        with anyio.fail_after(240):
            async with mcp.stdio_client(params) as (read, write):
                async with mcp.ClientSession(read, write) as s:
                    await s.initialize()
                    if sys.platform == "linux":  # stdio only: no address to reach it on
                        results["sockets"] = _server_sockets()
                    tools = {t.name for t in (await s.list_tools()).tools}
                    results["tools"] = tools
                    for name, args in [
                        ("doctor", {"self_test": False}),
                        ("onboard", {"target": f"{target}:make", "modes": ["strict"]}),
                        ("diagnose", {"target": f"{target}:make"}),
                        ("metrics", {}),
                        ("trace_summary", {"path": str(trace)}),
                        ("onboard", {"target": f"{tmp_path}/missing.py:make"}),
                    ]:
                        results.setdefault(name, []).append(
                            _result(await s.call_tool(name, args)))
        return results

    r = anyio.run(session)
    assert r.get("sockets", []) == [], r["sockets"]
    assert r["tools"] == {"doctor", "onboard", "diagnose", "metrics", "trace_summary",
                          "docs_search", "triage_log", "aot", "plan", "tune"}
    assert r["doctor"][0]["ok"] and r["doctor"][0]["checks"][0]["name"] == "platform"
    good, missing = r["onboard"]
    assert good["ok"] and good["modes"][0]["mode"] == "strict" and good["modes"][0]["ok"]
    assert not missing["ok"] and missing["error"].startswith("torchtpu.tool: ")
    assert r["diagnose"][0]["ok"] and r["diagnose"][0]["per_step"]["executions"] > 0
    assert r["diagnose"][0]["profile"]["device"], r["diagnose"][0]["profile"]
    assert r["metrics"][0]["metrics"]["executions"] > 0, r["metrics"]
    summary = r["trace_summary"][0]
    assert summary["events"] > 0 and summary["top"][0]["total_ms"] >= 0
