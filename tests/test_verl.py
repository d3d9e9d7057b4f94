"""verl 0.9 on device "tpu" (``torchtpu/integrations/verl``), in the vLLM venv with verl installed
(``python -m torchtpu.integrations.verl.install``); skipped where verl is not installed.

Checked: verl's device layer answers for tpu once verl is imported (device, torch module,
process-group backend, Ray resource, no CUDA IPC, its FSDP engine), its resource-pool check counts
tpu devices and refuses too many with torchtpu's error, and verl's own GRPO entry point
(``main_ppo``, Ray single controller, FSDP actor, vLLM rollout server) trains the tiny Llama of
``torchtpu/testing/verl_grpo.py`` on tpu: each step's metrics finite, the policy updated, no
op on CPU (verl's actor pads responses back from a nested tensor: the jagged lowering).
"""

import math
import re

import pytest

pytest.importorskip("verl", reason="verl is not installed (docs, Integrations, verl)")
pytest.importorskip("vllm", reason="vLLM is not installed (docs, Serving (vLLM))")


def test_verl_device_points_answer_tpu():
    import torch
    from verl.utils import device
    from verl.workers.engine.base import EngineRegistry
    from verl.workers.engine.fsdp.transformer_impl import FSDPEngineWithLMHead

    assert device.get_device_name() == "tpu"
    assert device.get_torch_device() is torch.tpu
    assert device.get_nccl_backend() == "tpu_dist"
    assert device.get_resource_name() == "TPU"
    assert device.get_visible_devices_keyword() == "TPU_VISIBLE_CHIPS"
    assert not device.is_support_ipc()
    assert EngineRegistry.get_engine_cls("language_model", "fsdp") is FSDPEngineWithLMHead
    assert EngineRegistry.get_engine_cls("language_model", "fsdp2") is FSDPEngineWithLMHead


def test_resource_pools_count_tpu_devices_and_refuse_too_many():
    import ray
    from verl.single_controller.ray.base import ResourcePoolManager

    ray.init(num_cpus=1, resources={"TPU": 1}, object_store_memory=100 << 20,
             include_dashboard=False, log_to_driver=False)
    try:
        ResourcePoolManager({"global_pool": [1]}, mapping={}).create_resource_pool()
        with pytest.raises(ValueError, match=r"torchtpu\.device: verl's resource pools want 2 "
                                             r"tpu device\(s\) .* has 1 free"):
            ResourcePoolManager({"global_pool": [2]}, mapping={}).create_resource_pool()
    finally:
        ray.shutdown()


def test_verl_grpo_trains_on_tpu(tmp_path, monkeypatch):
    from torchtpu.testing import verl_grpo

    # warn, not error: every fallback of the run is named in the log, not only the first
    monkeypatch.setenv("TORCHTPU_CPU_FALLBACK", "warn")
    out = verl_grpo.run(tmp_path, 2, timeout=1100)  # within CI smoke's 1200 s
    assert out["returncode"] == 0, out["tail"]
    log = (tmp_path / "verl.log").read_text()
    assert re.findall(r"torchtpu\.fallback: aten op '([^']+)'", log) == []
    steps = out["steps"]
    assert [s["step"] for s in steps] == [1, 2], out["tail"]
    for s in steps:
        for name in ("actor/pg_loss", "actor/grad_norm", "critic/score/mean"):
            assert math.isfinite(s[name]), (name, s)
        assert s["actor/grad_norm"] > 0, s
