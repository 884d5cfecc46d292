"""The models' elementwise pieces with hand-written backward passes that save only what they must.

Autodiff of the plain formulas saves every intermediate the backward reads: RMSNorm its input twice in float32
(the cast and the normalized value, 8 bytes an element), Flax's LayerNorm three float32 copies, SwiGLU and GELU
three or four compute-dtype intermediates, RoPE its broadcast cos/sin tables four times per call. Each function here
computes the same forward, op for op (bit for bit), and saves:

  rms_norm    x in its own dtype and the float32 1/rms per row (..., 1); the backward recomputes x / rms.
  layer_norm  x in its own dtype, the float32 mean and 1/std per row; the backward recomputes (x - mean) / std.
  swiglu      gate and up in their own dtype; the backward recomputes sigmoid(gate) in float32.
  gelu        x in its own dtype; the backward recomputes the tanh in float32 (gelu_exact: the erf).
  apply_rope  the int positions (T,); the backward recomputes cos and sin and rotates the gradient back.

The backward passes compute in float32 and round once to the input's dtype, so their gradients equal autodiff's
to float32 rounding; in bf16, where autodiff of SwiGLU, GELU and Flax's LayerNorm rounds intermediate steps to bf16,
they are closer to the exact gradient.
"""

import functools
import math

import jax
import jax.numpy as jnp

from qjax import dispatch, numerics
from qjax.prologue import Prologue, restore, save


@functools.partial(jax.custom_vjp, nondiff_argnums=(2, 3))
def rms_norm(x: jax.Array, scale: jax.Array, eps: float, dtype) -> jax.Array:
    """x / rms(x) * scale, statistics in float32 (bf16 sums of squares lose the small components).

    x: (..., dim) any float dtype; scale: (dim,) any float dtype. Returns x's shape in `dtype`.
    """
    return _rms_norm_forward(x, scale, eps, dtype)[0]


def _rms_norm_forward(x, scale, eps, dtype):
    y, inv_rms = numerics.rms_norm(x.astype(jnp.float32), scale.astype(jnp.float32), eps)
    return y.astype(dtype), inv_rms[..., None]  # float32 (..., 1)


def _rms_norm_fwd(x, scale, eps, dtype):
    y, inv_rms = _rms_norm_forward(x, scale, eps, dtype)
    return y, (x, scale, inv_rms)


def _rms_norm_bwd(eps, dtype, residuals, dy):
    x, scale, inv_rms = residuals
    dx, dscale_terms = numerics.rms_norm_backward(x.astype(jnp.float32), inv_rms[..., 0], scale.astype(jnp.float32),
                                                  dy.astype(jnp.float32))
    dscale = jnp.sum(dscale_terms, axis=tuple(range(x.ndim - 1)))
    return dx.astype(x.dtype), dscale.astype(scale.dtype)


rms_norm.defvjp(_rms_norm_fwd, _rms_norm_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4))
def layer_norm(x: jax.Array, scale: jax.Array, bias: jax.Array, eps: float, dtype) -> jax.Array:
    """(x - mean) / std * scale + bias over the last axis, statistics in float32: `nn.LayerNorm` op for op (its
    fast variance, mean(x^2) - mean^2 clamped at 0).

    x: (..., dim) any float dtype; scale, bias: (dim,) any float dtype. Returns x's shape in `dtype`.
    """
    return _layer_norm_forward(x, scale, bias, eps, dtype)[0]


def _layer_norm_forward(x, scale, bias, eps, dtype):
    x32 = x.astype(jnp.float32)
    mean = jnp.mean(x32, axis=-1, keepdims=True)  # float32 (..., 1)
    var = jnp.maximum(0.0, jnp.mean(jax.lax.square(x32), axis=-1, keepdims=True) - jax.lax.square(mean))
    inv_std = jax.lax.rsqrt(var + eps)
    y = (x32 - mean) * (inv_std * scale.astype(jnp.float32)) + bias.astype(jnp.float32)
    return y.astype(dtype), mean, inv_std


def _layer_norm_fwd(x, scale, bias, eps, dtype):
    y, mean, inv_std = _layer_norm_forward(x, scale, bias, eps, dtype)
    return y, (x, scale, bias, mean, inv_std)


