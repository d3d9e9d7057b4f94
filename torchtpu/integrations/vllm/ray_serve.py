"""vLLM on device "tpu" behind Ray Serve: replicas of one engine each, OpenAI routes.

:func:`app` builds a Serve application (``torchtpu/integrations/ray_serve.py``: one OpenAI
ingress replica in front, a lost replica's requests sent again, too many replicas refused) of
``num_replicas`` replicas of ``VLLMServer``, a plain deployment wrapping vLLM's ``AsyncLLM``
(its OpenAI app, ``ray.serve.llm``, is built for Ray's GPU placement and vLLM's GPU platform),
each on the tpu device Ray assigned it. Each answer also names the JAX device the engine runs on
(``torchtpu.engine_device``).

vLLM's engine core is a child process of the replica; it exits when the replica's process dies
(a SIGKILL leaves it no chance to stop it): the plugin watches for that in every engine process
started here (``watch_parent``). Ray Serve then starts a new replica on the freed device.
"""

import functools
import os
import threading
import time
import uuid

from torchtpu import settings
from torchtpu.integrations import ray_serve

# small enough for two tiny engines on one host (on XLA:CPU the KV cache is then sized by what
# the engine holds: platform.fit_host_kv_cache); a caller's engine_args override these
ENGINE_DEFAULTS = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4,
                   "gpu_memory_utilization": 0.01, "distributed_executor_backend": "uni"}


def watch_parent() -> None:
    """In an engine process started by a replica: exit once the replica's process is gone."""
    parent = settings.VLLM_PARENT_PID.get()
    if parent is None or parent == os.getpid():
        return

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="torchtpu-vllm-parent", daemon=True).start()


@functools.cache
def _deployment():
    """The engine deployment (built on first use: Ray is imported then)."""
    from ray import serve

    @serve.deployment
    class VLLMServer(ray_serve.EngineReplica):
        """One vLLM engine on the replica's tpu device."""

        def __init__(self, model: str, engine_args: dict) -> None:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self.device = ray_serve.claim_device("vLLM")
            settings.VLLM.export(True)
            settings.VLLM_PARENT_PID.export(os.getpid())
            self.model = model
            args = AsyncEngineArgs(model=model, **{**ENGINE_DEFAULTS, **engine_args})
            self.engine = AsyncLLM.from_engine_args(args)
            self.engine_device: str | None = None

        def tokenizer(self):
            return self.engine.get_tokenizer()

        async def _generate(self, ids: list[int], body: dict) -> tuple[list[int], str, str]:
            from vllm import SamplingParams

            params = SamplingParams(temperature=float(body.get("temperature", 1.0)),
                                    max_tokens=int(body.get("max_tokens", 16)),
                                    seed=body.get("seed"),
                                    ignore_eos=bool(body.get("ignore_eos", False)))
            final = None
            async for out in self.engine.generate({"prompt_token_ids": ids}, params,
                                                  uuid.uuid4().hex):
                final = out
            choice = final.outputs[0]
            return list(choice.token_ids), choice.text, choice.finish_reason

        async def engine_facts(self) -> dict:
            if self.engine_device is None:
                self.engine_device = (await self.engine.collective_rpc("jax_device"))[0]
            return {"engine_device": self.engine_device}

    return VLLMServer


def app(model: str, *, num_replicas: int = 2, engine_args: dict | None = None,
        runtime_env: dict | None = None, retries: int = 2):
    """A Serve application of ``num_replicas`` vLLM replicas on tpu behind one OpenAI ingress
    (``serve.run(app(...))``); call it with Ray started (the host's devices are counted from its
    ``TPU`` resource). ``retries``: how often a request whose replica is lost is sent again."""
    return ray_serve.build(_deployment(), "vLLM", model, num_replicas=num_replicas,
                           engine_args=engine_args, runtime_env=runtime_env, retries=retries)
