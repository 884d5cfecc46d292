"""Llama: a decoder-only transformer (RMSNorm, RoPE, SwiGLU, grouped-query causal attention) with quantized GEMMs.

  config = llama_config("tiny", recipe="int8_rowwise")
  model = Llama(config)
  params = model.init(jax.random.key(0), tokens)["params"]           # tokens: int32 (B, T)
  logits = model.apply({"params": params}, tokens, rngs={"quant": key})  # float32 (B, T, vocab_size)
  loss = lm_loss(logits[:, :-1], tokens[:, 1:])

Every projection (qkv, o, gate_up, down, lm_head) runs its three GEMMs per `config.recipe`, except layers whose
name matches a regex in `config.keep_high_precision` (default: the LM head), layers narrower than
`config.min_features`, and layers a block-scaled recipe cannot tile; those run in bf16 (`qjax.recipe_for_layer`).
Attention scores and values stay in the compute dtype. RMSNorm, SwiGLU and RoPE have hand-written backward
passes (`qjax.models.ops`) that save their compute-dtype inputs (RoPE: only the positions), not float32
intermediates; under the data-flow recipes each norm and SwiGLU runs fused with the projection after it and saves
its input in 8 bits (`qjax.prologue`). Parameter tree (names are what the filter matches):

  embed/embedding (vocab, dim)
  layers_{i}/attn_norm/scale, layers_{i}/attn/{qkv,o}_proj/kernel, layers_{i}/mlp_norm/scale,
  layers_{i}/mlp/{gate_up,down}_proj/kernel, norm/scale, lm_head/kernel (dim, vocab; absent when tied)

q, k and v are one projection (kernel columns [q | k | v]) and so are gate and up ([gate | up]): each input is
quantized once instead of three (two) times, and one wide GEMM runs where there were narrow ones (the 1B shape's
k and v project 2048 -> 256). Per-output-channel scales make the fused layer compute what separate ones would; a
row scale of the fused output's gradient spans all of its columns.
"""

import dataclasses
import functools
import math
from typing import Any

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

import qjax
from qjax.models import layers, ops
from qjax.models.moe import MoE, MoEConfig
from qjax.models.ops import apply_rope, rms_norm


