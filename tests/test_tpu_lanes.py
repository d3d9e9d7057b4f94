"""Attention head dims that pad to a TPU's 128 lanes (torchtpu/tools/lanes.py), as
``python -m torchtpu.diagnose`` and ``python -m torchtpu.aot`` advise them for the user's model."""

import textwrap
from types import SimpleNamespace

import torch

from torchtpu.tools import diagnose, lanes


class _Attention(torch.nn.Module):
    def __init__(self, head_dim=None, config=None):
        super().__init__()
        self.proj = torch.nn.Linear(4, 4)
        if head_dim is not None:
            self.head_dim = head_dim
        self.config = config


def test_head_dims_from_modules_and_configs_and_only_non_multiples_advised():
    model = torch.nn.Sequential(
        _Attention(head_dim=64),
        _Attention(config=SimpleNamespace(hidden_size=768, num_attention_heads=3)),  # 256
        _Attention(config=SimpleNamespace(embed_dim=96, num_heads=1)))               # 96
    assert lanes.head_dims(model) == {64, 256, 96}
    said = lanes.advice(model)
    assert len(said) == 2 and "head dim 64 pads to 128 lanes" in said[0] and "50%" in said[0]
    assert "head dim 96 pads to 128" in said[1]
    assert lanes.advice(_Attention(head_dim=128)) == []


def test_diagnose_command_advises_the_models_head_dim(tmp_path, capsys):
    script = tmp_path / "model.py"
    script.write_text(textwrap.dedent("""
        import torch

        class M(torch.nn.Module):
            def __init__(self):
                super().__init__()
                self.head_dim = 64
                self.proj = torch.nn.Linear(4, 4)

            def forward(self, x):
                return self.proj(x)

        def make():
            return M(), (torch.randn(2, 4),)
    """))
    assert diagnose.main([f"{script}:make", "--json"]) == 0
    out = capsys.readouterr().out
    assert '"kind": "tpu_lanes"' in out and "head dim 64 pads to 128 lanes" in out
