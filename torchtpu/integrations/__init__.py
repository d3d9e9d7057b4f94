"""Where third-party libraries need to be told about device "tpu", and only there.

Each module here adapts one library (the library's own code is never edited) and is applied by
a post-import hook when that library is first imported, so ``import torch`` pays nothing for
libraries a program never uses.
"""

import importlib

from torchtpu.import_hooks import after_import

# {library module: "adapter module:function"}; the adapter loads when its library does.
_ADAPTERS = {
    "accelerate.state": "torchtpu.integrations.accelerate:patch",
    "fbgemm_gpu": "torchtpu.integrations.fbgemm:patch",
    "ray.air._internal.torch_utils": "torchtpu.integrations.ray:patch",
    "torch.nn.attention.varlen": "torchtpu.lowering.attention:register_varlen",
    "verl.plugin.platform.platform_manager": "torchtpu.integrations.verl:register",
    "verl.single_controller.ray.base": "torchtpu.integrations.verl:patch_pools",
    "verl.workers.engine.fsdp.transformer_impl": "torchtpu.integrations.verl:register_engines",
}


def _adapter(target: str):
    module, function = target.split(":")
    return lambda: getattr(importlib.import_module(module), function)()


def install() -> None:
    for library, target in _ADAPTERS.items():
        after_import(library, _adapter(target))
    from torchtpu.integrations import trl  # light: its patches import what they need

    for name in trl.MODULES:
        module = f"trl.trainer.{name}_config"
        after_import(module, trl.patcher(module))
    after_import("trl.generation.vllm_generation", trl.patch_vllm_generation)
    after_import("trl.trainer.grpo_trainer", trl.patch_grpo_trainer)
