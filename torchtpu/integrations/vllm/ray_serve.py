"""vLLM on device "tpu" behind Ray Serve: replicas of one engine each, OpenAI routes.

:func:`app` builds a Serve application of ``num_replicas`` replicas of :class:`VLLMServer`, a
plain deployment wrapping vLLM's ``AsyncLLM`` (its OpenAI app, ``ray.serve.llm``, is built for
Ray's GPU placement and vLLM's GPU platform) with OpenAI's ``/v1/completions`` and
``/v1/chat/completions`` routes. Each replica asks Ray for one ``TPU`` resource and drives the
device Ray assigned it: on a TPU host Ray's own TPU support hands the replica's process that chip
(``TPU_VISIBLE_CHIPS``, a slice of its own: replicas are independent engines), and where the
process sees every device of the host (XLA:CPU's forced device count standing in for chips) the
assigned index becomes ``TORCHTPU_LOCAL_DEVICE`` before the engine starts. Each answer names the
replica's process and the device its engine runs on (``torchtpu`` in the JSON), so a client can
see the requests spread.

vLLM's engine core is a child process of the replica; it exits when the replica's process dies
(a SIGKILL leaves it no chance to stop it): the plugin watches for that in every engine process
started here (``watch_parent``). Ray Serve then starts a new replica on the freed device; a
request that was in flight on the lost one fails with Serve's error (status 500) and is not
retried, since a generation may have been partly streamed.

A deployment that asks for more tpu devices than the host has is refused before any replica
starts (Ray would otherwise leave the extra replicas pending without end).
"""

import os
import threading
import time
import uuid

from torchtpu import errors

# set in the replica for its engine processes: the pid they must not outlive
PARENT_ENV = "TORCHTPU_VLLM_PARENT_PID"
# small enough for two tiny engines on one host; a caller's engine_args override these
ENGINE_DEFAULTS = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4,
                   "kv_cache_memory_bytes": 8 << 20, "gpu_memory_utilization": 0.01,
                   "distributed_executor_backend": "uni"}


def watch_parent() -> None:
    """In an engine process started by a replica: exit once the replica's process is gone."""
    parent = os.environ.get(PARENT_ENV)
    if not parent or int(parent) == os.getpid():
        return

    def watch() -> None:
        while True:
            if os.getppid() != int(parent):
                os._exit(1)
            time.sleep(0.5)

    threading.Thread(target=watch, name="torchtpu-vllm-parent", daemon=True).start()


def host_devices() -> int:
    """The tpu devices Ray counts on this node (its ``TPU`` resource)."""
    import ray

    return int(ray.cluster_resources().get("TPU", 0))


def check_devices(num_replicas: int, available: int) -> None:
    """Refuse more replicas (one device each) than the host has devices."""
    if num_replicas > available:
        raise ValueError(errors.message(
            "device", f"the Serve deployment asks for {num_replicas} tpu devices "
            f"({num_replicas} replicas of one device each), but this host has {available}: "
            f"ask for at most {available} replicas"))


def _device_index() -> int:
    """The tpu device Ray assigned this replica (its ``TPU`` accelerator id)."""
    import ray

    ids = ray.get_runtime_context().get_accelerator_ids().get("TPU") or []
    if len(ids) != 1:
        raise RuntimeError(errors.message(
            "device", f"a vLLM replica drives one tpu device, but Ray assigned it {ids}: "
            "start it with ray_actor_options={'resources': {'TPU': 1}}"))
    return int(ids[0])


def _deployment():
    """The Serve deployment class (built on first use: Ray and FastAPI are imported then)."""
    from fastapi import FastAPI, Request
    from ray import serve

    api = FastAPI()

    @serve.deployment
    @serve.ingress(api)
    class VLLMServer:
        """One vLLM engine on the replica's tpu device."""

        def __init__(self, model: str, engine_args: dict) -> None:
            from vllm import AsyncEngineArgs
            from vllm.v1.engine.async_llm import AsyncLLM

            self.device = _device_index()
            os.environ["TORCHTPU_LOCAL_DEVICE"] = str(self.device)
            os.environ["TORCHTPU_VLLM"] = "1"
            os.environ[PARENT_ENV] = str(os.getpid())
            self.model = model
            args = AsyncEngineArgs(model=model, **{**ENGINE_DEFAULTS, **engine_args})
            self.engine = AsyncLLM.from_engine_args(args)
            self.engine_device: str | None = None

        async def _generate(self, prompt: dict, body: dict) -> tuple[list, str, str]:
            from vllm import SamplingParams

            params = SamplingParams(temperature=float(body.get("temperature", 1.0)),
                                    max_tokens=int(body.get("max_tokens", 16)),
                                    seed=body.get("seed"))
            final = None
            async for out in self.engine.generate(prompt, params, uuid.uuid4().hex):
                final = out
            choice = final.outputs[0]
            return list(choice.token_ids), choice.text, choice.finish_reason

        async def _answer(self, kind: str, body: dict, tokens: list, text: str,
                          finish: str, prompt_tokens: int) -> dict:
            if self.engine_device is None:
                self.engine_device = (await self.engine.collective_rpc("jax_device"))[0]
            choice = ({"message": {"role": "assistant", "content": text}} if kind == "chat"
                      else {"text": text})
            if body.get("return_token_ids"):
                choice["token_ids"] = tokens
            return {
                "id": f"{kind}-{uuid.uuid4().hex}", "model": self.model,
                "object": "chat.completion" if kind == "chat" else "text_completion",
                "created": int(time.time()),
                "choices": [{"index": 0, "finish_reason": finish, **choice}],
                "usage": {"prompt_tokens": prompt_tokens, "completion_tokens": len(tokens),
                          "total_tokens": prompt_tokens + len(tokens)},
                "torchtpu": {"pid": os.getpid(), "device_index": self.device,
                             "engine_device": self.engine_device},
            }

        @api.post("/v1/completions")
        async def completions(self, request: Request) -> dict:
            body = await request.json()
            prompt = body["prompt"]
            ids = (prompt if isinstance(prompt, list)
                   else self.engine.get_tokenizer().encode(prompt))
            tokens, text, finish = await self._generate({"prompt_token_ids": ids}, body)
            return await self._answer("text", body, tokens, text, finish, len(ids))

        @api.post("/v1/chat/completions")
        async def chat(self, request: Request) -> dict:
            body = await request.json()
            tokenizer = self.engine.get_tokenizer()
            ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                return_dict=False)
            tokens, text, finish = await self._generate({"prompt_token_ids": ids}, body)
            return await self._answer("chat", body, tokens, text, finish, len(ids))

        @api.get("/health")
        async def health(self) -> dict:
            return {"pid": os.getpid(), "device_index": self.device}

    return VLLMServer


def app(model: str, *, num_replicas: int = 2, engine_args: dict | None = None,
        runtime_env: dict | None = None):
    """A Serve application of ``num_replicas`` vLLM replicas on tpu (``serve.run(app(...))``);
    call it with Ray started (the host's devices are counted from its ``TPU`` resource)."""
    check_devices(num_replicas, host_devices())
    options = {"resources": {"TPU": 1}}
    if runtime_env:
        options["runtime_env"] = runtime_env
    return _deployment().options(num_replicas=num_replicas, ray_actor_options=options,
                                 max_ongoing_requests=16).bind(model, engine_args or {})