@dataclasses.dataclass(frozen=True)
class LlamaConfig:
    """Llama shape and training numerics.

    Attributes:
      vocab_size, dim, n_layers, n_heads, n_kv_heads, ffn_dim: model shape; head_dim = dim // n_heads must be even
        (RoPE rotates pairs) and n_heads a multiple of n_kv_heads (grouped-query attention).
      max_seq_len: the longest sequence the model accepts (RoPE itself has no table to outgrow).
      tie_embeddings: the LM head reuses the embedding table (logits = h @ embeddingᵀ).
      rope_theta, norm_eps: RoPE base and RMSNorm epsilon.
      recipe: a recipe name (see `qjax.RECIPES`) or a `qjax.Recipe`.
      keep_high_precision: regexes searched in layer names (e.g. "layers_0/attn/qkv_proj", "lm_head"); matching
        layers run in bf16, like torchao's module_filter_fn.
      min_features: layers with min(features_in, features_out) below this run in bf16.
      compute_dtype, param_dtype: "float32", "bfloat16" or "float16".
      remat: recompute each block in the backward pass (jax.checkpoint), trading FLOPs for activation memory.
      recompute_attention: recompute attention up to o_proj in the backward pass (the norm, qkv GEMM, RoPE and
        attention's forward: Megatron's selective recomputation), saving the block's input instead of the norm's
        output (the qkv GEMM's input), q, k, v and attention's own copy of its output (o_proj still saves its
        input: in 8 bits under the data-flow recipes); under FSDP the recomputation gathers the qkv weight again.
        No effect under remat, which recomputes the whole block.
      attention: "auto" (cuDNN flash attention on GPU where it applies, else XLA), "xla" or "cudnn".
      moe: None (a dense SwiGLU of ffn_dim per block) or a `MoEConfig`: every block's feed-forward is a mixture of
        experts (`qjax.models.moe`); ffn_dim is then unused.
      smooth_swiglu: Smooth-SwiGLU, an outlier guard for 8-bit recipes: each channel of the SwiGLU output is divided
        by a power of two near its max |.| before down_proj quantizes it, and down_proj's kernel rows multiplied by
        it (`layers.SmoothedDense`): the same function up to float rounding. SwiGLU then runs unfused (under the
        data-flow recipes it saves gate and up in the compute dtype, not 8 bits). Dense MLPs only.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    ffn_dim: int
    max_seq_len: int
    tie_embeddings: bool = False
    rope_theta: float = 10000.0
    norm_eps: float = 1e-5
    recipe: Any = "bf16"
    keep_high_precision: tuple[str, ...] = ("lm_head",)
    min_features: int = 0
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    remat: bool = False
    recompute_attention: bool = False
    attention: str = "auto"
    moe: MoEConfig | None = None
    smooth_swiglu: bool = False

    def __post_init__(self):
        layers.check_positive_ints(self, ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "ffn_dim",
                                          "max_seq_len"))
        if self.dim % self.n_heads:
            raise ValueError(f"LlamaConfig.dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"LlamaConfig.n_heads ({self.n_heads}) must be a multiple of n_kv_heads "
                             f"({self.n_kv_heads}) for grouped-query attention")
        if self.head_dim % 2:
            raise ValueError(f"LlamaConfig head_dim = dim // n_heads = {self.head_dim} must be even for RoPE; "
                             "change dim or n_heads")
        if not (self.rope_theta > 0 and self.norm_eps > 0):
            raise ValueError(f"LlamaConfig.rope_theta ({self.rope_theta}) and norm_eps ({self.norm_eps}) must be > 0")
        layers.check_quantization_fields(self)
        if self.moe is not None and not isinstance(self.moe, MoEConfig):
            raise ValueError(f"LlamaConfig.moe must be None or a qjax.models.MoEConfig, got {type(self.moe).__name__}")
        if not isinstance(self.smooth_swiglu, bool):
            raise ValueError(f"LlamaConfig.smooth_swiglu must be True or False, got {self.smooth_swiglu!r}")
        if self.smooth_swiglu and self.moe is not None:
            raise ValueError("LlamaConfig.smooth_swiglu applies to dense MLPs only, and this config has moe set: "
                             "set smooth_swiglu=False, or moe=None for a dense model")

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def projections(self) -> dict[str, tuple[int, int]]:
        """{layer name: (features_in, features_out)} for every GEMM with a weight, the (tied or not) LM head too."""
        kv = self.n_kv_heads * self.head_dim
        per_layer = {"attn/qkv_proj": (self.dim, self.dim + 2 * kv), "attn/o_proj": (self.dim, self.dim),
                     "mlp/gate_up_proj": (self.dim, 2 * self.ffn_dim), "mlp/down_proj": (self.ffn_dim, self.dim)}
        if self.moe is not None:  # per expert; the routed experts' FLOPs per token are top_k times these
            del per_layer["mlp/gate_up_proj"], per_layer["mlp/down_proj"]
            per_layer.update(self.moe.projections(self.dim))
        out = {f"layers_{i}/{name}": shape for i in range(self.n_layers) for name, shape in per_layer.items()}
        out["lm_head"] = (self.dim, self.vocab_size)
        return out


# Presets. "125m" is GPT-2-small sized: MHA, SwiGLU width 2048 (= 8/3 * 768, so the MLP has GPT-2's 4.7M params
# per layer); 85M params in the blocks, 134M with untied 32000-token embeddings. "350m" is GPT-2-medium sized: MHA,
# SwiGLU width 2816 (8/3 * 1024 rounded up to a multiple of 256); 308M in the blocks, 374M with untied 32000-token
# embeddings (342M with a 16k BPE vocabulary). "1b" is the TinyLlama-1.1B /
# Llama-2-style 1B shape the GPU benchmarks use (1.1B params).
LLAMA_SIZES: dict[str, LlamaConfig] = {
    "tiny": LlamaConfig(vocab_size=256, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, ffn_dim=128, max_seq_len=128),
    "125m": LlamaConfig(vocab_size=32000, dim=768, n_layers=12, n_heads=12, n_kv_heads=12, ffn_dim=2048,
                        max_seq_len=2048),
    "350m": LlamaConfig(vocab_size=32000, dim=1024, n_layers=24, n_heads=16, n_kv_heads=16, ffn_dim=2816,
                        max_seq_len=2048),
    "1b": LlamaConfig(vocab_size=32000, dim=2048, n_layers=22, n_heads=32, n_kv_heads=4, ffn_dim=5632,
                      max_seq_len=2048),
    "8b": LlamaConfig(vocab_size=128256, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, ffn_dim=14336,
                      max_seq_len=8192, rope_theta=500000.0),
}


def llama_config(size: str, **overrides) -> LlamaConfig:
    """The `LLAMA_SIZES[size]` preset with fields replaced, e.g. llama_config("1b", recipe="int8_rowwise")."""
    if size not in LLAMA_SIZES:
        raise ValueError(f"unknown Llama size {size!r}; valid sizes: {', '.join(LLAMA_SIZES)}")
    fields = {f.name for f in dataclasses.fields(LlamaConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown LlamaConfig fields {unknown}; valid fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(LLAMA_SIZES[size], **overrides)


class RMSNorm(nn.Module):
    """x / rms(x) * scale, statistics in float32; saves x and the per-row 1/rms for its backward (`ops.rms_norm`)."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        scale = self.param("scale", nn.initializers.ones, (x.shape[-1],), self.param_dtype)
        return rms_norm(x, scale, self.eps, self.dtype)


