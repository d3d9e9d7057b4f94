"""SGLang on device "tpu" behind Ray Serve: replicas of one ``sglang.Engine`` each, OpenAI routes.

:func:`app` builds a Serve application (``torchtpu/integrations/ray_serve.py``: one OpenAI
ingress replica in front, a lost replica's requests sent again, too many replicas refused) of
``num_replicas`` replicas of ``SGLangServer``, a plain deployment wrapping SGLang's offline
``Engine`` (its tokenizer manager in the replica's process, its scheduler and detokenizer in
processes it starts), each on the tpu device Ray assigned it. SGLang's own Ray launcher
(``sglang.srt.ray``) places one scheduler actor per GPU of a placement group; on tpu the engine's
processes stay children of the replica and take its device from ``TORCHTPU_LOCAL_DEVICE``. Each
answer also names them (``torchtpu.engine_pids``). SGLang's scheduler and detokenizer end
themselves when their parent dies (``kill_itself_when_parent_died``), so a lost replica leaves
none of its engine behind; Serve starts a new replica on the freed device.
"""

from __future__ import annotations

import functools

from torchtpu import settings
from torchtpu.integrations import ray_serve

# SGLang's finish reasons ("length", "stop", "abort") as OpenAI's
_FINISH = {"length": "length", "stop": "stop"}


@functools.cache
def _deployment():
    """The engine deployment (built on first use: Ray is imported then)."""
    from ray import serve

    @serve.deployment
    class SGLangServer(ray_serve.EngineReplica):
        """One SGLang engine on the replica's tpu device."""

        def __init__(self, model: str, engine_args: dict) -> None:
            import sglang

            self.device = ray_serve.claim_device("SGLang")
            settings.SGLANG.export(True)
            self.model = model
            self.engine = sglang.Engine(model_path=model, device="tpu", **engine_args)

        def tokenizer(self):
            return self.engine.tokenizer_manager.tokenizer

        async def _generate(self, ids: list[int], body: dict) -> tuple[list[int], str, str]:
            params = {"temperature": float(body.get("temperature", 1.0)),
                      "max_new_tokens": int(body.get("max_tokens", 16)),
                      "ignore_eos": bool(body.get("ignore_eos", False))}
            if body.get("seed") is not None:
                params["sampling_seed"] = int(body["seed"])
            out = await self.engine.async_generate(input_ids=ids, sampling_params=params)
            reason = (out["meta_info"].get("finish_reason") or {}).get("type")
            return list(out["output_ids"]), out["text"], _FINISH.get(reason, reason)

        async def engine_facts(self) -> dict:
            return {"engine_pids": list(self.engine.get_all_child_pids())}

        def __del__(self) -> None:
            # Serve's graceful stop of a replica; SGLang's own atexit hook covers the process's
            # exit, a lost process its children's parent watch
            engine = getattr(self, "engine", None)
            if engine is not None:
                engine.shutdown()

    return SGLangServer


def app(model: str, *, num_replicas: int = 2, engine_args: dict | None = None,
        runtime_env: dict | None = None, retries: int = 2):
    """A Serve application of ``num_replicas`` SGLang replicas on tpu behind one OpenAI ingress
    (``serve.run(app(...))``); call it with Ray started (the host's devices are counted from its
    ``TPU`` resource). ``engine_args``: ``sglang.Engine``'s (``ServerArgs``) keywords.
    ``retries``: how often a request whose replica is lost is sent again."""
    return ray_serve.build(_deployment(), "SGLang", model, num_replicas=num_replicas,
                           engine_args=engine_args, runtime_env=runtime_env, retries=retries)
