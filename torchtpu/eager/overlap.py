"""The memory-overlap refusals live in ``torchtpu/device/overlap.py`` (``copy_``, a device
kernel, makes them too); this name is kept for the executors that import it from here."""

from torchtpu.device.overlap import NO_OVERLAP, check, check_between, check_internal  # noqa: F401