def _norm(config: LlamaConfig) -> ops.Prologue:
    return ops.rms_norm_prologue(config.norm_eps, jnp.dtype(config.compute_dtype))


def _init(config: LlamaConfig, residual: bool = False):
    # GPT-2 / nanoGPT init: std 0.02, projections into the residual stream scaled down by sqrt(2 * n_layers).
    std = 0.02 / math.sqrt(2 * config.n_layers) if residual else 0.02
    return nn.initializers.normal(std)


class Attention(nn.Module):
    """Grouped-query causal self-attention with RoPE: (B, T, dim) -> (B, T, dim), compute dtype.

    Applied (not initialized) with the "cache" collection mutable (`apply(..., mutable=["cache"])`, as
    `qjax.models.generate` does), it decodes: the cache holds k and v (B, max_seq_len, n_kv_heads, head_dim) and the
    number of positions filled; the T new tokens take the positions after those, write their k and v there and
    attend to every filled position up to their own. The first such call (no cache passed) creates an empty cache.
    """

    config: LlamaConfig

    @nn.compact
    def __call__(self, x, norm_scale, positions):
        """x: the block's input (B, T, dim), normalized here with norm_scale (dim,) before the qkv projection."""
        c = self.config
        decoding = self.is_mutable_collection("cache") and not self.is_initializing()  # init mutates everything
        attend = functools.partial(_attend, decoding=decoding)
        if c.recompute_attention and not c.remat and not decoding:  # under remat the whole block runs again
            attend = nn.remat(attend)  # only x is saved: the norm, qkv GEMM, RoPE and attention run again
        out = attend(self, x, norm_scale, positions)
        return layers.dense(self, c, "o_proj", c.dim, c.dim, use_bias=False, kernel_init=_init(c, residual=True))(out)


