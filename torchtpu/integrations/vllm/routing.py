"""Prefix-cache-aware routing over vLLM replicas on localhost, as llm-d routes over a fleet.

:func:`fleet` starts N ``vllm serve`` replicas (device "tpu" unless told otherwise) on free
localhost ports and vllm-router (PyPI ``vllm-router``, a Rust router) in front of them with its
cache-aware policy: it keeps an approximate prefix tree of the text each replica was sent, so a
request whose text mostly extends an earlier one (the next turn of a chat) goes where that prefix
is already in vLLM's prefix cache, and a request that matches nothing goes to the replica that
holds the least. Every process runs in a process group of its own and every group is stopped
when the block exits, on an error or Ctrl-C too. :func:`prefix_cache` reads a replica's
prefix-cache counters from its Prometheus ``/metrics``, which is how routing is measured.

``python -m torchtpu.integrations.vllm.routing DIR --replicas 2`` serves until Ctrl-C.
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import signal
import sys
import time
import urllib.request
from collections.abc import Iterator
from dataclasses import dataclass

from torchtpu.integrations.vllm import server
from torchtpu.integrations.vllm.install import ROUTER_PIN

# the tiny-model serving defaults, with the prefix cache asked for by name, and vLLM's
# scale-out endpoints on: vllm-router's cache-aware policy keys on the prompt's tokens, which it
# gets from each request's /v1/chat/completions/render (off by default: 403, and the router
# then sends every request to its first replica)
REPLICA_ARGS = (*server.SERVE_ARGS, "--enable-prefix-caching", "--enable-scale-out")
POLICIES = ("cache_aware", "round_robin", "random", "power_of_two", "consistent_hash")


@dataclass(frozen=True)
class Fleet:
    """A running fleet: the router's base URL, each replica's (in start order) and the URL of
    the router's own Prometheus metrics (its routing decisions)."""

    url: str
    replicas: tuple[str, ...]
    router_metrics: str


@dataclass(frozen=True)
class PrefixCache:
    """A replica's prefix-cache counters, in prompt tokens since it started."""

    queries: float
    hits: float


def counters(url: str, names: tuple[str, ...], timeout: float = 30.0) -> dict[str, float]:
    """The Prometheus counters ``names`` at ``url``/metrics, each summed over its labels (a
    replica's engines); a name the server does not export raises."""
    with urllib.request.urlopen(url + "/metrics", timeout=timeout) as r:
        text = r.read().decode()
    totals = dict.fromkeys(names, 0.0)
    found = set()
    for line in text.splitlines():
        name = line.split("{", 1)[0].split(" ", 1)[0]
        if name in totals:
            totals[name] += float(line.rsplit(" ", 1)[1])
            found.add(name)
    if len(found) != len(totals):
        raise RuntimeError(f"torchtpu.tool: {url}/metrics has no {sorted(set(totals) - found)}: "
                           "is it a vLLM server?")
    return totals


def prefix_cache(url: str, timeout: float = 30.0) -> PrefixCache:
    """Read ``vllm:prefix_cache_queries_total`` and ``..._hits_total`` from ``url``/metrics,
    summed over the replica's engines."""
    return PrefixCache(*counters(url, ("vllm:prefix_cache_queries_total",
                                       "vllm:prefix_cache_hits_total"), timeout).values())


def router_command(port: int, replicas: list[str], policy: str, startup_timeout: float,
                   metrics_port: int, *, disaggregated: bool = False) -> list[str]:
    """The vllm-router command line: ``policy`` over ``replicas``, serving on ``port``; with
    ``disaggregated``, its prefill/decode mode over ``replicas`` = [prefill, decode]."""
    if policy not in POLICIES:
        raise ValueError(f"torchtpu.argument: policy={policy!r} is not one of {POLICIES}")
    if disaggregated and len(replicas) != 2:
        raise ValueError(f"torchtpu.argument: disaggregated serving takes a prefill and a "
                         f"decode server, not {replicas}")
    if importlib.util.find_spec("vllm_router") is None:
        raise RuntimeError(f"torchtpu.tool: vllm-router is not installed: pip install "
                           f"{ROUTER_PIN} (in the vLLM venv)")
    workers = (["--vllm-pd-disaggregation", "--prefill", replicas[0], "--decode", replicas[1]]
               if disaggregated else ["--worker-urls", *replicas])
    return [sys.executable, "-m", "vllm_router.launch_router", "--host", "127.0.0.1",
            "--port", str(port), *workers, "--policy", policy,
            # its metrics port defaults to 29000, where a second router would collide
            "--prometheus-port", str(metrics_port),
            "--worker-startup-timeout-secs", str(max(1, int(startup_timeout))),
            "--worker-startup-check-interval", "1"]


def _ports(n: int) -> list[int]:
    ports: list[int] = []
    while len(ports) < n:
        port = server.free_port()
        if port not in ports:
            ports.append(port)
    return ports


