"""vLLM on tpu under Ray Serve (``torchtpu/integrations/vllm/ray_serve.py``): 2 replicas on one
host, each driving its own device (XLA:CPU's forced device count standing in for a host's two
chips, Ray's ``TPU`` resource set to 2), OpenAI completions and chat requests over HTTP routed
to both, each answer's greedy tokens equal to Hugging Face's ``generate`` on CPU. One replica's
process is SIGKILLed while requests are in flight: each of those is answered (the ingress sends
those of the lost replica again to the other), the replica's engine process exits with it, Serve
starts a new replica on the freed device and later requests succeed on both. A deployment asking
for more devices than the host has is refused before any replica starts (CI's smoke selection;
the two-replica test is a full one: ~3 min and ~4 GB here, bench/RESULTS.md, "rlserve2"). One
local Ray instance, localhost only, bounded in time, Serve and Ray shut down
after it, also on failure. Needs the vLLM venv with ``pip install -e '.[serve]'``.
"""

import pytest

pytest.importorskip("vllm", reason="vLLM is not installed (docs, Serving (vLLM))")
pytest.importorskip("ray.serve", reason="Ray Serve is not installed: pip install -e '.[serve]'")

from ray import serve  # noqa: E402

from torchtpu.integrations.vllm import ray_serve  # noqa: E402
from torchtpu.integrations.vllm.tiny import save_tiny_model  # noqa: E402
from torchtpu.testing import serve_openai  # noqa: E402
from torchtpu.testing.conformance import time_limit  # noqa: E402
from torchtpu.testing.serve_openai import REQUEST_S, expected  # noqa: E402

DEVICES = 2
START_S = 900  # two engines starting side by side (~1 min here at load ~4; 5-11 at 12-22)
PROMPTS = ["hello", "tpu serve", "abc"]
# tokens of the requests in flight when a replica is lost (EOS ignored), long enough to be still
# running when it is (at 200, some had finished on it within 0.5 s)
LONG = 480
ENGINE_ARGS = {"max_model_len": 512}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return save_tiny_model(tmp_path_factory.mktemp("serve") / "model", hidden=64, layers=2)


@pytest.fixture(scope="module")
def local_serve():
    # each step shape compiles when a request first meets it, not all at start-up
    env = {"TORCHTPU_VLLM": "1", "TORCHTPU_VLLM_CAPTURE": "lazy"}
    with serve_openai.local_serve(DEVICES, env) as url:
        yield url


def _until_both(base: str, want: dict, seconds: float, avoid: int | None = None) -> dict:
    return serve_openai.until_replicas(base, want, DEVICES, seconds, avoid)


def test_more_replicas_than_devices_is_refused(local_serve, model):
    serve_openai.refuses_more_replicas_than_devices(ray_serve.app, model, DEVICES)


@pytest.mark.full  # two engines and their replicas: ~4 GB of host memory, ~3 min here
def test_two_replicas_serve_and_survive_a_lost_one(local_serve, model):
    want = expected(model, PROMPTS)
    with time_limit(START_S):
        serve.run(ray_serve.app(str(model), num_replicas=DEVICES, engine_args=ENGINE_ARGS),
                  name="vllm", route_prefix="/")
    with time_limit(START_S):
        before = _until_both(local_serve, want, START_S)
    # each replica drives its own device: Ray's index, and the engine's JAX device
    assert sorted(t["device_index"] for t in before.values()) == list(range(DEVICES)), before
    assert len({t["engine_device"] for t in before.values()}) == DEVICES, before

    with time_limit(START_S + REQUEST_S + 90):
        after = serve_openai.survive_a_lost_replica(local_serve, model, PROMPTS, before, LONG,
                                                    DEVICES, START_S)
    assert sorted(t["device_index"] for t in after.values()) == list(range(DEVICES)), after
