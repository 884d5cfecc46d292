"""Dispatch for the per-tensor quantized Adam update: a fused kernel where one exists, the jnp reference elsewhere.

`adam_update(g, mu, nu, config, ...)` -> (direction f32, new mu, new nu) for one tensor. The reference
(`adam.update_reference`) dequantizes, runs Adam in float32 and requantizes in separate XLA ops that XLA fuses as
it can. A fused Mosaic GPU kernel (one pass per tensor: dequantize -> Adam -> quantize) is NOT implemented yet:
`use_kernel=True` raises NotImplementedError, and `use_kernel=None` (auto) always takes the reference.
"""

from qjax.optim import adam, blockwise


def kernel_available(config) -> bool:
    """Whether a fused kernel exists for this state config on the current backend (none yet)."""
    del config
    return False


def adam_update(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt):
    """One tensor's Adam update (see `adam` module docstring); picks the kernel or the jnp reference."""
    if config.use_kernel and blockwise.is_quantized(mu):
        raise NotImplementedError("the fused Mosaic GPU Adam kernel is not implemented yet; use use_kernel=None "
                                  "or False (the jnp reference)")
    return adam.update_reference(g, mu, nu, config, b1, b2, eps, bc1, bc2_sqrt)