@contextlib.contextmanager
def _serving(model: str, replica_args: list[tuple[str, ...]], platform: str, policy: str,
             port: int | None, start_timeout: float, disaggregated: bool) -> Iterator[Fleet]:
    """Start one ``vllm serve model`` per entry of ``replica_args`` and the router in front."""
    *replica_ports, router_port, metrics_port = _ports(len(replica_args) + 2)
    if port is not None:
        router_port = port
    urls = [f"http://127.0.0.1:{p}" for p in replica_ports]
    router_url = f"http://127.0.0.1:{router_port}"
    deadline = time.monotonic() + start_timeout
    # bad input fails before anything starts
    router_command(router_port, urls, policy, start_timeout, metrics_port,
                   disaggregated=disaggregated)
    with contextlib.ExitStack() as stack:
        def start(cmd: list[str], env: dict[str, str] | None = None):
            proc, log = server.spawn(cmd, env)
            stack.callback(log.close)
            stack.callback(server.stop, proc)
            return proc, log

        started = [start(*server.command(model, p, platform, args))
                   for p, args in zip(replica_ports, replica_args)]
        for i, ((proc, log), url) in enumerate(zip(started, urls)):
            server.wait_healthy(proc, log, url + "/health", deadline, f"replica {i} (vllm serve)")
        cmd = router_command(router_port, urls, policy, deadline - time.monotonic(), metrics_port,
                             disaggregated=disaggregated)
        proc, log = start(cmd)
        server.wait_healthy(proc, log, router_url + "/health", deadline, "vllm-router")
        yield Fleet(router_url, tuple(urls), f"http://127.0.0.1:{metrics_port}/metrics")


@contextlib.contextmanager
def fleet(model: str, replicas: int = 2, *, platform: str = "tpu",
          args: tuple[str, ...] = REPLICA_ARGS, policy: str = "cache_aware",
          port: int | None = None, start_timeout: float = 900.0) -> Iterator[Fleet]:
    """Run ``replicas`` ``vllm serve model`` behind vllm-router; yield their URLs.

    The replicas start together and all must answer ``/health`` within ``start_timeout``
    seconds; then the router starts (on ``port``, or a free one) and must answer too.
    """
    if replicas < 1:
        raise ValueError(f"torchtpu.argument: replicas={replicas} must be at least 1")
    with _serving(model, [args] * replicas, platform, policy, port, start_timeout,
                  disaggregated=False) as f:
        yield f


def kv_transfer_args(role: str, storage: str) -> tuple[str, ...]:
    """``vllm serve`` arguments of a disaggregated instance: vLLM's ExampleConnector, which
    writes each prompt's KV (its whole blocks but the last token's) to files in ``storage``
    keyed by the prompt's tokens, and reads them back where the same prompt comes again."""
    roles = {"prefill": "kv_producer", "decode": "kv_consumer"}
    if role not in roles:
        raise ValueError(f"torchtpu.argument: role={role!r} is not one of {sorted(roles)}")
    config = {"kv_connector": "ExampleConnector", "kv_role": roles[role],
              "kv_connector_extra_config": {"shared_storage_path": str(storage)}}
    return ("--kv-transfer-config", json.dumps(config))


@contextlib.contextmanager
def disaggregated(model: str, storage: str, *, platform: str = "tpu",
                  args: tuple[str, ...] = server.SERVE_ARGS, policy: str = "round_robin",
                  port: int | None = None, start_timeout: float = 900.0) -> Iterator[Fleet]:
    """A prefill and a decode ``vllm serve model`` behind vllm-router's prefill/decode mode.

    The router sends each request to the prefill instance first (one token), then to the decode
    instance; the prefill's KV goes from one to the other through files in ``storage`` (a local
    directory: one host, no RDMA). ``Fleet.replicas`` is (prefill URL, decode URL).
    """
    with _serving(model, [(*args, *kv_transfer_args(role, storage))
                          for role in ("prefill", "decode")],
                  platform, policy, port, start_timeout, disaggregated=True) as f:
        yield f


def _raise_interrupt(signum: int, frame: object) -> None:
    raise KeyboardInterrupt


def main(argv: list[str] | None = None) -> None:
    """Serve ``DIR`` from N replicas behind vllm-router until Ctrl-C (or SIGTERM); arguments
    after ``--`` replace the replicas' ``vllm serve`` defaults."""
    parser = argparse.ArgumentParser(prog="python -m torchtpu.integrations.vllm.routing",
                                     description=main.__doc__)
    parser.add_argument("model", help="a local model directory")
    parser.add_argument("--replicas", type=int, default=2)
    parser.add_argument("--platform", choices=("tpu", "cpu"), default="tpu")
    parser.add_argument("--policy", choices=POLICIES, default="cache_aware")
    parser.add_argument("--port", type=int, default=None, help="the router's (default: free)")
    parser.add_argument("--start-timeout", type=float, default=900.0)
    argv = sys.argv[1:] if argv is None else argv
    split = argv.index("--") if "--" in argv else len(argv)
    opts = parser.parse_args(argv[:split])
    args = tuple(argv[split + 1:]) or REPLICA_ARGS
    # SIGTERM unwinds like Ctrl-C, so the replicas and the router are stopped either way
    signal.signal(signal.SIGTERM, _raise_interrupt)
    with contextlib.suppress(KeyboardInterrupt):
        with fleet(opts.model, opts.replicas, platform=opts.platform, args=args,
                   policy=opts.policy, port=opts.port, start_timeout=opts.start_timeout) as f:
            print(f"router {f.url} ({opts.policy}) over {', '.join(f.replicas)}", flush=True)
            try:
                while True:
                    time.sleep(3600)
            finally:
                for url in f.replicas:
                    with contextlib.suppress(OSError, RuntimeError):
                        c = prefix_cache(url)
                        print(f"{url}: prefix cache {c.hits:.0f} of {c.queries:.0f} "
                              "prompt tokens hit", flush=True)


if __name__ == "__main__":
    main()