def _attend(module: Attention, x, norm_scale, positions, decoding: bool):
    """Attention's body up to o_proj: (B, T, dim) -> the heads' outputs (B, T, dim), compute dtype (creates the
    qkv projection and, when decoding, the cache in `module`)."""
    c = module.config
    b, t, _ = x.shape
    kv = c.n_kv_heads * c.head_dim
    qkv = layers.prologue_dense(module, c, "qkv_proj", _norm(c), x, (norm_scale,), c.dim + 2 * kv,
                                kernel_init=_init(c))
    q, k, v = jnp.split(qkv, [c.dim, c.dim + kv], axis=-1)
    q = q.reshape(b, t, c.n_heads, c.head_dim)
    k, v = k.reshape(b, t, c.n_kv_heads, c.head_dim), v.reshape(b, t, c.n_kv_heads, c.head_dim)
    if decoding:
        filled = module.variable("cache", "filled", lambda: jnp.zeros((), jnp.int32))
        positions = positions + filled.value
    q, k = apply_rope(q, positions, theta=c.rope_theta), apply_rope(k, positions, theta=c.rope_theta)
    if decoding:
        shape = (b, c.max_seq_len, c.n_kv_heads, c.head_dim)
        k_cache = module.variable("cache", "k", jnp.zeros, shape, k.dtype)
        v_cache = module.variable("cache", "v", jnp.zeros, shape, v.dtype)
        k_cache.value = jax.lax.dynamic_update_slice(k_cache.value, k, (0, filled.value, 0, 0))
        v_cache.value = jax.lax.dynamic_update_slice(v_cache.value, v, (0, filled.value, 0, 0))
        filled.value = filled.value + t
        mask = jnp.arange(c.max_seq_len)[None, :] <= positions[:, None]  # (T, max_seq_len): causal and filled
        out = jax.nn.dot_product_attention(q, k_cache.value, v_cache.value, mask=mask[None, None])
        out = out.reshape(b, t, c.dim)
    else:
        out = layers.attention(c, q, k, v, is_causal=True)
    return out


class MLP(nn.Module):
    """SwiGLU: down(silu(gate(x)) * up(x)), (B, T, dim) -> (B, T, dim)."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x, norm_scale):
        """x: the block's residual stream (B, T, dim), normalized here with norm_scale (dim,)."""
        c = self.config
        gate_up = layers.prologue_dense(self, c, "gate_up_proj", _norm(c), x, (norm_scale,), 2 * c.ffn_dim,
                                        kernel_init=_init(c))
        if c.smooth_swiglu:  # the outlier guard: SwiGLU unfused, its output's channels rescaled before down_proj
            return layers.smoothed_dense(self, c, "down_proj", ops.SWIGLU.apply(gate_up), c.dim,
                                         kernel_init=_init(c, residual=True))
        # SwiGLU saves gate and up only (`ops.swiglu`), in 8 bits under the data-flow recipes.
        return layers.prologue_dense(self, c, "down_proj", ops.SWIGLU, gate_up, (), c.dim,
                                     kernel_init=_init(c, residual=True))


class Block(nn.Module):
    """Pre-norm transformer block: x + attn(norm(x)), then + mlp(norm(x))."""

    config: LlamaConfig

    @nn.compact
    def __call__(self, x, positions):
        c = self.config
        # The norms run inside the projections after them (`layers.prologue_dense`): fused with their GEMM where the
        # recipe saves 8-bit activations. Their scales keep RMSNorm's parameter paths.
        scale = lambda name: layers.params(self, name, (("scale", nn.initializers.ones, (c.dim,)),),
                                           jnp.dtype(c.param_dtype))[0]
        x = x + Attention(c, name="attn")(x, scale("attn_norm"), positions)
        if c.moe:  # the router reads the normalized input: the norm runs unfused, in the compute dtype
            return x + MoE(c, _init, name="moe")(_norm(c).apply(x, scale("mlp_norm")))
        return x + MLP(c, name="mlp")(x, scale("mlp_norm"))


