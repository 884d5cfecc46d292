"""Text generation with a KV cache: greedy or sampled (temperature, top-k, top-p), a batch of prompts, an end token,
and quantized inference (a recipe for the forward GEMMs, or int8 weights quantized once).

  new = generate(config, params, prompt_tokens, max_new_tokens=64)                    # greedy, int32 (B, 64)
  new = generate(config, params, prompt_tokens, 64, temperature=0.8, top_p=0.95, key=jax.random.key(0))
  new = generate(config, params, prompt_tokens, 64, recipe="fp8_rowwise")             # fp8 forward GEMMs
  new = generate(config, int8_weights(params), prompt_tokens, 64)                     # int8 weight-only

The prompts of a batch have the same length (no padding). One jitted call runs the prefill (the whole prompt
through `Llama` with a fresh cache, which gives the first new token) and then a `lax.while_loop` of one-token
forwards that stops once every row has emitted `eos_token` or after `max_new_tokens`.
"""

import dataclasses
import functools

import jax
import jax.numpy as jnp

from qjax.int8_params import Int8Param, quantize_int8_param
from qjax.models.llama import Llama, LlamaConfig


def int8_weights(params):
    """`params` with every projection kernel (in, out) replaced by a `qjax.int8_params.Int8Param`: int8 codes and
    one float32 scale per output feature, rounded to nearest, so the weights sit in memory at one byte each. The
    same type `--config.model.param_dtype=int8` trains; `generate` dequantizes them inside its jitted step."""
    def quantize(path, x):
        is_kernel = getattr(path[-1], "key", None) == "kernel"
        return quantize_int8_param(jnp.asarray(x, jnp.float32)) if is_kernel else x
    return jax.tree_util.tree_map_with_path(quantize, params)


def dequantize_weights(params, dtype):
    """The inverse of `int8_weights`: every `Int8Param` kernel back to an (in, out) array of `dtype`."""
    return jax.tree.map(lambda x: x.dequantize(dtype) if isinstance(x, Int8Param) else x, params,
                        is_leaf=lambda x: isinstance(x, Int8Param))


def _filter_logits(logits, top_k, top_p):
    """float32 (B, vocab) logits with tokens outside the top k / the top-p nucleus set to -inf."""
    if top_k is not None:
        kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
        logits = jnp.where(logits < kth, -jnp.inf, logits)
    if top_p is not None:
        sorted_logits = jnp.sort(logits, axis=-1)[:, ::-1]
        probs = jax.nn.softmax(sorted_logits, axis=-1)
        # Keep a token while the mass of the tokens ranked above it is below top_p (the first one always).
        before = jnp.cumsum(probs, axis=-1) - probs
        cutoff = jnp.min(jnp.where(before < top_p, sorted_logits, jnp.inf), axis=-1, keepdims=True)
        logits = jnp.where(logits < cutoff, -jnp.inf, logits)
    return logits


def _next_token(logits, key, temperature, top_k, top_p):
    if temperature == 0.0:
        return jnp.argmax(logits, axis=-1).astype(jnp.int32)
    logits = _filter_logits(logits / temperature, top_k, top_p)
    return jax.random.categorical(key, logits, axis=-1).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(0, 3, 4, 5, 6, 7))
