"""A language model's LM head and cross-entropy over chunks of the vocabulary: no full (tokens, vocab) logits in memory.

  hidden, state = model.apply({"params": params}, tokens, rngs=..., mutable=["losses"], return_hidden=True)
  loss = lm_head_loss(config, params, hidden, targets, mask, key)     # float32 (), the mean over (masked) tokens

Autodiff of `logits = head(hidden); softmax_cross_entropy(logits.astype(float32), targets)` keeps, at the start of
the backward pass, the float32 softmax (the cross-entropy's residual) beside the logits' gradient in float32 and the
compute dtype (1.1B Llama at batch 8 x 2048: the softmax alone is 16384 x 32000 x 4 B = 2.1 GB). Here one custom
VJP runs the head GEMM and the cross-entropy one chunk of vocabulary columns at a time, every token in each chunk:
the forward keeps a running log-sum-exp and the target's logit per token, and saves only the log-sum-exp; the
backward recomputes each chunk's logits, forms their gradient from the saved log-sum-exp and pulls it back through
the head (`jax.vjp` of the same chunk function). At most one chunk's logits (`chunk_elements` of them) live at a
time, for one more head GEMM per step (the recomputed forward: 2 x tokens x dim x vocab FLOPs).

Chunks of the vocabulary rather than of the tokens: each chunk's weight gradient (dim, columns) is a whole GEMM
over all tokens, written once, and what is summed over chunks is the hidden states' gradient, tokens x dim in
float32 (the 8B at 8192 tokens: 134 MB) instead of the head's dim x vocab (2.1 GB, read and written by every
chunk's GEMM). Every GEMM also spans all tokens, not a thin slice of them.

Same values as the unchunked head and loss, to float32 rounding: each chunk runs the head's own GEMM
(`qjax.dot_general` with the head's recipe, bf16 by `keep_high_precision`), the loss is optax's cross-entropy
written as log-sum-exp minus the target's logit, and a high-precision head's hidden-state gradient is accumulated
over the chunks in float32 and rounded once, as the one GEMM over the vocabulary does. A quantized head (a run that
removes "lm_head" from keep_high_precision) quantizes each chunk's columns of the kernel, once per GEMM that reads
them: a row-scaled recipe's forward and wgrad then make the unchunked GEMM's codes, and its dgrad scales span a
chunk's columns instead of the whole vocabulary; a tensor-scaled one takes one scale per chunk. Targets must lie in
[0, vocab): another makes the loss NaN, as optax's cross-entropy does.

Under a mesh the head's weight is gathered onto every device once, before the chunk loops; with the tokens split
over devices, each chunk's weight gradient is summed across them as the backward makes it (an all-reduce of
dim x columns per chunk).
"""

import functools

import jax
import jax.numpy as jnp

import qjax
from qjax.models import layers
from qjax.int8_params import Int8Param

