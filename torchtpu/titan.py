"""``python -m torchtpu.titan ARGS``: TorchTitan's trainer (``python -m torchtitan.train ARGS``)
on torch 2.13, with the one shim it needs (``integrations/titan.py``); also under torchrun.
``--module torchtpu.titan --config NAME`` picks one of the configs re-exported here."""

from torchtpu.integrations.titan import deepseek_v3_debugmodel_varlen_attn, main

__all__ = ["deepseek_v3_debugmodel_varlen_attn", "main"]

if __name__ == "__main__":
    main()
