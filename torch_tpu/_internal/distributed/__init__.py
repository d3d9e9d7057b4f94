"""``torch_tpu._internal.distributed``: the reference's launcher (``launchers``)."""
