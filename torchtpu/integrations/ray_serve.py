"""Serving engines on device "tpu" behind Ray Serve: what vLLM's and SGLang's deployments share.

An application is ``num_replicas`` engine replicas (one engine each, on one tpu device) behind one
ingress replica with OpenAI's ``/v1/completions`` and ``/v1/chat/completions`` routes and no
device (:func:`build`). Each engine replica asks Ray for one ``TPU`` resource and drives the device
Ray assigned it (:func:`claim_device`): on a TPU host Ray's own TPU support hands the replica's
process that chip (``TPU_VISIBLE_CHIPS``), and where the process sees every device of the host
(XLA:CPU's forced device count standing in for chips) the assigned index becomes
``TORCHTPU_LOCAL_DEVICE``, which the engine's processes inherit. An engine's deployment subclasses
:class:`EngineReplica` and supplies generation; each answer names the replica's process and its
device (``torchtpu`` in the JSON), so a client can see the requests spread.

A request in flight on a replica whose process is lost is sent again by the ingress to another
(answers are whole, never streamed, so nothing reached the client yet; ``torchtpu.retries``
counts the resends); where every try is lost it answers 503 naming the lost replica (Serve's own
proxy would answer a bare "Internal Server Error"). A deployment asking for more tpu devices than
the host has is refused before any replica starts (:func:`check_devices`: Ray would otherwise
leave the extra replicas pending without end).
"""

# no `from __future__ import annotations`: FastAPI reads the routes' parameter types (Request)
# from their annotations, which must be classes, not names of the function's local imports
import functools
import os
import time
import uuid

from torchtpu import errors, settings


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


def claim_device(engine: str) -> int:
    """In an engine replica, before its engine starts: the tpu device Ray assigned it (its
    ``TPU`` accelerator id), made the device of this process and of the ones it starts."""
    import ray

    ids = ray.get_runtime_context().get_accelerator_ids().get("TPU") or []
    if len(ids) != 1:
        raise RuntimeError(errors.message(
            "device", f"a {engine} replica drives one tpu device, but Ray assigned it {ids}: "
            "start it with ray_actor_options={'resources': {'TPU': 1}}"))
    settings.LOCAL_DEVICE.export(int(ids[0]))
    return int(ids[0])


class EngineReplica:
    """OpenAI's completions and chat answered by one engine; a Serve deployment of an engine
    subclasses it, sets ``model`` and ``device`` and supplies ``_generate`` and ``tokenizer``."""

    model: str
    device: int

    async def _generate(self, ids: list[int], body: dict) -> tuple[list[int], str, str]:
        """The greedy or sampled answer to prompt ``ids`` under OpenAI's ``body``: (token ids,
        text, finish reason)."""
        raise NotImplementedError

    def tokenizer(self):
        """The engine's Hugging Face tokenizer."""
        raise NotImplementedError

    async def engine_facts(self) -> dict:
        """What the answer's ``torchtpu`` block says about the engine besides its replica."""
        return {}

    async def _answer(self, kind: str, body: dict, ids: list[int]) -> dict:
        tokens, text, finish = await self._generate(ids, body)
        choice = ({"message": {"role": "assistant", "content": text}} if kind == "chat"
                  else {"text": text})
        if body.get("return_token_ids"):
            choice["token_ids"] = tokens
        return {
            "id": f"{kind}-{uuid.uuid4().hex}", "model": self.model,
            "object": "chat.completion" if kind == "chat" else "text_completion",
            "created": int(time.time()),
            "choices": [{"index": 0, "finish_reason": finish, **choice}],
            "usage": {"prompt_tokens": len(ids), "completion_tokens": len(tokens),
                      "total_tokens": len(ids) + len(tokens)},
            "torchtpu": {"pid": os.getpid(), "device_index": self.device,
                         **await self.engine_facts()},
        }

    async def completions(self, body: dict) -> dict:
        prompt = body["prompt"]
        ids = prompt if isinstance(prompt, list) else self.tokenizer().encode(prompt)
        return await self._answer("text", body, list(ids))

    async def chat(self, body: dict) -> dict:
        ids = self.tokenizer().apply_chat_template(body["messages"], add_generation_prompt=True,
                                                   return_dict=False)
        return await self._answer("chat", body, list(ids))

    async def health(self) -> dict:
        return {"pid": os.getpid(), "device_index": self.device}


@functools.cache
def _ingress():
    """The OpenAI ingress deployment (built on first use: Ray and FastAPI are imported then)."""
    from fastapi import FastAPI, Request
    from fastapi.responses import JSONResponse
    from ray import serve
    from ray.exceptions import RayActorError

    api = FastAPI()

    @serve.deployment
    @serve.ingress(api)
    class OpenAIRoutes:
        """OpenAI's routes, each request passed to an engine replica; one whose replica is lost
        while it runs is sent again to another (``retries`` times)."""

        def __init__(self, engines, retries: int, engine: str) -> None:
            self.engines, self.retries, self.engine = engines, retries, engine

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
                    "distributed", f"the {self.engine} replica serving this request was lost "
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

    return OpenAIRoutes


def build(server, engine: str, model: str, *, num_replicas: int, engine_args: dict | None,
          runtime_env: dict | None, retries: int):
    """The application: ``num_replicas`` replicas of the deployment ``server`` (an
    :class:`EngineReplica` built from ``model`` and ``engine_args``), one ``TPU`` each, behind
    the ingress; ``engine`` names the engine in errors. Call it with Ray started."""
    check_devices(num_replicas, host_devices())
    options = {"resources": {"TPU": 1}}
    if runtime_env:
        options["runtime_env"] = runtime_env
    engines = server.options(num_replicas=num_replicas, ray_actor_options=options,
                             max_ongoing_requests=16).bind(model, engine_args or {})
    ingress = {"num_cpus": 0, **({"runtime_env": runtime_env} if runtime_env else {})}
    return _ingress().options(ray_actor_options=ingress, max_ongoing_requests=64).bind(
        engines, retries, engine)
