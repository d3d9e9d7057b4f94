"""Prefix-cache-aware routing: two vLLM replicas on tpu behind vllm-router's cache-aware policy.

The replicas' own prefix-cache counters (``/metrics``) say where each request ran and what it
found cached. The two-replica test is heavy (two vLLM servers on a shared host: minutes), so it
is a full-suite test; it needs the vLLM venv (``python -m torchtpu.integrations.vllm.install``)
and ``pip install vllm-router==0.1.17``.
"""

from __future__ import annotations

import http.server
import threading
import time
import urllib.error
import urllib.request

import pytest

from torchtpu.integrations.vllm import routing, server
from torchtpu.testing import network

METRICS = """\
# HELP vllm:prefix_cache_queries_total Prefix cache queries, in terms of number of queried tokens.
# TYPE vllm:prefix_cache_queries_total counter
vllm:prefix_cache_queries_total{engine="0",model_name="m"} 188.0
vllm:prefix_cache_queries_total{engine="1",model_name="m"} 12.0
vllm:prefix_cache_hits_total{engine="0",model_name="m"} 80.0
vllm:prefix_cache_hits_created{engine="0",model_name="m"} 1.79e+09
vllm:external_prefix_cache_hits_total{engine="0",model_name="m"} 5.0
"""


@pytest.fixture
def metrics_server():
    """A localhost HTTP server answering ``/metrics`` with the text put in its ``body`` list."""
    body = [METRICS]

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_GET(self):
            data = body[0].encode()
            self.send_response(200)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    srv = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=srv.serve_forever, args=(0.05,), daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{srv.server_address[1]}", body
    finally:
        srv.shutdown()
        srv.server_close()


def test_prefix_cache_sums_the_engines_counters_and_refuses_other_metrics(metrics_server):
    url, body = metrics_server
    assert routing.prefix_cache(url) == routing.PrefixCache(queries=200.0, hits=80.0)
    body[0] = "http_requests_total 3.0\n"
    with pytest.raises(RuntimeError, match="torchtpu.tool: .* has no"):
        routing.prefix_cache(url)


def test_fleet_refuses_bad_arguments_before_starting_anything():
    with pytest.raises(ValueError, match="replicas=0"):
        with routing.fleet("unused", 0):
            pass
    with pytest.raises(ValueError, match="policy='nearest'"):
        with routing.fleet("unused", 2, policy="nearest"):
            pass


def _gone(pid, timeout=10.0):
    """Whether ``pid`` ends (or is only a zombie: an orphan waits for its reaper) within
    ``timeout`` seconds; a signal takes effect when the process next runs."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            with open(f"/proc/{pid}/stat") as f:
                if f.read().rsplit(")", 1)[1].split()[0] in ("Z", "X"):
                    return True
        except FileNotFoundError:
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)


def test_spawned_group_is_waited_for_and_stopped_with_its_children():
    """The steps :func:`routing.fleet` runs each process with: a server that forks a child (as
    ``vllm serve`` forks its engine) is healthy once it answers, and stopping it ends both; a
    process that exits before it answers raises with its output."""
    import sys

    from torchtpu.integrations.vllm import server

    port = server.free_port()
    cmd = ["bash", "-c", f"sleep 600 & echo $! && exec {sys.executable} -m http.server {port} "
           "--bind 127.0.0.1"]
    proc, log = server.spawn(cmd)
    try:
        url = f"http://127.0.0.1:{port}"
        server.wait_healthy(proc, log, url + "/", time.monotonic() + 60, "http.server")
        log.seek(0)
        child = int(log.readline())
        server.stop(proc)
        assert proc.poll() is not None and _refused(url)
        assert _gone(child)
    finally:
        server.stop(proc)
        log.close()
    proc, log = server.spawn(["bash", "-c", "echo no model here; exit 3"])
    with pytest.raises(RuntimeError, match="torchtpu.tool: fake exited with 3:\n(.|\n)*no model"):
        server.wait_healthy(proc, log, "http://127.0.0.1:9/health", time.monotonic() + 60, "fake")
    log.close()


def test_router_listens_on_localhost_only(metrics_server):
    """vllm-router in front of a stand-in replica (every GET answered 200): its port and its
    metrics port are bound to loopback, not reachable on the machine's other addresses."""
    pytest.importorskip("vllm_router", reason=f"pip install {routing.ROUTER_PIN}")
    replica, _ = metrics_server
    port, metrics_port = routing._ports(2)
    proc, log = server.spawn(routing.router_command(port, [replica], "round_robin", 60,
                                                    metrics_port))
    try:
        server.wait_healthy(proc, log, f"http://127.0.0.1:{port}/health",
                            time.monotonic() + 120, "vllm-router")
        exposed = network.exposed(port)
        reachable = [(a, p) for a in network.other_addresses() for p in (port, metrics_port)
                     if not network.refused(a, p)]
    finally:
        server.stop(proc)
        log.close()
    assert exposed == [] and reachable == [], (exposed, reachable)


