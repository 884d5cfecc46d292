"""GPT-2 (nanoGPT's shape): a decoder-only transformer with LayerNorm, a GELU MLP and learned positions, with
quantized GEMMs.

  config = gpt2_config("tiny", recipe="int8_dataflow")              # presets: GPT2_SIZES ("gpt2": 124M)
  model = GPT2(config)
  params = model.init(jax.random.key(0), tokens)["params"]          # tokens: int32 (B, T), T <= max_seq_len
  logits = model.apply({"params": params}, tokens, rngs={"quant": key})   # float32 (B, T, vocab_size)
  loss = lm_loss(logits[:, :-1], tokens[:, 1:])

It is the setting Jetfire (INT8 data flow) reports on: GPT-2 pretraining, loss against 16-bit. The blocks are the
ViT's (`qjax.models.vit.Block`, causal here): pre-LN, LayerNorm -> qkv (with bias) -> causal attention
(`jax.nn.dot_product_attention`, cuDNN on a GPU) -> o_proj -> residual; LayerNorm -> fc1 -> GELU (tanh, GPT-2's)
-> fc2 -> residual. So every projection runs the config's recipe through the same layers as Llama's and ViT's, and
under the data-flow recipes LayerNorm -> qkv, LayerNorm -> fc1 and GELU -> fc2 run fused, their inputs saved in
8 bits (`qjax.prologue`). nanoGPT's initialization: every kernel and both embeddings normal(0.02), the projections
into the residual stream (o_proj, fc2) normal(0.02 / sqrt(2 n_layers)), biases zero. No dropout.

The LM head is tied to the token embedding, as in GPT-2 and nanoGPT: logits = ln_f(x) . embeddingᵀ, one
`qjax.DotGeneral` named "lm_head" that `keep_high_precision` keeps in bf16 by default (as every qjax LM head). The
final LayerNorm therefore runs unfused (a fused layer owns its kernel; the tied head's weight is the embedding),
as Llama's final RMSNorm does: it saves its compute-dtype input, one row per token.

Parameter tree (sharding rules and the high-precision filter read these names):

  embed/embedding (vocab, dim), pos_embed (max_seq_len, dim)
  layers_{i}/attn_norm/{scale,bias}, layers_{i}/attn/{qkv,o}_proj/{kernel,bias},
  layers_{i}/mlp_norm/{scale,bias}, layers_{i}/mlp/{fc1,fc2}/{kernel,bias}, norm/{scale,bias}
"""

import dataclasses
import math
from typing import Any

import flax.linen as nn
import jax.numpy as jnp

import qjax
from qjax.models import layers, vit


