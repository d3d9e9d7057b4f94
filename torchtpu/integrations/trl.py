"""TRL on device "tpu": its trainers' ``pad_to_multiple_of="auto"`` pads to a multiple of 16, and
its colocated vLLM engine is checked against the policy before training starts.

TRL's configs resolve ``"auto"`` to 128 on Neuron ("which compiles once per input shape") and to
no padding elsewhere, so on tpu every GRPO step met new lengths (each batch's longest prompt,
its longest completion) and its forward, backward and generate ran ops at sizes never seen: a
program each, traced and compiled (a persistent cache still traces and lowers them). Padded to
multiples of 16 (the eager size buckets', ``compile/eager_buckets.py``), a few lengths recur and
the steps after the first reuse their programs (bench/RESULTS.md, "rl"). Left padding of
prompts is masked, and Llama-style rotary positions depend on distance only; right padding of
completions is masked out of the loss. An explicit ``pad_to_multiple_of`` (an int, or None) is
left alone.

With ``use_vllm=True, vllm_mode="colocate"`` TRL starts vLLM in the trainer's process (on tpu
through torchtpu's vLLM platform) and pushes the policy's weights into it before each step's
rollouts, parameter by parameter through the engine model's ``load_weights``, which copies each
tpu tensor into the engine's on the device (no host round trip: both are tpu tensors of this
process). Two mistakes would otherwise surface late or obscurely, and are refused when
``VLLMGeneration`` is built, before any step: an engine share that does not fit beside the
policy on the device (``vllm_gpu_memory_utilization`` of the device's memory, plus the policy's
weights, gradients and two optimizer states: ``torchtpu.memory``), checked before the engine
starts; and a policy whose parameter names or shapes are not those of the engine's model (read
from the headers of the checkpoint the engine is given to load; the first such parameter is
named with both shapes: ``torchtpu.argument``).

``GRPOTrainer.train`` with vLLM colocated on tpu runs in ``torch.tpu.EagerMode.DEFER_AND_FUSE``
(where the process is in the default Strict mode; ``TORCHTPU_TRL_DEFER=0`` leaves it there):
in Strict a step launched ~930 programs of a few ops each (the rollout's scoring, the policy's
loss forward and backward, clipping, the optimizer step, the engine's input preparation), in
DeferAndFuse ~70, one per host read (TRL reads its logged metrics inside the loss), each
program found by its recording's structure from the third step on; a new process's first step
traces its ~40 fused programs (Strict loads its per-op ones by key), so the first two steps
cost more host CPU on XLA:CPU and the later ones less (bench/RESULTS.md, "rl10").
The engine's own steps are the programs it captured, in either mode. The whole of
``train`` is one mode, not Strict around the rollouts: leaving and entering the mode every step
drops DeferAndFuse's kept buffers and repeats its garbage-collector check (~0.1 s a step in a
process holding vLLM). Without vLLM, ``generate``'s decode loop would fuse one program per
generated length, so that run keeps Strict.

TRL pushes the policy into the colocated engine one ``load_weights([(name, param)])`` call per
parameter, and vLLM's loader walks the engine's whole model in each call (``AutoWeightsLoader``'s
tied-parameter search, ``named_parameters``): the push's host time grew with the square of the
layers (Qwen2-0.5B: 290 calls, each over 290 parameters). On tpu it hands the loader the
parameters as one stream instead, gathered one at a time as TRL's loop gathers them: the same
copies, one walk.

The colocated engine captures its step shapes lazily (``TORCHTPU_VLLM_CAPTURE=lazy`` while it
starts, where the user has not set the variable): TRL sizes it for ``max_num_batched_tokens=4096``
and ``max_num_seqs`` of the batch, a grid of 25 decode and prefill shapes (32 tokens, 2
requests) that the start-up capture compiled, each a program holding the policy's whole forward
(Qwen2-0.5B's 24 layers at width 128: 756 s of XLA:CPU compiles at load 13, "rl15"), of
which a GRPO step meets 2-3 (its group's prefill, its decodes, with logits: TRL asks for
log-probabilities). A warm process loads the ones met by key either way.
"""

from __future__ import annotations

import contextlib
import functools
import os

from torchtpu import errors, settings

PAD_TO = 16
# What training holds per policy weight beside it: its gradient and AdamW's two moments.
TRAINING_COPIES = 4
MODULES = ("grpo", "rloo", "dpo", "sft", "kto", "reward", "distillation")


def defers(trainer) -> bool:
    """Whether ``trainer.train`` runs in DeferAndFuse (the module doc)."""
    import torch

    return (trainer.accelerator.device.type == "tpu"
            and trainer.use_vllm and trainer.vllm_mode == "colocate"
            and settings.TRL_DEFER.get()
            and torch.tpu.eager_mode is torch.tpu.EagerMode.DEFER_NEVER)