def _needs_vllm_and_router():
    pytest.importorskip(
        "vllm", reason="vLLM is not installed: python -m torchtpu.integrations.vllm.install")
    pytest.importorskip("vllm_router", reason=f"pip install {routing.ROUTER_PIN}")


def _counters(fleet):
    return [routing.prefix_cache(u) for u in fleet.replicas]


def _refused(url):
    try:
        urllib.request.urlopen(url + "/health", timeout=5)
    except urllib.error.URLError as e:
        return isinstance(e.reason, ConnectionRefusedError)
    return False


# each session's first turn is most of its text, so a later turn's text mostly extends it
# (above the router's 0.3 match threshold) and the two sessions share only the chat template
SESSIONS = {
    "trip": ["plan a trip to the mountains for the first week of june, with two friends",
             "and by train?", "what to pack?"],
    "poem": ["write a short poem about the sea, a storm and an old lighthouse keeper alone",
             "make it rhyme", "now a title"],
}


def _grown(fleet, before, timeout=10.0):
    """The counters once they differ from ``before`` (they follow an answer by a few ms)."""
    deadline = time.monotonic() + timeout
    while (now := _counters(fleet)) == before and time.monotonic() < deadline:
        time.sleep(0.05)
    return now


@pytest.mark.full
def test_cache_aware_router_keeps_each_chat_session_on_the_replica_holding_its_prefix(tmp_path):
    """Two chat sessions through the router. Their first turns run at once, so the second one,
    matching nothing cached, goes to the idle replica; every later turn, interleaved one at a
    time with both replicas idle, goes back to its session's replica (a prefix-cache query of
    exactly its prompt there, none on the other) and reads the whole previous prompt's full
    16-token blocks from that replica's prefix cache. The answers equal a direct request to
    the replica that never saw the session."""
    _needs_vllm_and_router()
    from concurrent.futures import ThreadPoolExecutor

    from torchtpu.integrations.vllm import server
    from torchtpu.integrations.vllm.tiny import save_tiny_model

    model = str(save_tiny_model(tmp_path / "llama", "llama"))
    greedy = {"model": model, "max_tokens": 8, "temperature": 0, "ignore_eos": True,
              "return_token_ids": True}
    chats = {s: [] for s in SESSIONS}
    answers = {s: [] for s in SESSIONS}
    gained = {s: [] for s in SESSIONS}  # per turn: (queries, hits) gained by each replica

    def send(s, turn, url):
        chats[s].append({"role": "user", "content": SESSIONS[s][turn]})
        answer = server.post(url + "/v1/chat/completions", {**greedy, "messages": chats[s]},
                             timeout=300)
        answers[s].append(answer)
        chats[s].append({"role": "assistant",
                         "content": answer["choices"][0]["message"]["content"]})

    def delta(before, after):
        return [(a.queries - b.queries, a.hits - b.hits) for b, a in zip(before, after)]

    with routing.fleet(model, 2, start_timeout=600) as fleet:
        before = _counters(fleet)
        with ThreadPoolExecutor(1) as pool:
            first = pool.submit(send, "trip", 0, fleet.url)
            # "trip" is scheduled on one replica and decoding: it is in flight for the router
            busy = _grown(fleet, before, timeout=300)
            send("poem", 0, fleet.url)
            first.result()
        after = _grown(fleet, busy)
        home = {"trip": next(i for i in range(2) if busy[i] != before[i])}
        home["poem"] = 1 - home["trip"]
        for s in SESSIONS:
            gained[s].append(delta(before, after)[home[s]])
        for turn in (1, 2):
            for s in SESSIONS:
                before = _counters(fleet)
                send(s, turn, fleet.url)
                gained[s].append(delta(before, _grown(fleet, before)))
        direct = {}
        for s in SESSIONS:
            del chats[s][-2:]  # the last turn again, sent past the router
            send(s, 2, fleet.replicas[1 - home[s]])
            direct[s] = answers[s].pop()
        print({"home": home, "gained": gained, "counters": _counters(fleet)})
    assert all(_refused(u) for u in (fleet.url, *fleet.replicas))

    for s in SESSIONS:
        prompts = [len(a["prompt_token_ids"]) for a in answers[s]]
        # the first turns: each replica queried exactly its session's prompt
        assert gained[s][0][0] == prompts[0], (s, gained[s], prompts)
        for turn in (1, 2):
            (q_home, hits), (q_other, _) = (gained[s][turn][home[s]],
                                            gained[s][turn][1 - home[s]])
            assert (q_home, q_other) == (prompts[turn], 0), (s, turn, gained[s], home)
            assert hits >= prompts[turn - 1] // 16 * 16 > 0, (s, turn, gained[s], prompts)
        assert direct[s]["prompt_token_ids"] == answers[s][-1]["prompt_token_ids"]
        assert direct[s]["choices"][0]["token_ids"] == answers[s][-1]["choices"][0]["token_ids"]
