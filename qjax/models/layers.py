"""Pieces shared by the Llama and ViT models: config validation, quantized projections, attention dispatch.

Every projection of a model is an `nn.Dense` whose `dot_general_cls` is `qjax.DotGeneral` with the recipe
`qjax.recipe_for_layer` picks for that layer's name (its module path, e.g. "layers_0/attn/qkv_proj") and feature
sizes. A config describes its projections with `config.projections()`, so `layer_recipes(config)` tells which
recipe each layer runs without building the model.
"""

import functools
import re
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp

import qjax
from qjax import health
from qjax import int8_params
from qjax.prologue import Prologue, prologue_dot

FLOAT_DTYPES = ("float32", "bfloat16", "float16")
ATTENTION_IMPLEMENTATIONS = ("auto", "xla", "cudnn")


def check_positive_ints(config, names):
    """ValueError naming the first field of `config` in `names` that is not a positive int."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
            raise ValueError(f"{type(config).__name__}.{name} must be a positive int, got {value!r}")


def check_tokens(tokens, max_seq_len: int, model: str) -> jax.Array:
    """tokens as an int (batch, seq_len) array, seq_len <= max_seq_len; ValueError naming `model` otherwise."""
    tokens = jnp.asarray(tokens)
    if tokens.ndim != 2 or not jnp.issubdtype(tokens.dtype, jnp.integer):
        raise ValueError(f"{model} takes int tokens of shape (batch, seq_len); got {tokens.dtype} {tokens.shape}")
    if tokens.shape[1] > max_seq_len:
        raise ValueError(f"sequence length {tokens.shape[1]} exceeds max_seq_len {max_seq_len}")
    return tokens


def check_quantization_fields(config):
    """Validates the fields every model config shares (recipe, filter, dtypes, attention); normalises the filter.

    Called from a frozen dataclass's __post_init__: turns a list `keep_high_precision` into a tuple (so the config
    stays hashable, as Flax module attributes must be).
    """
    cls = type(config).__name__
    qjax.recipe(config.recipe)  # ValueError listing the valid names for an unknown recipe
    keep = config.keep_high_precision
    if isinstance(keep, str):
        raise ValueError(f"{cls}.keep_high_precision must be a tuple of regexes, e.g. ({keep!r},), not a string")
    keep = tuple(keep)
    for pattern in keep:
        if not isinstance(pattern, str):
            raise ValueError(f"{cls}.keep_high_precision holds {pattern!r}; it must hold regex strings")
        try:
            re.compile(pattern)
        except re.error as e:
            raise ValueError(f"{cls}.keep_high_precision: {pattern!r} is not a valid regex ({e})") from None
    object.__setattr__(config, "keep_high_precision", keep)
    if isinstance(config.min_features, bool) or not isinstance(config.min_features, int) or config.min_features < 0:
        raise ValueError(f"{cls}.min_features must be an int >= 0, got {config.min_features!r}")
    for name in ("compute_dtype", "param_dtype"):
        value = getattr(config, name)
        if value not in FLOAT_DTYPES:
            raise ValueError(f"{cls}.{name} must be one of {FLOAT_DTYPES}, got {value!r}")
    if config.attention not in ATTENTION_IMPLEMENTATIONS:
        raise ValueError(f"{cls}.attention must be one of {ATTENTION_IMPLEMENTATIONS}, got {config.attention!r}")


def layer_recipes(config) -> dict[str, qjax.Recipe]:
    """{layer name: the recipe that layer runs} for every projection `config.projections()` lists."""
    return {name: recipe_for(config, name, features_in, features_out)
            for name, (features_in, features_out) in config.projections().items()}


def recipe_for(config, layer_name: str, features_in: int, features_out: int) -> qjax.Recipe:
    return qjax.recipe_for_layer(config.recipe, layer_name, features_in=features_in, features_out=features_out,
                                 keep_high_precision=config.keep_high_precision, min_features=config.min_features)


def layer_name(module: nn.Module, name: str) -> str:
    """The name the high-precision filter matches: the child's module path, e.g. "layers_0/attn/qkv_proj"."""
    return "/".join(module.path + (name,))