def patch_grpo_trainer() -> None:
    """Run ``GRPOTrainer.train`` in DeferAndFuse where ``defers`` says so (the module doc)."""
    import functools

    import torch
    from trl.trainer import grpo_trainer

    cls = grpo_trainer.GRPOTrainer
    train = cls.train
    if getattr(train, "_torchtpu", False):
        return

    @functools.wraps(train)
    def deferred_train(self, *args, **kwargs):
        if not defers(self):
            return train(self, *args, **kwargs)
        with torch.tpu.set_eager_mode(torch.tpu.EagerMode.DEFER_AND_FUSE):
            return train(self, *args, **kwargs)

    deferred_train._torchtpu = True
    cls.train = deferred_train


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


def policy_bytes(model) -> int:
    """Bytes of the policy's parameters on tpu."""
    return sum(p.numel() * p.element_size() for p in model.parameters() if p.device.type == "tpu")


def check_share(model, utilization: float) -> None:
    """Refuse an engine share that does not fit beside the policy (see the module doc)."""
    from torchtpu.device import memory, memory_limit

    held = policy_bytes(model)
    if not held:
        return
    total = memory_limit.limit() or memory.total_memory()
    need = TRAINING_COPIES * held
    share = utilization * total
    if share + need > total:
        fits = max(total - need, 0) / total
        raise ValueError(errors.message(
            "memory", f"vllm_gpu_memory_utilization={utilization:g} gives the colocated vLLM "
            f"engine {_mb(share)} of the device's {_mb(total)}, but the policy needs "
            f"{_mb(need)} beside it (its {_mb(held)} of weights, their gradients and two "
            f"optimizer states): lower vllm_gpu_memory_utilization to at most {fits:.3f}"))


def _mb(n: float) -> str:
    return f"{n / 2**20:.1f} MiB"


def engine_shapes(folder: str) -> dict[str, tuple]:
    """Every tensor of the checkpoint in ``folder``: name -> shape (safetensors headers; empty
    where ``folder`` is no local directory)."""
    from pathlib import Path

    from safetensors import safe_open

    shapes: dict[str, tuple] = {}
    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), "pt") as f:
            for name in f.keys():
                shapes[name] = tuple(f.get_slice(name).get_shape())
    return shapes


def check_names(pushed, shapes: dict[str, tuple], folder: str) -> None:
    """Refuse the first pushed (name, tensor) whose name or shape is not the engine's."""
    for name, tensor in pushed:
        want = shapes.get(name)
        if want is None:
            raise ValueError(errors.message(
                "argument", f"weight push into vLLM: the policy's parameter {name!r} "
                f"(shape {tuple(tensor.shape)}) is not in the engine's model ({folder}): the "
                "policy and the engine must be the same model"))
        if tuple(tensor.shape) != want:
            raise ValueError(errors.message(
                "argument", f"weight push into vLLM: the policy's parameter {name!r} has shape "
                f"{tuple(tensor.shape)} but the engine's model ({folder}) has {want}"))


@contextlib.contextmanager
def _lazy_capture():
    """``TORCHTPU_VLLM_CAPTURE=lazy`` while the colocated engine starts, unless the user set it
    (the module doc)."""
    if settings.VLLM_CAPTURE.is_set():
        yield
        return
    with settings.VLLM_CAPTURE.exported("lazy"):
        yield


def patch_vllm_generation() -> None:
    """Wrap ``VLLMGeneration._init_vllm`` with the checks of the module doc (colocate only)."""
    from trl.generation import vllm_generation

    cls = vllm_generation.VLLMGeneration
    original = cls._init_vllm
    if getattr(original, "_torchtpu", False):
        return

    def _init_vllm(self) -> None:
        if self.mode == "colocate":
            check_share(self.model, self.gpu_memory_utilization)
            folder = self.model.name_or_path  # what TRL has the engine load
            shapes = engine_shapes(folder)
            if shapes:  # (a hub name, not a folder here: nothing to read before vLLM)
                check_names(self._iter_named_params(), shapes, folder)
            if os.environ.get("WORLD_SIZE", "1") == "1":
                # TRL opens internet sockets to find a free MASTER_PORT (refused on a sandboxed
                # TPU host); a process alone never binds it: its engine rendezvouses through a
                # file store (integrations/vllm/worker.py)
                os.environ.setdefault("MASTER_PORT", "29500")
            with _lazy_capture():
                original(self)
            return
        original(self)

    _init_vllm._torchtpu = True
    cls._init_vllm = _init_vllm
    cls.sync_weights = _one_push(cls.sync_weights)


def _one_push(sync_weights):
    """``sync_weights`` that hands a colocated tpu engine's model every parameter in one
    ``load_weights`` call (the module doc); other modes, devices and sleep mode as TRL does."""
    @functools.wraps(sync_weights)
    def one_push(self) -> None:
        if (self.mode != "colocate" or self.enable_sleep_mode
                or self.accelerator.device.type != "tpu"):
            return sync_weights(self)
        model = self.llm.llm_engine.model_executor.driver_worker.model_runner.model
        # a stream: each parameter is gathered (FSDP, ZeRO-3) and dropped in turn, as in TRL's
        model.load_weights(self._iter_named_params())
        self.llm.reset_prefix_cache()
        return None

    return one_push
