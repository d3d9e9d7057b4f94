"""Custom kernels as torch ops: ``jax_op`` (a JAX/Pallas function as a ``torch.library`` op whose
lowering is in the one table), Pallas interpret mode chosen per platform, worked Pallas kernels,
``torch.tpu.ops`` and the Tokamax and Helion bridges."""