def dense(module: nn.Module, config, name: str, features_in: int, features: int, *, use_bias: bool,
          kernel_init=nn.initializers.lecun_normal()) -> nn.Dense:
    """A child `nn.Dense` of `module` (call inside its compact method) whose GEMMs run the layer's recipe.

    Params are created in `config.param_dtype`; the layer casts inputs and kernel to `config.compute_dtype`, but
    the kernel stays in its param dtype under `Recipe.recompute_weight_codes` (the GEMM then saves the param
    itself). A kernel given as an int8 weight-only `qjax.int8_params.Int8Param` (qjax.train's `model.param_dtype=int8`)
    reaches the layer's `qjax.DotGeneral` uncast.
    """
    recipe = recipe_for(config, layer_name(module, name), features_in, features)
    promote = _promote_keeping_kernel if recipe.recompute_weight_codes else int8_params.promote_dtype
    return nn.Dense(features, use_bias=use_bias, dtype=jnp.dtype(config.compute_dtype),
                    param_dtype=jnp.dtype(config.param_dtype), kernel_init=kernel_init,
                    dot_general_cls=functools.partial(qjax.DotGeneral, recipe=recipe), promote_dtype=promote,
                    name=name)


def _promote_keeping_kernel(inputs, kernel, *rest, dtype=None, inexact=True) -> list:
    """nn.Dense's promote_dtype under `Recipe.recompute_weight_codes`: inputs and bias promoted as usual, the kernel
    left in its param dtype, so the layer's custom VJP keeps the param itself for the backward, not a cast copy
    (`qjax.DotGeneral` then computes in the inputs' dtype)."""
    inputs, *rest = int8_params.promote_dtype(inputs, *rest, dtype=dtype, inexact=inexact)
    return [inputs, kernel, *rest]


class _Params(nn.Module):
    """Parameters alone, for layers whose parameters feed a fused op (same paths and initialisation as the Flax
    layer they stand in for, e.g. a norm's "scale" and "bias")."""

    specs: tuple  # ((param name, initializer, shape), ...)
    dtype: Any

    @nn.compact
    def __call__(self):
        return tuple(self.param(name, init, shape, self.dtype) for name, init, shape in self.specs)


def params(module: nn.Module, name: str, specs: tuple, dtype) -> tuple:
    """The parameters `name/<param name>` of `module` (call inside its compact method) as a tuple, one per
    (param name, initializer, shape) in `specs`, e.g. a norm's (("scale", ones, (dim,)),)."""
    return _Params(tuple(specs), dtype, name=name)()


class PrologueDense(nn.Module):
    """A projection fused with the op before it: op(x, *params) . kernel (+ bias) in one custom VJP
    (`qjax.prologue.prologue_dot`) that saves x in 8 bits. Its "kernel" and "bias" parameters are `nn.Dense`'s."""

    op: Prologue
    features: int
    recipe: Any
    use_bias: bool
    kernel_init: Any
    compute_dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x, *params):
        features_in = jax.eval_shape(self.op.apply, x, *params).shape[-1]
        kernel = self.param("kernel", self.kernel_init, (features_in, self.features), self.param_dtype)
        key = self.make_rng("quant") if self.recipe.needs_key else None
        if not self.recipe.recompute_weight_codes:  # else the param itself enters the custom VJP (prologue_dot)
            kernel = kernel.astype(self.compute_dtype)
        y = prologue_dot(self.op, x, params, kernel, recipe=self.recipe, key=key,
                         layer="/".join(self.path))
        if health.is_collecting(self):  # the GEMM's lhs is op(x): recomputed here only when health is measured
            y = health.observe_gemm(self, self.recipe, self.op.apply(x, *params), kernel,
                                    (((x.ndim - 1,), (0,)), ((), ())), y)
        if self.use_bias:
            y = y + self.param("bias", nn.initializers.zeros, (self.features,), self.param_dtype).astype(y.dtype)
        return y


def prologue_dense(module: nn.Module, config, name: str, op: Prologue, x, params: tuple, features: int, *,
                   kernel_init, use_bias: bool = False) -> jax.Array:
    """op(x, *params) through the projection `name` (a child of `module`; call in its compact method).

    Where the layer's recipe saves 8-bit activations (`Recipe.saved`: the data-flow recipes) op and GEMM run as
    one `PrologueDense`; otherwise op.apply, then `dense`. Same parameters either way.
    """
    features_in = jax.eval_shape(op.apply, x, *params).shape[-1]
    recipe = recipe_for(config, layer_name(module, name), features_in, features)
    if recipe.saved is None:
        return dense(module, config, name, features_in, features, use_bias=use_bias, kernel_init=kernel_init)(
            op.apply(x, *params))
    return PrologueDense(op, features, recipe, use_bias, kernel_init, jnp.dtype(config.compute_dtype),
                         jnp.dtype(config.param_dtype), name=name)(x, *params)


