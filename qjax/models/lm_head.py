"""A language model's LM head and cross-entropy over chunks of positions: no full (tokens, vocab) logits in memory.

  hidden, state = model.apply({"params": params}, tokens, rngs=..., mutable=["losses"], return_hidden=True)
  loss = lm_head_loss(config, params, hidden, targets, mask, key)     # float32 (), the mean over (masked) tokens

Autodiff of `logits = head(hidden); softmax_cross_entropy(logits.astype(float32), targets)` keeps, at the start of
the backward pass, the float32 softmax (the cross-entropy's residual) beside the logits' gradient in float32 and the
compute dtype (1.1B Llama at batch 8 x 2048: the softmax alone is 16384 x 32000 x 4 B = 2.1 GB). Here one custom
VJP runs the
head GEMM and the cross-entropy one chunk of positions at a time (chunks along the sequence, each spanning the whole
batch, so a data-parallel batch stays split): the forward keeps only the loss; the backward recomputes each chunk's
logits and pulls the gradient back through them (`jax.vjp` of the same chunk function), summing the head weight's
gradient over chunks in float32. So at most one chunk's logits (`chunk_elements` tokens x vocab) live at a time, for
one more head GEMM per step (the recomputed forward: 2 x tokens x dim x vocab FLOPs).

Same values as the unchunked head and loss, to float32 rounding: each chunk runs the head's own GEMM
(`qjax.dot_general` with the head's recipe, bf16 by `keep_high_precision`), optax's cross-entropy on the float32
logits and the same backward; the loss is summed chunk by chunk, and a high-precision head's weight gradient is
accumulated over the chunks in float32 and rounded once, as the one GEMM over all tokens does. A quantized head (a
run that removes "lm_head" from keep_high_precision) quantizes its kernel once per pass for all chunks (the codes
each chunk would make), and its wgrad operands per chunk: their per-feature and tensor scales span a chunk's tokens
instead of all of them, and each chunk's gradient is rounded to the compute dtype before the float32 sum.
"""

import functools

import jax
import jax.numpy as jnp
import optax

import qjax
from qjax import linear_core
from qjax.models import layers
from qjax.int8_params import Int8Param

CHUNK_ELEMENTS = 2**25  # logits per chunk (tokens x vocab): 128 MiB in float32


def head_weight(config, params) -> jax.Array:
    """The LM head's (dim, vocab) weight in the compute dtype: `lm_head/kernel`, or the transposed token embedding
    of a model whose head is tied to it (no `lm_head` param). An int8 weight-only kernel is dequantized."""
    compute = jnp.dtype(config.compute_dtype)
    if "lm_head" not in params:
        return params["embed"]["embedding"].astype(compute).T
    kernel = params["lm_head"]["kernel"]
    return kernel.dequantize(compute) if isinstance(kernel, Int8Param) else kernel.astype(compute)


