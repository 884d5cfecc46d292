"""Pallas (Mosaic GPU) kernels, each beside the jnp reference it is tested against, and their dispatch."""
