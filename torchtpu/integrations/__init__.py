"""Where third-party libraries need to be told about device "tpu", and only there.

Each module here adapts one library (the library's own code is never edited) and is applied by
a post-import hook when that library is first imported, so ``import torch`` pays nothing for
libraries a program never uses.
"""

from torchtpu.import_hooks import after_import


def install() -> None:
    from torchtpu.integrations import accelerate, fbgemm, ray, trl
    from torchtpu.lowering import attention

    after_import("accelerate.state", accelerate.patch)
    after_import("fbgemm_gpu", fbgemm.patch)
    after_import("ray.air._internal.torch_utils", ray.patch)
    after_import("torch.nn.attention.varlen", attention.register_varlen)
    for name in trl.MODULES:
        module = f"trl.trainer.{name}_config"
        after_import(module, trl.patcher(module))
    after_import("trl.generation.vllm_generation", trl.patch_vllm_generation)
