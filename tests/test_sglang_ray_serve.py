"""SGLang on tpu under Ray Serve (``torchtpu/integrations/sglang/ray_serve.py``): 2 replicas of
``sglang.Engine`` on one host, each driving its own device (XLA:CPU's forced device count standing
in for a host's two chips, Ray's ``TPU`` resource set to 2), OpenAI completions and chat requests
over HTTP routed to both, each answer's greedy tokens equal to Hugging Face's ``generate`` on CPU;
each engine's processes (scheduler, detokenizer) were handed their replica's device. A deployment
asking for more devices than the host has is refused before any replica starts. One local Ray
instance, localhost only, bounded in time, Serve and Ray shut down after it, also on failure.
Needs the SGLang venv (``python -m torchtpu.integrations.sglang.install``) with
``pip install -e '.[serve]'``.
"""

import pytest

pytest.importorskip("sglang", reason="SGLang is not installed: "
                    "python -m torchtpu.integrations.sglang.install")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[serve]'")

import psutil  # noqa: E402
from ray import serve  # noqa: E402

from torchtpu.integrations.sglang import ray_serve  # noqa: E402
from torchtpu.integrations.vllm.tiny import save_tiny_model  # noqa: E402
from torchtpu.testing import serve_openai  # noqa: E402
from torchtpu.testing.conformance import time_limit  # noqa: E402
from torchtpu.testing.serve_openai import REQUEST_S  # noqa: E402

DEVICES = 2
START_S = 900  # two engines starting side by side
PROMPTS = ["hello", "tpu serve", "abc"]
# float32 as Hugging Face loads the tiny model; a KV pool a few requests fill
ENGINE_ARGS = {"dtype": "float32", "max_total_tokens": 4096, "random_seed": 0}
# tokens of the requests in flight when a replica is lost (EOS ignored): still running when it is
# (eager steps here: ~0.5-1 s a token at load 15-30; 64 ran past the requests' 120 s)
LONG = 16


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("serve") / "model", hidden=64, layers=2)


@pytest.fixture(scope="module")
def local_serve():
    with serve_openai.local_serve(DEVICES, {"TORCHTPU_SGLANG": "1"}) as url:
        yield url


def test_more_replicas_than_devices_is_refused(local_serve, model):
    serve_openai.refuses_more_replicas_than_devices(ray_serve.app, model, DEVICES)


@pytest.fixture(scope="module")
def served(local_serve, model):
    """The application of two replicas, both answering: pid -> each one's ``torchtpu`` block."""
    with time_limit(START_S):
        serve.run(ray_serve.app(str(model), num_replicas=DEVICES, engine_args=ENGINE_ARGS),
                  name="sglang", route_prefix="/")
        seen = serve_openai.until_replicas(local_serve, serve_openai.expected(model, PROMPTS),
                                           DEVICES, START_S)
    return seen


def test_two_replicas_answer_hf_greedy_tokens(served):
    # every answer of until_replicas' rounds was checked against HF's greedy tokens
    assert sorted(t["device_index"] for t in served.values()) == list(range(DEVICES)), served
    # each replica's engine processes were started on its device, and only there
    for block in served.values():
        pids = block["engine_pids"]
        assert pids, block
        devices = {psutil.Process(p).environ().get("TORCHTPU_LOCAL_DEVICE") for p in pids}
        assert devices == {str(block["device_index"])}, (block, devices)


@pytest.mark.full  # a replica lost and started again: ~2 min more, ~4 GB in all here
def test_a_lost_replica_is_replaced_and_its_requests_answered(local_serve, model, served):
    with time_limit(START_S + REQUEST_S + 90):
        after = serve_openai.survive_a_lost_replica(local_serve, model, PROMPTS, served, LONG,
                                                    DEVICES, START_S)
    assert sorted(t["device_index"] for t in after.values()) == list(range(DEVICES)), after
