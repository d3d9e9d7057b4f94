"""Start and stop SGLang's HTTP server (``python -m sglang.launch_server``) on localhost.

:func:`serve` runs it on a free port on device "tpu", waits until ``/health`` answers and stops
its whole process group (the server, its scheduler and detokenizer) when the block exits, on
failure too. The process steps and the HTTP clients are vLLM's launcher's
(``torchtpu.integrations.vllm.server``), which import nothing of vLLM.
"""

from __future__ import annotations

import contextlib
import os
import sys
import time
from collections.abc import Iterator

from torchtpu import settings
from torchtpu.integrations.vllm.server import free_port, spawn, stop, wait_healthy

# float32 as Hugging Face loads the tiny test models; a KV pool a few requests fill
SERVE_ARGS = ("--dtype", "float32", "--max-total-tokens", "4096", "--random-seed", "0")


def command(model: str, port: int,
            args: tuple[str, ...] = SERVE_ARGS) -> tuple[list[str], dict[str, str]]:
    """The command line and environment of SGLang's server for ``model`` on tpu at ``port``.

    The scheduler's torch.distributed store gets a port of its own unless ``args`` names one
    (``--nccl-port``): left to SGLang it is any port free at the scheduler's start, which can be
    ``port`` itself, since the HTTP server binds it only later. That store listens on every
    interface (PyTorch's TCPStore binds no single address), not only on loopback."""
    if "--nccl-port" not in args:
        store = free_port()
        while store == port:
            store = free_port()
        args = (*args, "--nccl-port", str(store))
    env = {**os.environ, **settings.child_env({settings.SGLANG: True})}
    cmd = [sys.executable, "-m", "sglang.launch_server", "--model-path", model, "--device", "tpu",
           "--host", "127.0.0.1", "--port", str(port), *args]
    return cmd, env


@contextlib.contextmanager
def serve(model: str, *, args: tuple[str, ...] = SERVE_ARGS,
          start_timeout: float = 900.0) -> Iterator[str]:
    """Yield the base URL (``http://127.0.0.1:PORT``) of a running SGLang server for ``model``."""
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    proc, log = spawn(*command(model, port, args))
    try:
        wait_healthy(proc, log, url + "/health", time.monotonic() + start_timeout,
                     "sglang.launch_server")
        yield url
    finally:
        stop(proc)
        log.close()