def channel_scale(x: jax.Array) -> jax.Array:
    """float32 (K,) per-channel power-of-two scales of x (..., K): 2^round(log2 max |x[..., k]|) over all leading
    dims, 1 for an all-zero channel; no gradient flows through them. Powers of two, so dividing x by them and
    multiplying a kernel's rows by them is exact (short of overflow and subnormals)."""
    amax = jnp.max(jnp.abs(jax.lax.stop_gradient(x)).astype(jnp.float32).reshape(-1, x.shape[-1]), axis=0)
    return jnp.where(amax > 0, jnp.exp2(jnp.round(jnp.log2(amax))), 1.0)


class SmoothedDense(nn.Module):
    """x . kernel (no bias) with every input channel of x scaled into [~0.7, ~1.4] before the GEMM quantizes it:
    (x / s) . (s * kernel), s = `channel_scale(x)` (K,), the kernel's rows multiplied by s. Smooth-SwiGLU (Fishman et
    al. 2024, "Scaling FP8 training to trillion-token LLMs") applies this to the SwiGLU output before the down
    projection, whose outlier channels otherwise set a tensor scale that flushes the other channels' codes. The same
    function as `dense` up to float rounding (exactly, in exact arithmetic); same "kernel" parameter."""

    features: int
    recipe: Any
    kernel_init: Any
    compute_dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        kernel = self.param("kernel", self.kernel_init, (x.shape[-1], self.features), self.param_dtype)
        if isinstance(kernel, qjax.optim.Int8Param):  # int8 weight-only: the rescaled weight is a float view
            kernel = kernel.dequantize(self.compute_dtype)
        s = channel_scale(x)
        x = (x.astype(jnp.float32) / s).astype(self.compute_dtype)
        kernel = (kernel.astype(jnp.float32) * s[:, None]).astype(self.compute_dtype)
        return qjax.DotGeneral(recipe=self.recipe)(x, kernel, (((x.ndim - 1,), (0,)), ((), ())))


def smoothed_dense(module: nn.Module, config, name: str, x, features: int, *, kernel_init) -> jax.Array:
    """x (..., K) through the projection `name` of `module` as a `SmoothedDense` (call in its compact method)."""
    recipe = recipe_for(config, layer_name(module, name), x.shape[-1], features)
    return SmoothedDense(features, recipe, kernel_init, jnp.dtype(config.compute_dtype),
                         jnp.dtype(config.param_dtype), name=name)(x)


def attention_implementation(config, head_dim: int, seq_len: int, is_causal: bool = True) -> str:
    """"xla" or "cudnn" for `jax.nn.dot_product_attention`.

    jax 0.11.2's implementation=None always means XLA, so "auto" picks cuDNN flash attention itself where cuDNN
    takes the case: a GPU backend, bf16/f16 inputs, head_dim a multiple of 8 and at most 128, and for causal
    attention an even sequence length (cuDNN raised "Unsupported sequence length" for a causal training step at 63).
    """
    if config.attention != "auto":
        return config.attention
    cudnn_ok = (jax.default_backend() == "gpu" and config.compute_dtype in ("bfloat16", "float16")
                and head_dim % 8 == 0 and head_dim <= 128 and (seq_len % 2 == 0 or not is_causal))
    return "cudnn" if cudnn_ok else "xla"


def attention(config, q, k, v, *, is_causal: bool):
    """Softmax attention in the compute dtype, never quantized.

    q: (B, T, n_heads, head_dim); k, v: (B, T, n_kv_heads, head_dim) with n_heads % n_kv_heads == 0 (query head h
    reads K/V head h // (n_heads // n_kv_heads)). Returns (B, T, n_heads * head_dim).
    """
    impl = attention_implementation(config, q.shape[-1], q.shape[1], is_causal)
    out = jax.nn.dot_product_attention(q, k, v, is_causal=is_causal, implementation=impl)
    return out.reshape(*out.shape[:2], -1)
