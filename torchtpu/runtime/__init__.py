"""The runtime room, the bottom of torchtpu's basement: the PJRT platform and what JAX runs
under in this process.

It owns which platform and device this process drives (``platform.py``), torchtpu's JAX settings
(``jax_settings.py``: 64-bit types, matmul precision, the TPU's accurate transcendentals
``tpu_accuracy.py`` / ``tpu_composites.py`` and 64-bit rules ``tpu_x64.py``, the XLA compiler
options ``compiler_options.py``), libtpu and the TPU host (``libtpu.py``, ``chips.py``, the
environment variables ``environment.py``), host-to-device transfers (``transfer.py``), the
program dump (``dump.py``) and the notices on stderr (``notices.py``).

It imports no other room. The rooms above it (``torchtpu.cache``, ``torchtpu.targets``) plug
into it through ``hooks.py``: their start steps, the hook that must see every compile, the
store of records.
"""