CHUNK_ELEMENTS = 2**25  # logits per chunk (tokens x columns): 128 MiB in float32


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
      chunk_elements: logits computed at a time (tokens x vocabulary columns), at least one column's: the
        vocabulary is cut into chunks of as many columns as fit, all tokens in each.

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
    """sum(weights * CE(hidden . kernel, targets)), float32 (), computed over chunks of the vocabulary (module
    docstring).

    hidden (B, T, dim) and kernel (dim, vocab) in the compute dtype; targets (B, T) int; weights (B, T) float32.
    """
    recipe = qjax.recipe(recipe)
    if recipe.needs_key and key is None:
        raise ValueError(f"the LM head's recipe {recipe.name!r} rounds stochastically: pass lm_head_loss a key")
    b, t = hidden.shape[:2]
    vocab = kernel.shape[1]
    columns = min(vocab, max(1, chunk_elements // (b * t)))  # as many as chunk_elements logits hold
    chunks = -(-vocab // columns)
    columns = -(-vocab // chunks)  # as even as the chunks can be: the last one overlaps its neighbour least
    keys = (jax.random.key_data(jax.random.split(key, chunks)) if recipe.needs_key
            else jnp.zeros((chunks, 0), jnp.uint32))
    return _chunked(recipe, columns, hidden, _whole_on_every_device(kernel), targets, weights.astype(jnp.float32),
                    keys)


def _whole_on_every_device(kernel):
    """kernel gathered onto every device under a context mesh, once before the chunk loops (FSDP splits the head
    along the vocabulary, which the loops slice), instead of XLA gathering it inside them."""
    mesh = jax.sharding.get_abstract_mesh()
    if mesh.empty or mesh.manual_axes:
        return kernel
    whole = jax.sharding.PartitionSpec()
    if mesh.are_all_axes_explicit:  # the sharding is the array's type: change it, as a constraint would only check
        return jax.sharding.reshard(kernel, whole)
    return jax.lax.with_sharding_constraint(kernel, whole)


def _chunk(kernel, j, columns: int):
    """Chunk j's columns of kernel (dim, columns), their first column's id, and which of them are chunk j's own
    (columns,) bool: chunk j starts at j * columns, but the last one ends at the vocabulary's end, so where columns
    do not divide the vocabulary it overlaps its neighbour, whose columns it leaves alone."""
    start = jnp.minimum(j * columns, kernel.shape[1] - columns)
    own = start + jnp.arange(columns) >= j * columns
    return jax.lax.dynamic_slice_in_dim(kernel, start, columns, axis=1), start, own


def _targets_here(targets, j, start, columns: int):
    """(each target's column in chunk j (B, T) int, clipped into it; whether chunk j owns that target (B, T))."""
    at = targets - start
    return jnp.clip(at, 0, columns - 1), (targets >= j * columns) & (at < columns)


def _head(recipe, hidden, kernel, key_data):
    """One chunk's logits: hidden (B, T, dim) . kernel (dim, columns) in the compute dtype, the head's recipe."""
    key = jax.random.wrap_key_data(key_data) if recipe.needs_key else None
    return qjax.dot_general(hidden, kernel, (((2,), (0,)), ((), ())), recipe=recipe, key=key)


def _float_logits(logits, own):
    """float32 logits (B, T, columns), -inf in the columns another chunk owns (out of every softmax)."""
    return jnp.where(own, logits.astype(jnp.float32), -jnp.inf)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _chunked(recipe, columns, hidden, kernel, targets, weights, keys):
    return _chunked_fwd(recipe, columns, hidden, kernel, targets, weights, keys)[0]


def _chunked_fwd(recipe, columns, hidden, kernel, targets, weights, keys):
    """The loss, and what the backward reads: the inputs and each token's log-sum-exp (B, T) float32."""
    def body(carry, chunk):
        top, total, picked = carry  # per token: the largest logit so far, sum(exp(logit - top)), the target's logit
        j, key_data = chunk
        kernel_j, start, own = _chunk(kernel, j, columns)
        logits = _float_logits(_head(recipe, hidden, kernel_j, key_data), own)
        new_top = jnp.maximum(top, jnp.max(logits, axis=-1))
        total = total * jnp.exp(top - new_top) + jnp.sum(jnp.exp(logits - new_top[..., None]), axis=-1)
        at, here = _targets_here(targets, j, start, columns)
        target_logit = jnp.take_along_axis(logits, at[..., None], axis=-1)[..., 0]
        return (new_top, total, jnp.where(here, target_logit, picked)), None

    # Carries made from hidden keep its sharding (a batch split over a mesh stays split).
    zeros = jnp.zeros_like(hidden[..., 0], jnp.float32)
    (top, total, picked), _ = jax.lax.scan(body, (zeros - jnp.inf, zeros, zeros), (jnp.arange(keys.shape[0]), keys))
    # A target outside the vocabulary has no logit: NaN, as optax's cross-entropy gives, not a finite loss without it.
    picked = jnp.where((targets >= 0) & (targets < kernel.shape[1]), picked, jnp.nan)
    log_sum_exp = top + jnp.log(total)
    loss = jnp.sum(weights * (log_sum_exp - picked))
    return loss, (hidden, kernel, targets, weights, keys, log_sum_exp)


def _chunked_bwd(recipe, columns, residuals, g):
    hidden, kernel, targets, weights, keys, log_sum_exp = residuals
    token_scale = (weights * g)[..., None]

    def body(carry, chunk):
        dhidden, dkernel = carry
        j, key_data = chunk
        kernel_j, start, own = _chunk(kernel, j, columns)
        logits, head_pull = jax.vjp(lambda h, w: _head(recipe, h, w, key_data), hidden, kernel_j)
        softmax = jnp.exp(_float_logits(logits, own) - log_sum_exp[..., None])
        at, here = _targets_here(targets, j, start, columns)
        target = here[..., None] & (at[..., None] == jnp.arange(columns))
        dlogits = ((softmax - target) * token_scale).astype(logits.dtype)
        dh, dk = head_pull(dlogits)
        if recipe.dgrad is None:
            # A high-precision dgrad is one GEMM accumulating in float32 over the whole vocabulary: sum the chunks'
            # products in float32 and round once, as it does (XLA drops the head_pull's own, rounded dh).
            dh = jnp.einsum("btv,dv->btd", dlogits, kernel_j, preferred_element_type=jnp.float32)
        written = jax.lax.dynamic_slice_in_dim(dkernel, start, columns, axis=1)
        dkernel = jax.lax.dynamic_update_slice_in_dim(dkernel, jnp.where(own, dk, written), start, axis=1)
        return (dhidden + dh.astype(jnp.float32), dkernel), None

    start = (jnp.zeros_like(hidden, jnp.float32), jnp.zeros_like(kernel))
    (dhidden, dkernel), _ = jax.lax.scan(body, start, (jnp.arange(keys.shape[0]), keys))
    return dhidden.astype(hidden.dtype), dkernel, None, None, None


_chunked.defvjp(_chunked_fwd, _chunked_bwd)
