"""vLLM on device "tpu" behind Ray Serve: replicas of one engine each, OpenAI routes.

:func:`app` builds a Serve application of ``num_replicas`` replicas of ``VLLMServer``, a plain
deployment wrapping vLLM's ``AsyncLLM`` (its OpenAI app, ``ray.serve.llm``, is built for Ray's
GPU placement and vLLM's GPU platform), behind one ingress replica (``OpenAIRoutes``) with
OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` routes. Each engine replica asks Ray
for one ``TPU`` resource and drives the device Ray assigned it: on a TPU host Ray's own TPU
support hands the replica's process that chip (``TPU_VISIBLE_CHIPS``, a slice of its own:
replicas are independent engines), and where the process sees every device of the host
(XLA:CPU's forced device count standing in for chips) the assigned index becomes
``TORCHTPU_LOCAL_DEVICE`` before the engine starts. Each answer names the replica's process and
the device its engine runs on (``torchtpu`` in the JSON), so a client can see the requests
spread.

vLLM's engine core is a child process of the replica; it exits when the replica's process dies
(a SIGKILL leaves it no chance to stop it): the plugin watches for that in every engine process
started here (``watch_parent``). Ray Serve then starts a new replica on the freed device. A
request that was in flight on the lost replica is sent again by the ingress to another (answers
are whole, never streamed, so nothing reached the client yet; ``torchtpu.retries`` in the answer
counts the resends); where every try is lost, it answers 503 naming the lost replica (Serve's
own proxy would answer a bare "Internal Server Error").

A deployment that asks for more tpu devices than the host has is refused before any replica
starts (Ray would otherwise leave the extra replicas pending without end).
"""

import functools
import os
import threading
import time
import uuid

from torchtpu import errors

# set in the replica for its engine processes: the pid they must not outlive
PARENT_ENV = "TORCHTPU_VLLM_PARENT_PID"
# small enough for two tiny engines on one host (on XLA:CPU the KV cache is then sized by what
# the engine holds: platform.fit_host_kv_cache); a caller's engine_args override these
ENGINE_DEFAULTS = {"dtype": "float32", "max_model_len": 256, "max_num_seqs": 4,
                   "gpu_memory_utilization": 0.01, "distributed_executor_backend": "uni"}


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


@functools.cache
def _deployments() -> tuple:
    """The engine deployment and the OpenAI ingress in front of it (built on first use: Ray and
    FastAPI are imported then)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from ray import serve
    from ray.exceptions import RayActorError

    @serve.deployment
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
                                    seed=body.get("seed"),
                                    ignore_eos=bool(body.get("ignore_eos", False)))
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

        async def completions(self, body: dict) -> dict:
            prompt = body["prompt"]
            ids = (prompt if isinstance(prompt, list)
                   else self.engine.get_tokenizer().encode(prompt))
            tokens, text, finish = await self._generate({"prompt_token_ids": ids}, body)
            return await self._answer("text", body, tokens, text, finish, len(ids))

        async def chat(self, body: dict) -> dict:
            tokenizer = self.engine.get_tokenizer()
            ids = tokenizer.apply_chat_template(body["messages"], add_generation_prompt=True,
                                                return_dict=False)
            tokens, text, finish = await self._generate({"prompt_token_ids": ids}, body)
            return await self._answer("chat", body, tokens, text, finish, len(ids))

        async def health(self) -> dict:
            return {"pid": os.getpid(), "device_index": self.device}

    api = FastAPI()

    @serve.deployment
    @serve.ingress(api)
    class OpenAIRoutes:
        """OpenAI's routes, each request passed to an engine replica; one whose replica is lost
        while it runs is sent again to another (``retries`` times)."""

        def __init__(self, engines, retries: int) -> None:
            self.engines, self.retries = engines, retries

        async def _call(self, method: str, body: dict):
            lost = None
            for attempt in range(self.retries + 1):
                try:
                    out = await getattr(self.engines, method).remote(body)
                except RayActorError as e:  # the replica's process died under the request
                    lost = e
                    continue
                if isinstance(out, dict) and "torchtpu" in out:
                    out["torchtpu"]["retries"] = attempt
                return out
            return JSONResponse(status_code=503, content={"error": {
                "type": "replica_lost", "message": errors.message(
                    "distributed", f"the vLLM replica serving this request was lost "
                    f"({type(lost).__name__}) and {self.retries} retries on other replicas "
                    "were lost too: retry when Serve has replaced them")}})

        @api.post("/v1/completions")
        async def completions(self, request: Request):
            return await self._call("completions", await request.json())

        @api.post("/v1/chat/completions")
        async def chat(self, request: Request):
            return await self._call("chat", await request.json())

        @api.get("/health")
        async def health(self):
            return await self._call("health", {})

    return VLLMServer, OpenAIRoutes


def app(model: str, *, num_replicas: int = 2, engine_args: dict | None = None,
        runtime_env: dict | None = None, retries: int = 2):
    """A Serve application of ``num_replicas`` vLLM replicas on tpu behind one OpenAI ingress
    (``serve.run(app(...))``); call it with Ray started (the host's devices are counted from its
    ``TPU`` resource). ``retries``: how often a request whose replica is lost is sent again."""
    check_devices(num_replicas, host_devices())
    options = {"resources": {"TPU": 1}}
    if runtime_env:
        options["runtime_env"] = runtime_env
    server, routes = _deployments()
    engines = server.options(num_replicas=num_replicas, ray_actor_options=options,
                             max_ongoing_requests=16).bind(model, engine_args or {})
    ingress = {"num_cpus": 0, **({"runtime_env": runtime_env} if runtime_env else {})}
    return routes.options(ray_actor_options=ingress, max_ongoing_requests=64).bind(
        engines, retries)
