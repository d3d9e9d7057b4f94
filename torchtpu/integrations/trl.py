"""TRL: its trainers' ``pad_to_multiple_of="auto"`` pads to a multiple of 16 on device "tpu".

TRL's configs resolve ``"auto"`` to 128 on Neuron ("which compiles once per input shape") and to
no padding elsewhere, so on tpu every GRPO step met new lengths (each batch's longest prompt,
its longest completion) and its forward, backward and generate ran ops at sizes never seen: a
program each, traced and compiled (a persistent cache still traces and lowers them). Padded to
multiples of 16 (the eager size buckets', ``compile/eager_buckets.py``), a few lengths recur and
the steps after the first reuse their programs (bench/RESULTS.md, "rl"). Left padding of
prompts is masked, and Llama-style rotary positions depend on distance only; right padding of
completions is masked out of the loss. An explicit ``pad_to_multiple_of`` (an int, or None) is
left alone.
"""

from __future__ import annotations

PAD_TO = 16
MODULES = ("grpo", "rloo", "dpo", "sft", "kto", "reward", "distillation")


def patch_config(cls: type) -> None:
    """Wrap ``cls.__post_init__`` (a TRL config's) so "auto" pads to ``PAD_TO`` on tpu."""
    original = cls.__post_init__
    if getattr(original, "_torchtpu", False):
        return

    def __post_init__(self) -> None:
        auto = getattr(self, "pad_to_multiple_of", None) == "auto"
        original(self)
        if auto and self.pad_to_multiple_of is None and self.device.type == "tpu":
            self.pad_to_multiple_of = PAD_TO

    __post_init__._torchtpu = True
    __post_init__.__doc__ = original.__doc__
    cls.__post_init__ = __post_init__


def patcher(module_name: str):
    """The hook for ``trl.trainer.<name>_config``: patch its config classes that pad."""
    def patch() -> None:
        import dataclasses
        import sys

        module = sys.modules[module_name]
        for value in list(vars(module).values()):
            if (isinstance(value, type) and value.__module__ == module_name
                    and dataclasses.is_dataclass(value)
                    and any(f.name == "pad_to_multiple_of" for f in dataclasses.fields(value))):
                patch_config(value)
    return patch