def _layer_norm_bwd(eps, dtype, residuals, dy):
    x, scale, bias, mean, inv_std = residuals
    n = (x.astype(jnp.float32) - mean) * inv_std
    dy = dy.astype(jnp.float32)
    rows = tuple(range(n.ndim - 1))
    dn = dy * scale.astype(jnp.float32)
    # The mean's and the std's dependence on x are the second and third terms.
    dx = inv_std * (dn - jnp.mean(dn, axis=-1, keepdims=True) - n * jnp.mean(dn * n, axis=-1, keepdims=True))
    dscale, dbias = jnp.sum(dy * n, axis=rows), jnp.sum(dy, axis=rows)
    return dx.astype(x.dtype), dscale.astype(scale.dtype), dbias.astype(bias.dtype)


layer_norm.defvjp(_layer_norm_fwd, _layer_norm_bwd)


@jax.custom_vjp
def swiglu(gate: jax.Array, up: jax.Array) -> jax.Array:
    """silu(gate) * up, in the inputs' dtype (both (..., ffn_dim), the same float dtype): `numerics.swiglu`, the
    formula the fused SwiGLU kernels share (`jax.nn.silu(gate) * up` as XLA evaluates it)."""
    return numerics.swiglu(gate, up)


def _swiglu_fwd(gate, up):
    return swiglu(gate, up), (gate, up)


def _swiglu_bwd(residuals, dh):
    gate, up = residuals
    dgate, dup = numerics.swiglu_backward(gate.astype(jnp.float32), up.astype(jnp.float32), dh.astype(jnp.float32))
    return dgate.astype(gate.dtype), dup.astype(up.dtype)


swiglu.defvjp(_swiglu_fwd, _swiglu_bwd)


_GELU_C = math.sqrt(2 / math.pi)


@jax.custom_vjp
def gelu(x: jax.Array) -> jax.Array:
    """`jax.nn.gelu` (the tanh approximation, `nn.gelu`'s default), in x's dtype."""
    return jax.nn.gelu(x, approximate=True)


def _gelu_fwd(x):
    return gelu(x), x


def _gelu_bwd(x, dy):
    x32 = x.astype(jnp.float32)
    t = jnp.tanh(_GELU_C * (x32 + 0.044715 * x32**3))
    # d/dx of x * (1 + t) / 2, with dt/dx = (1 - t^2) * c * (1 + 3 * 0.044715 * x^2)
    dgelu = 0.5 * (1 + t) + 0.5 * x32 * (1 - t * t) * _GELU_C * (1 + 3 * 0.044715 * x32 * x32)
    return ((dy.astype(jnp.float32) * dgelu).astype(x.dtype),)


gelu.defvjp(_gelu_fwd, _gelu_bwd)


@jax.custom_vjp
def gelu_exact(x: jax.Array) -> jax.Array:
    """`jax.nn.gelu(x, approximate=False)`: x * Phi(x) with the erf (torch's and Hugging Face's "gelu"), x's dtype."""
    return jax.nn.gelu(x, approximate=False)


def _gelu_exact_fwd(x):
    return gelu_exact(x), x


def _gelu_exact_bwd(x, dy):
    x32 = x.astype(jnp.float32)
    # d/dx of x * Phi(x) = Phi(x) + x * phi(x), phi the standard normal density.
    dgelu = 0.5 * (1 + jax.lax.erf(x32 / math.sqrt(2))) + x32 * jnp.exp(-0.5 * x32 * x32) / math.sqrt(2 * math.pi)
    return ((dy.astype(jnp.float32) * dgelu).astype(x.dtype),)


gelu_exact.defvjp(_gelu_exact_fwd, _gelu_exact_bwd)


def _rope_tables(positions, head_dim: int, theta: float):
    """cos and sin of position * theta^(-2i / head_dim), float32 (T, 1, head_dim / 2) (broadcast over heads)."""
    half = head_dim // 2
    inv_freq = theta ** (-jnp.arange(half, dtype=jnp.float32) * 2 / head_dim)
    angles = positions.astype(jnp.float32)[:, None] * inv_freq  # (T, half)
    return jnp.cos(angles)[:, None, :], jnp.sin(angles)[:, None, :]


def apply_rope(x: jax.Array, positions: jax.Array, *, theta: float) -> jax.Array:
    """Rotary position embedding, Llama's half-rotation convention (pairs are (x[i], x[i + head_dim/2])).

    x: (B, T, heads, head_dim), any float dtype; positions: (T,) int. Each pair is rotated by the angle
    position * theta^(-2i / head_dim), computed in float32, so <rope(q, m), rope(k, n)> depends on m - n only.
    Returns x's shape and dtype.
    """
    return _rope(x, positions, theta)


