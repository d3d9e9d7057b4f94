"""Test settings: no silent CPU fallback, Ray's memory monitor off, a fixed seed per test,
torchrun's variables left as each test found them, no Strict loop's freeze left
(``eager/frozen.py``), ``fresh_dynamo``, and the ``full`` marker:
such tests (larger shapes, slower integrations) run only with ``TORCHTPU_TESTS=full``, so the
default suite stays inside CI's budget.

``TORCHTPU_TESTS_REQUIRE=mod,mod`` names modules the run must be able to import (CI's main stage
lists its extras'): the tests that need them skip where they are missing, so a broken install
would otherwise pass as skips. The session stops before any test if one does not import.

The suite runs on pytest-xdist workers (``-n auto --dist loadfile`` in pyproject.toml): one per
core, at most ``TORCHTPU_TEST_WORKERS`` (default 4: each worker holds its own compiled programs,
~1-3 GiB), each file on one worker so its module fixtures and shared programs are built once.
``-n 0`` runs in one process (quicker for a single test: no workers to start)."""

import importlib
import os

os.environ.setdefault("TORCHTPU_CPU_FALLBACK", "error")
# Ray's memory monitor (on by default) kills a local Ray instance's workers when the whole host
# passes 95% of its memory: on a shared CI box other jobs' memory killed test_ray's 0.4 GB
# workers ("6 worker(s) were killed due to the node running low on memory", twice in session
# 23's heavy stage). Off for every Ray the tests start (raylet reads it from the environment
# when it starts; verl's main_ppo inherits it); the kernel's OOM killer still stands.
os.environ.setdefault("RAY_memory_monitor_refresh_ms", "0")

import pytest  # noqa: E402
import torch  # noqa: E402

import torchtpu  # noqa: E402, F401

FULL = os.environ.get("TORCHTPU_TESTS") == "full"


def pytest_configure(config):
    config.addinivalue_line("markers", "full: runs only with TORCHTPU_TESTS=full")
    config.addinivalue_line("markers", "engine_process_group: the file's engine keeps a default "
                            "process group for the process on purpose")
    required = [m for m in os.environ.get("TORCHTPU_TESTS_REQUIRE", "").split(",") if m]
    broken = []
    for name in required:
        try:
            importlib.import_module(name)
        except Exception as error:  # noqa: BLE001 - any failure to import is the finding
            broken.append(f"{name} ({type(error).__name__}: {error})")
    if broken:
        raise pytest.UsageError("TORCHTPU_TESTS_REQUIRE: these do not import, so the tests that "
                                "need them would skip: " + "; ".join(broken))


def pytest_runtest_logreport(report):
    """Each failure as it happens, one line (the test and its error's first line), to the file
    ``TORCHTPU_TESTS_FAILURES`` names: a run stopped at CI's time limit prints no summary, and
    CI's tail shows this file instead (``.ci/run``)."""
    path = os.environ.get("TORCHTPU_TESTS_FAILURES")
    if not path or not report.failed or os.environ.get("PYTEST_XDIST_WORKER"):
        return  # (a worker's reports reach the controller, which writes them)
    crash = getattr(report.longrepr, "reprcrash", None)
    message = crash.message if crash is not None else str(report.longrepr).strip()
    first = (message.splitlines() or [""])[0][:200]
    # A rank's or a child's traceback travels inside the message: its last frame is where it
    # failed, which the first line alone does not say.
    frames = [line.strip() for line in message.splitlines() if line.strip().startswith('File "')]
    where = f"\n    innermost frame: {frames[-1][:200]}" if frames else ""
    with open(path, "a") as f:
        f.write(f"{'FAILED' if report.when == 'call' else 'ERROR'} {report.nodeid} - {first}"
                f"{where}\n")


@pytest.hookimpl(optionalhook=True)  # venvs without pytest-xdist still load this file
def pytest_xdist_auto_num_workers(config):
    cap = int(os.environ.get("TORCHTPU_TEST_WORKERS", "4"))
    return max(1, min(len(os.sched_getaffinity(0)), cap))


def pytest_collection_modifyitems(config, items):
    if FULL:
        return
    skip = pytest.mark.skip(reason="a full-suite test: set TORCHTPU_TESTS=full")
    for item in items:
        if "full" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
    yield


# torchrun's variables: a test that leaves them set changes what later tests on its worker
# start (a leaked WORLD_SIZE=2 made HF's Trainer start a two-process CPU group and fail).
_LAUNCH_VARIABLES = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK",
                     "MASTER_ADDR", "MASTER_PORT")


@pytest.fixture(autouse=True)
def _launch_variables_kept():
    before = {k: os.environ.get(k) for k in _LAUNCH_VARIABLES}
    yield
    after = {k: os.environ.get(k) for k in _LAUNCH_VARIABLES}
    assert after == before, f"the test changed torchrun's variables: {before} -> {after}"


# torchtpu's own process state in the environment, set once for the process by design: where it
# placed Inductor's cache (``compile/torch_caches.py``), the device an engine's in-process worker
# took (``integrations/vllm/worker.py``).
_OWN_VARIABLES = ("TORCHTPU_PLACED_INDUCTOR_CACHE_DIR", "TORCHTPU_LOCAL_DEVICE")


def _process_globals(item) -> dict:
    """What one test can change for every later test on its worker: each is a setting a test
    must put back (``monkeypatch``, a ``with`` block, a fixture). A file whose engine keeps a
    process group for the process on purpose (vLLM's, SGLang's) says so with the
    ``engine_process_group`` marker."""
    import jax
    import torch.distributed as dist
    from jax._src import compilation_cache as jax_cache

    from torchtpu import settings
    from torchtpu.eager import modes

    state = {
        "the eager mode": modes.get_eager_mode(),
        "torchtpu.settings' overridden values": settings.active_overrides(),
        "torchtpu's environment variables": {
            k: v for k, v in os.environ.items()
            if k.startswith(("TORCHTPU_", "TORCH_TPU_")) and k not in _OWN_VARIABLES},
        "the compile cache": (jax.config.jax_compilation_cache_dir, id(jax_cache._cache)),
    }
    if item.get_closest_marker("engine_process_group") is None:
        state["a default process group"] = dist.is_available() and dist.is_initialized()
    return state


@pytest.fixture(autouse=True)
def _process_globals_kept(request):
    # Set up before (so torn down after) the fixtures a test asks for: monkeypatch has put its
    # changes back by the time this compares.
    before = _process_globals(request.node)
    yield
    after = _process_globals(request.node)
    changed = [k for k in before if after[k] != before[k]]
    assert not changed, "the test left changed: " + "; ".join(
        f"{k}: {before[k]!r} -> {after[k]!r}" for k in changed)


@pytest.fixture(autouse=True)
def _strict_loop_unfrozen():
    # A test's steady Strict loop freezes the heap (``eager/frozen.py``) until a step makes a
    # program: later tests on the worker would find their cycles frozen with it.
    yield
    from torchtpu.eager import frozen

    frozen.STRICT_LOOP.reset()


@pytest.fixture
def fresh_dynamo():
    """Dynamo's caches emptied around a test: graphs cached for another test's model would
    change what gets compiled (and counted) here."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


@pytest.fixture
def buckets_off():
    """Eager size buckets off around a test: they examine every later call of an op whose sizes
    grew anywhere in the process before, and such a call reads held values computed, so what a
    test of held values counts would depend on what ran first."""
    from torchtpu.compile import eager_buckets

    was = eager_buckets.enabled()
    eager_buckets.set_enabled(False)
    yield
    eager_buckets.set_enabled(was)
