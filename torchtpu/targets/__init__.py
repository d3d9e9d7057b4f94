"""The targets room: TPU targets, programs compiled with libtpu for a TPU that is not here.

It owns the target and its compiles (``tpu_target.py``: the compiler's verdict, HBM and cost
model), the hook that compiles every program torchtpu builds for the target too
(``tpu_hook.py``), and what they read off a program (``stablehlo_facts.py``, and the 64-bit
narrowed twin of ``tpu_narrow.py`` for the cost model's time).

It imports the runtime room (``torchtpu.runtime``) only, never ``torchtpu.cache``; it plugs into
the runtime through ``runtime/hooks.py`` (the hook starts with the platform, turns off loading
programs by key, and its verdicts are kept as records where the cache room keeps them).
"""