@functools.partial(jax.custom_vjp, nondiff_argnums=(2,))
def _rope(x, positions, theta):
    cos, sin = _rope_tables(positions, x.shape[-1], theta)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


def _rope_fwd(x, positions, theta):
    return _rope(x, positions, theta), positions


def _rope_bwd(theta, positions, dy):
    # The rotation is orthogonal: its transpose rotates by the opposite angle.
    cos, sin = _rope_tables(positions, dy.shape[-1], theta)
    d1, d2 = jnp.split(dy.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([d1 * cos + d2 * sin, d2 * cos - d1 * sin], axis=-1).astype(dy.dtype), None


_rope.defvjp(_rope_fwd, _rope_bwd)


# The same ops as `qjax.prologue.Prologue`s, for the data-flow recipes' fused op + linear layers (which save the
# op's input in 8 bits and recompute these residuals from it). SwiGLU takes gate and up as one (..., 2 * ffn_dim)
# array, the output of the fused gate_up projection.


def rms_norm_prologue(eps: float, dtype) -> Prologue:
    # The data-flow forward hook runs the fused RMSNorm kernel where `qjax.dispatch` picks it, else the composition
    # below, which the kernel equals. No backward hook: `prologue_dot` restores x and runs the norm's backward in
    # XLA, faster than a fused kernel.
    return Prologue("rms_norm", apply=lambda x, scale: rms_norm(x, scale, eps, dtype),
                    forward=lambda x, scale: _rms_norm_fwd(x, scale, eps, dtype),
                    backward=functools.partial(_rms_norm_bwd, eps, dtype),
                    forward_saving=lambda x, scale, *, spec, group, backend: dispatch.rms_norm_forward_saving(
                        x, scale, spec, group, functools.partial(_rms_norm_saving_reference, eps, dtype), eps=eps,
                        dtype=dtype, backend=backend))


def _rms_norm_saving_reference(eps, dtype, x, scale, spec, group):
    return _rms_norm_forward(x, scale, eps, dtype)[0], save(x, spec, group)


def layer_norm_prologue(eps: float, dtype) -> Prologue:
    return Prologue("layer_norm", apply=lambda x, scale, bias: layer_norm(x, scale, bias, eps, dtype),
                    forward=lambda x, scale, bias: _layer_norm_fwd(x, scale, bias, eps, dtype),
                    backward=functools.partial(_layer_norm_bwd, eps, dtype))


def _swiglu_packed(gate_up):
    return swiglu(*jnp.split(gate_up, 2, axis=-1))


def _swiglu_packed_bwd(residuals, dh):
    (gate_up,) = residuals
    return (jnp.concatenate(_swiglu_bwd(jnp.split(gate_up, 2, axis=-1), dh), axis=-1),)


def _swiglu_saving_reference(gate_up, spec, group):
    return _swiglu_packed(gate_up), save(gate_up, spec, group)


def _swiglu_backward_reference(saved, x_like, dh):
    return _swiglu_packed_bwd((restore(saved, x_like.shape, x_like.dtype),), dh)[0]


# The data-flow hooks run the fused SwiGLU kernels where `qjax.dispatch` picks them (a Hopper GPU, bf16, F a
# multiple of 256), else the composition above, which the kernels equal.
SWIGLU = Prologue(
    "swiglu", apply=_swiglu_packed, forward=lambda gate_up: (_swiglu_packed(gate_up), (gate_up,)),
    backward=_swiglu_packed_bwd,
    forward_saving=lambda gate_up, *, spec, group, backend: dispatch.swiglu_forward_saving(
        gate_up, spec, group, _swiglu_saving_reference, backend=backend),
    backward_saved=lambda saved, x_like, params, dh, *, backend: (dispatch.swiglu_backward_saved(
        saved, x_like, dh, _swiglu_backward_reference, backend=backend),))
GELU = Prologue("gelu", apply=gelu, forward=lambda x: (gelu(x), (x,)), backward=lambda res, dy: _gelu_bwd(res[0], dy))
GELU_EXACT = Prologue("gelu_exact", apply=gelu_exact, forward=lambda x: (gelu_exact(x), (x,)),
                      backward=lambda res, dy: _gelu_exact_bwd(res[0], dy))
