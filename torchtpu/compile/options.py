"""``torch.compile(backend="tpu", mode=..., options=...)``: what is accepted, what is refused.

The option names are the reference's. Inductor's modes and options mean nothing to an XLA
backend, so they are refused with a message saying what to use instead, never ignored;
"reduce-overhead" is served by captured graphs (``compile/reduce_overhead.py``).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

_MODE_ADVICE = {
    "max-autotune": "XLA already optimizes each whole graph; leave mode unset",
    "max-autotune-no-cudagraphs": "XLA already optimizes each whole graph; leave mode unset",
}


@dataclasses.dataclass(frozen=True)
class Options:
    # dynamic=True pads symbolic sizes to bucket_size * 2**i, i < num_dynamic_buckets (dynamic.py).
    bucket_size: int = 128
    num_dynamic_buckets: int = 4
    debug_callback: Callable | None = None
    # A step function (one calling backward()) as one captured program per call (whole_step.py).
    whole_step: bool = True


_KNOWN = {f.name for f in dataclasses.fields(Options)}


def _is_inductor_option(name: str) -> bool:
    import torch._inductor.config as inductor_config

    return "." in name or hasattr(inductor_config, name)


def parse(mode: str | None, options: dict | None) -> Options:
    """Validated options; raises ValueError in the user's terms for anything not ours."""
    if mode not in (None, "default", "reduce-overhead"):
        advice = _MODE_ADVICE.get(mode, "leave mode unset")
        raise ValueError(
            f"torchtpu.compile: torch.compile(mode={mode!r}) is an Inductor mode; backend 'tpu' "
            "compiles with XLA: "
            f"{advice} (tune it with options={{'bucket_size': ..., 'num_dynamic_buckets': ...}})"
        )
    options = dict(options or {})
    for name in options:
        if name in _KNOWN:
            continue
        if _is_inductor_option(name):
            raise ValueError(
                f"torchtpu.compile: torch.compile option {name!r} is an Inductor option; backend "
                "'tpu' compiles "
                f"with XLA and takes only {sorted(_KNOWN)}"
            )
        raise ValueError(f"torchtpu.compile: unknown torch.compile option {name!r} for backend "
                         "'tpu'; "
                         f"the options are {sorted(_KNOWN)}")
    parsed = Options(**options)
    if not (isinstance(parsed.bucket_size, int) and parsed.bucket_size > 0):
        raise ValueError(f"torchtpu.compile: bucket_size must be a positive int, not "
                         f"{parsed.bucket_size!r}")
    if not (isinstance(parsed.num_dynamic_buckets, int) and 1 <= parsed.num_dynamic_buckets <= 8):
        raise ValueError("torchtpu.compile: num_dynamic_buckets must be an int from 1 to 8, not "
                         f"{parsed.num_dynamic_buckets!r}")
    if not isinstance(parsed.whole_step, bool):
        raise ValueError("torchtpu.compile: whole_step must be True or False, not "
                         f"{parsed.whole_step!r}")
    if parsed.debug_callback is not None and not callable(parsed.debug_callback):
        raise ValueError("torchtpu.compile: debug_callback must be callable (it receives the FX "
                         "graph and the "
                         "StableHLO text)")
    return parsed