def lm_head_loss(config, params, hidden: jax.Array, targets: jax.Array, mask: jax.Array | None = None,
                 key: jax.Array | None = None, *, chunk_elements: int = CHUNK_ELEMENTS) -> jax.Array:
    """Mean cross-entropy of the model's LM head on `hidden`, over the tokens where `mask` is non-zero (all if None).

    Args:
      config: the model's `LlamaConfig` / `GPT2Config` (compute dtype, the head's recipe).
      params: the model's params (`head_weight` reads the head from them).
      hidden: (B, T, dim), the final norm's output (`model.apply(..., return_hidden=True)`).
      targets: (B, T) int token ids; mask: (B, T) 0/1 weights of the tokens, or None.
      key: `jax.random.key` for a head whose recipe rounds stochastically (else unused).
      chunk_elements: logits computed at a time (tokens x vocab), at least one position's; the chunks tile the
        sequence, padded with positions of weight 0.

    Returns:
      float32 (): sum(mask * CE) / max(sum(mask), 1); the plain mean without a mask.
    """
    if hidden.ndim != 3 or targets.shape != hidden.shape[:2]:
        raise ValueError(f"lm_head_loss needs hidden (B, T, dim) and targets (B, T); got {hidden.shape} and "
                         f"{targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"lm_head_loss targets must be int token ids, got {targets.dtype}")
    kernel = head_weight(config, params)
    recipe = layers.recipe_for(config, "lm_head", kernel.shape[0], kernel.shape[1])
    if mask is None:
        weights = jnp.full(targets.shape, 1.0 / targets.size, jnp.float32)
    else:
        mask = mask.astype(jnp.float32)
        weights = mask / jnp.maximum(jnp.sum(mask), 1.0)
    return chunked_cross_entropy(hidden, kernel, targets, weights, recipe=recipe, key=key,
                                 chunk_elements=chunk_elements)


def chunked_cross_entropy(hidden, kernel, targets, weights, *, recipe, key=None,
                          chunk_elements: int = CHUNK_ELEMENTS) -> jax.Array:
    """sum(weights * CE(hidden . kernel, targets)), float32 (), computed over chunks of positions (module docstring).

    hidden (B, T, dim) and kernel (dim, vocab) in the compute dtype; targets (B, T) int; weights (B, T) float32.
    """
    recipe = qjax.recipe(recipe)
    if recipe.needs_key and key is None:
        raise ValueError(f"the LM head's recipe {recipe.name!r} rounds stochastically: pass lm_head_loss a key")
    b, t = hidden.shape[:2]
    chunks = min(t, max(1, -(-b * t * kernel.shape[1] // chunk_elements)))
    size = -(-t // chunks)
    chunks = -(-t // size)  # no chunk of padding alone (e.g. t 10 over 7 chunks: size 2, so 5 chunks)
    pad = chunks * size - t  # positions of zero weight, so that the chunks tile the sequence

    def split(x):  # (B, T, ...) -> (chunks, B, size, ...)
        x = jnp.pad(x, [(0, 0), (0, pad)] + [(0, 0)] * (x.ndim - 2))
        return jnp.moveaxis(x.reshape(b, chunks, size, *x.shape[2:]), 1, 0)

    keys = (jax.random.key_data(jax.random.split(key, chunks)) if recipe.needs_key
            else jnp.zeros((chunks, 0), jnp.uint32))
    return _chunked(recipe, split(hidden), kernel, split(targets), split(weights.astype(jnp.float32)), keys)


def _head(recipe, hidden, kernel, key_data, codes):
    """One chunk's logits: hidden (B, size, dim) . kernel (dim, vocab) in the compute dtype, the head's recipe;
    codes: the kernel's, made once for all chunks (`_kernel_codes`), or None."""
    key = jax.random.wrap_key_data(key_data) if recipe.needs_key else None
    return qjax.dot_general(hidden, kernel, (((2,), (0,)), ((), ())), recipe=recipe, key=key, rhs_quantized=codes)


def _kernel_codes(recipe, kernel, dgrad: bool):
    """A quantized head's kernel quantized once for every chunk (`linear_core.weight_codes`) rather than in each
    chunk's GEMMs: at the 8B's 128k vocabulary a chunk's GEMMs are short beside quantizing the whole kernel. None
    for a high-precision head, or a recipe whose codes cannot be shared (each chunk then quantizes it)."""
    return None if recipe.is_high_precision else linear_core.weight_codes(recipe, kernel.T, dgrad)


def _cross_entropy(logits, targets, weights):
    """sum(weights * CE) of one chunk's logits (B, size, vocab), float32 ()."""
    return jnp.sum(optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets) * weights)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0,))
def _chunked(recipe, hidden, kernel, targets, weights, keys):
    codes = _kernel_codes(recipe, kernel, dgrad=False)

    def body(total, chunk):
        h, t, w, k = chunk
        return total + _cross_entropy(_head(recipe, h, kernel, k, codes), t, w), None

    return jax.lax.scan(body, jnp.zeros((), jnp.float32), (hidden, targets, weights, keys))[0]


def _chunked_fwd(recipe, hidden, kernel, targets, weights, keys):
    # The inputs are all the backward needs: no logits, no softmax.
    return _chunked(recipe, hidden, kernel, targets, weights, keys), (hidden, kernel, targets, weights, keys)


def _chunked_bwd(recipe, residuals, g):
    hidden, kernel, targets, weights, keys = residuals
    codes = _kernel_codes(recipe, kernel, dgrad=True)

    def body(dkernel, chunk):
        h, t, w, k = chunk
        logits, head_pull = jax.vjp(lambda h, kernel: _head(recipe, h, kernel, k, codes), h, kernel)
        dlogits = jax.vjp(lambda logits: _cross_entropy(logits, t, w), logits)[1](g)[0]
        dh, dk = head_pull(dlogits)
        if recipe.wgrad is None:
            # A high-precision wgrad is one GEMM accumulating in float32 over all tokens: sum the chunks' products
            # in float32 and round once, as it does (XLA drops the head_pull's own, rounded dk).
            dk = jnp.einsum("bsd,bsv->dv", h, dlogits, preferred_element_type=jnp.float32)
        return dkernel + dk.astype(jnp.float32), dh

    dkernel, dhidden = jax.lax.scan(body, jnp.zeros(kernel.shape, jnp.float32), (hidden, targets, weights, keys))
    return dhidden, dkernel.astype(kernel.dtype), None, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
