"""The serving engines' opt-in (``integrations/engine_opt_in.py``), shared by the vLLM and
SGLang plugins: their variable first, then their installer's marker; a value other than 0 or 1
is refused. Neither engine needs to be installed."""

import pytest

from torchtpu.integrations import sglang, vllm


@pytest.mark.parametrize("plugin,hook,setting", [(vllm, "register", "TORCHTPU_VLLM"),
                                                 (sglang, "activate", "TORCHTPU_SGLANG")],
                         ids=["vllm", "sglang"])
def test_the_setting_then_the_installers_marker(monkeypatch, tmp_path, plugin, hook, setting):
    monkeypatch.setattr(plugin, "MARKER", tmp_path / "platform-tpu")
    monkeypatch.delenv(setting, raising=False)
    run = getattr(plugin, hook)
    assert run() is None  # not installed by torchtpu's installer: the engine's own platforms
    plugin.MARKER.write_text("")
    assert run() == plugin.PLATFORM
    monkeypatch.setenv(setting, "0")
    assert run() is None
    plugin.MARKER.unlink()
    monkeypatch.setenv(setting, "1")
    assert run() == plugin.PLATFORM
    monkeypatch.setenv(setting, "maybe")
    with pytest.raises(ValueError, match=f"{setting}='maybe' is not 0 or 1"):
        run()


@pytest.mark.parametrize("plugin,hook,setting", [("vllm", "register", "TORCHTPU_VLLM"),
                                                 ("sglang", "activate", "TORCHTPU_SGLANG")],
                         ids=["vllm", "sglang"])
def test_the_hook_starts_no_backend(plugin, hook, setting):
    """An engine probes its platform in child processes too (vLLM's model inspection); on a TPU
    host the parent owns the chip and libtpu refuses a second process, so a hook that started
    JAX's backend there failed and left vLLM with two platforms of its own (seen on the v5e)."""
    import os
    import subprocess
    import sys

    code = (f"from torchtpu.integrations import {plugin}\n"
            f"assert {plugin}.{hook}() == {plugin}.PLATFORM\n"
            "from jax._src import xla_bridge\n"
            "print(xla_bridge.backends_are_initialized())\n")
    env = {**os.environ, setting: "1"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split()[-1] == "False"