def _generate(config, params, prompt, max_new_tokens, temperature, top_k, top_p, eos_token, key):
    model = Llama(config)
    params = dequantize_weights(params, jnp.dtype(config.compute_dtype))
    eos = -1 if eos_token is None else eos_token  # -1: no token equals it, no row ever stops

    def pick(i, logits, done):
        """Token i from the last position's logits; rows already done repeat the end token."""
        token = _next_token(logits[:, -1], jax.random.fold_in(key, i), temperature, top_k, top_p)
        return jnp.where(done, eos, token)

    # The "quant" stream: recipes that round stochastically (qjax.with_stochastic_gradients) ask for it even in a
    # forward; its bits do not touch nearest-rounded forward GEMMs.
    quant = jax.random.fold_in(key, 0xFFFFFFFF)  # not a token index i
    logits, cache = model.apply({"params": params}, prompt, mutable=["cache"], rngs={"quant": quant})  # prefill
    token = pick(0, logits, jnp.zeros((prompt.shape[0],), bool))
    out = jnp.zeros((prompt.shape[0], max_new_tokens), jnp.int32).at[:, 0].set(token)

    def step(carry):
        i, token, cache, out, done = carry
        logits, cache = model.apply({"params": params, **cache}, token[:, None], mutable=["cache"],
                                    rngs={"quant": quant})
        token = pick(i, logits, done)
        return i + 1, token, cache, out.at[:, i].set(token), done | (token == eos)

    def more(carry):
        i, _, _, _, done = carry
        return (i < max_new_tokens) & ~jnp.all(done)

    i, _, _, out, _ = jax.lax.while_loop(more, step, (jnp.int32(1), token, cache, out, token == eos))
    # A loop that ended before max_new_tokens did so because every row had ended: the rest is end tokens.
    return jnp.where(jnp.arange(max_new_tokens)[None, :] >= i, eos, out)


def generate(config: LlamaConfig, params, prompt_tokens, max_new_tokens: int, temperature: float = 0.0,
             top_k: int | None = None, top_p: float | None = None, key: jax.Array | None = None,
             eos_token: int | None = None, recipe=None) -> jax.Array:
    """New tokens int32 (B, max_new_tokens) continuing `prompt_tokens` int (B, P) (prompts of one length).

    temperature: 0 picks the most likely token (greedy); > 0 samples from softmax(logits / temperature), after
      keeping the `top_k` most likely tokens and / or the smallest set whose probability reaches `top_p`; needs
      `key` (the same key gives the same tokens).
    eos_token: a row stops at this token; its later positions hold eos_token too. Without it, every row runs
      max_new_tokens.
    recipe: a recipe (name) for the forward GEMMs instead of config.recipe, e.g. "fp8_rowwise" or "int8_rowwise"
      (inference differentiates nothing, so only the forward GEMM is quantized). Params from `int8_weights` run
      int8 weight-only. P + max_new_tokens must not exceed config.max_seq_len; the cache holds that many positions.
    """
    if not isinstance(config, LlamaConfig):
        raise TypeError(f"generate decodes Llama models (a LlamaConfig), got a {type(config).__name__}: other "
                        "models have no KV-cache decoding yet")
    prompt = jnp.asarray(prompt_tokens)
    if prompt.ndim != 2 or not jnp.issubdtype(prompt.dtype, jnp.integer) or prompt.shape[1] == 0:
        raise ValueError(f"prompt_tokens must be int (batch, prompt_len) with prompt_len >= 1; got {prompt.dtype} "
                         f"{prompt.shape}")
    if isinstance(max_new_tokens, bool) or not isinstance(max_new_tokens, int) or max_new_tokens < 1:
        raise ValueError(f"max_new_tokens must be an int >= 1, got {max_new_tokens!r}")
    total = prompt.shape[1] + max_new_tokens
    if total > config.max_seq_len:
        raise ValueError(f"prompt length {prompt.shape[1]} + max_new_tokens {max_new_tokens} = {total} exceeds "
                         f"config.max_seq_len {config.max_seq_len}")
    if not temperature >= 0:
        raise ValueError(f"temperature must be >= 0, got {temperature!r}")
    if temperature > 0 and key is None:
        raise ValueError("sampling (temperature > 0) needs key=jax.random.key(...)")
    if top_k is not None and not 1 <= top_k <= config.vocab_size:
        raise ValueError(f"top_k must be in [1, vocab_size={config.vocab_size}], got {top_k!r}")
    if top_p is not None and not 0 < top_p <= 1:
        raise ValueError(f"top_p must be in (0, 1], got {top_p!r}")
    # The cache is as long as this call needs; remat only matters for training.
    config = dataclasses.replace(config, max_seq_len=total, remat=False,
                                 recipe=config.recipe if recipe is None else recipe)
    key = jax.random.key(0) if key is None else key
    return _generate(config, params, prompt, max_new_tokens, float(temperature), top_k,
                     None if top_p is None else float(top_p), eos_token, key)