@dataclasses.dataclass(frozen=True)
class GPT2Config:
    """GPT-2 shape and training numerics.

    Attributes:
      vocab_size, dim, n_layers, n_heads, mlp_dim: model shape (dim a multiple of n_heads; GPT-2's mlp_dim is
        4 * dim).
      max_seq_len: rows of the learned position table, the longest sequence the model accepts (nanoGPT's
        block_size).
      norm_eps: LayerNorm epsilon (1e-5, PyTorch's and so nanoGPT's).
      gelu_approximate: GPT-2's GELU is the tanh approximation (True); False, the exact erf form (the blocks are
        the ViT's, `vit.Block`, which read this field).
      recipe, keep_high_precision, min_features, compute_dtype, param_dtype, remat, attention: as in `LlamaConfig`
        (keep_high_precision's default keeps the tied LM head, "lm_head", in bf16).
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    mlp_dim: int
    max_seq_len: int
    norm_eps: float = 1e-5
    gelu_approximate: bool = True
    recipe: Any = "bf16"
    keep_high_precision: tuple[str, ...] = ("lm_head",)
    min_features: int = 0
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    remat: bool = False
    attention: str = "auto"

    def __post_init__(self):
        layers.check_positive_ints(self, ("vocab_size", "dim", "n_layers", "n_heads", "mlp_dim", "max_seq_len"))
        if self.dim % self.n_heads:
            raise ValueError(f"GPT2Config.dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if not self.norm_eps > 0:
            raise ValueError(f"GPT2Config.norm_eps must be > 0, got {self.norm_eps}")
        layers.check_quantization_fields(self)

    @property
    def head_dim(self) -> int:
        return self.dim // self.n_heads

    def projections(self) -> dict[str, tuple[int, int]]:
        """{layer name: (features_in, features_out)} for every GEMM with a weight, the tied LM head too."""
        per_layer = {"attn/qkv_proj": (self.dim, 3 * self.dim), "attn/o_proj": (self.dim, self.dim),
                     "mlp/fc1": (self.dim, self.mlp_dim), "mlp/fc2": (self.mlp_dim, self.dim)}
        out = {f"layers_{i}/{name}": shape for i in range(self.n_layers) for name, shape in per_layer.items()}
        out["lm_head"] = (self.dim, self.vocab_size)
        return out


# Presets. "gpt2" is GPT-2 small as nanoGPT trains it: 124M params with its 50304-token vocabulary (GPT-2's 50257
# padded to a multiple of 64), 85M in the blocks; a run on byte data takes the data's vocabulary instead.
# "tiny" is for tests and CPU runs.
GPT2_SIZES: dict[str, GPT2Config] = {
    "tiny": GPT2Config(vocab_size=256, dim=64, n_layers=2, n_heads=4, mlp_dim=256, max_seq_len=128),
    "gpt2": GPT2Config(vocab_size=50304, dim=768, n_layers=12, n_heads=12, mlp_dim=3072, max_seq_len=1024),
}


def gpt2_config(size: str, **overrides) -> GPT2Config:
    """The `GPT2_SIZES[size]` preset with fields replaced, e.g. gpt2_config("gpt2", recipe="int8_dataflow")."""
    if size not in GPT2_SIZES:
        raise ValueError(f"unknown GPT-2 size {size!r}; valid sizes: {', '.join(GPT2_SIZES)}")
    fields = {f.name for f in dataclasses.fields(GPT2Config)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown GPT2Config fields {unknown}; valid fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(GPT2_SIZES[size], **overrides)


def block_inits(config: GPT2Config) -> vit.BlockInits:
    """nanoGPT's initialization of a block's kernels: normal(0.02), o_proj and fc2 normal(0.02 / sqrt(2 L))."""
    return vit.BlockInits(qkv=nn.initializers.normal(0.02), fc1=nn.initializers.normal(0.02),
                          out=nn.initializers.normal(0.02 / math.sqrt(2 * config.n_layers)))


class GPT2(nn.Module):
    """tokens int (B, T), T <= max_seq_len -> logits float32 (B, T, vocab_size).

    Recipes that round stochastically (qjax.with_stochastic_gradients) draw keys from the "quant" RNG stream:
    apply(..., rngs={"quant": key}).
    """

    config: GPT2Config

    @nn.compact
    def __call__(self, tokens, return_hidden: bool = False):
        """return_hidden: return the final norm's output (B, T, dim) in the compute dtype instead of the logits,
        for a loss that runs the LM head itself (`qjax.models.lm_head`)."""
        c = self.config
        tokens = layers.check_tokens(tokens, c.max_seq_len, "GPT2")
        compute, param_dtype = jnp.dtype(c.compute_dtype), jnp.dtype(c.param_dtype)
        embed = nn.Embed(c.vocab_size, c.dim, param_dtype=param_dtype, embedding_init=nn.initializers.normal(0.02),
                         name="embed")
        positions = self.param("pos_embed", nn.initializers.normal(0.02), (c.max_seq_len, c.dim), param_dtype)
        # The residual stream stays in the compute dtype; the norms compute in float32 internally.
        x = embed(tokens).astype(compute) + positions[:tokens.shape[1]].astype(compute)
        block = nn.remat(vit.Block) if c.remat else vit.Block
        inits = block_inits(c)
        for i in range(c.n_layers):
            x = block(c, causal=True, inits=inits, name=f"layers_{i}")(x)
        x = vit.LayerNorm(c.norm_eps, compute, param_dtype, name="norm")(x)
        if return_hidden:
            return x
        # x (B, T, dim) . embedding (vocab, dim) contracted on dim: the embedding is already the (N, K) weight.
        recipe = layers.recipe_for(c, layers.layer_name(self, "lm_head"), c.dim, c.vocab_size)
        logits = qjax.DotGeneral(recipe=recipe, name="lm_head")(x, embed.embedding.astype(compute),
                                                                 (((2,), (1,)), ((), ())))
        # The GEMM writes the compute dtype (a float32 output would make its backward GEMMs float32 too).
        return logits.astype(jnp.float32)