class Llama(nn.Module):
    """tokens int (B, T), T <= max_seq_len -> logits float32 (B, T, vocab_size).

    Recipes that round stochastically draw keys from the "quant" RNG stream: apply(..., rngs={"quant": key}).
    """

    config: LlamaConfig

    @nn.compact
    def __call__(self, tokens, return_hidden: bool = False):
        """return_hidden: return the final norm's output (B, T, dim) in the compute dtype instead of the logits,
        for a loss that runs the LM head itself (`qjax.models.lm_head`)."""
        c = self.config
        tokens = layers.check_tokens(tokens, c.max_seq_len, "Llama")
        compute = jnp.dtype(c.compute_dtype)
        embed = nn.Embed(c.vocab_size, c.dim, param_dtype=jnp.dtype(c.param_dtype), embedding_init=_init(c),
                         name="embed")
        # The residual stream stays in the compute dtype (half the bytes of float32 per layer boundary); norms and
        # RoPE compute in float32 internally.
        x = embed(tokens).astype(compute)
        positions = jnp.arange(tokens.shape[1])
        block = nn.remat(Block) if c.remat else Block
        for i in range(c.n_layers):
            x = block(c, name=f"layers_{i}")(x, positions)
        x = RMSNorm(c.norm_eps, compute, jnp.dtype(c.param_dtype), name="norm")(x)
        if return_hidden:
            return x
        if c.tie_embeddings:
            # The head GEMM is x (B, T, dim) . embedding (vocab, dim) contracted on dim: already the (N, K) weight
            # layout. Named "lm_head" so the filter treats it like the untied head.
            recipe = layers.recipe_for(c, layers.layer_name(self, "lm_head"), c.dim, c.vocab_size)
            logits = qjax.DotGeneral(recipe=recipe, name="lm_head")(
                x, embed.embedding.astype(compute), (((2,), (1,)), ((), ())))
        else:
            logits = layers.dense(self, c, "lm_head", c.dim, c.vocab_size, use_bias=False, kernel_init=_init(c))(x)
        # The GEMM writes the compute dtype (a float32 output would make its backward GEMMs float32 too).
        return logits.astype(jnp.float32)


def lm_loss(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean next-token cross-entropy, float32 scalar.

    logits: (B, T, vocab) float; targets: (B, T) int, targets[b, t] the token that follows position t (for a
    model run on tokens, pass logits[:, :-1] and tokens[:, 1:]).
    """
    if logits.ndim != 3 or targets.shape != logits.shape[:2]:
        raise ValueError(f"lm_loss needs logits (B, T, vocab) and targets (B, T); got {logits.shape} and "
                         f"{targets.shape}")
    if not jnp.issubdtype(targets.dtype, jnp.integer):
        raise TypeError(f"lm_loss targets must be int token ids, got {targets.dtype}")
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def num_params(params) -> int:
    """Number of scalars in a parameter pytree."""
    return sum(int(x.size) for x in jax.tree.leaves(params))


def flops_per_token(config, seq_len: int) -> float:
    """Training FLOPs per token (forward + backward) of a `LlamaConfig` or `GPT2Config`, the PaLM / nanoGPT
    accounting used for MFU.

      6 * N_matmul           every weight does 2 FLOPs per token forward and 4 backward; N_matmul counts the
                             projections and the LM head (also when tied), not the embedding lookup or norms; with
                             MoE, top_k routed experts and the shared ones per token, not the float32 router
      + 12 * n_layers * dim * seq_len   QKᵀ and AV: 2 * 2 * seq_len * dim forward per layer, times 3; the causal
                             mask is not discounted (as in PaLM's appendix B and nanoGPT)
    """
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len <= 0:
        raise ValueError(f"seq_len must be a positive int, got {seq_len!r}")
    n_matmul = sum(f_in * f_out for f_in, f_out in config.projections().values())
    # projections() lists each routed expert's GEMMs once; a token runs top_k of them. A GPT2Config has no experts.
    if getattr(config, "moe", None) is not None:
        n_matmul += (config.moe.top_k - 1) * config.n_layers * 3 * config.dim * config.moe.expert_ffn_dim
    return float(6 * n_matmul + 12 * config.n_layers * config.dim * seq_len)
