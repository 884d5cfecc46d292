"""ViT: a plain Vision Transformer classifier with quantized GEMMs.

  config = vit_config("digits", recipe="int8_rowwise")
  model = ViT(config)
  params = model.init(jax.random.key(0), images)["params"]              # images: float32 (B, H, W, C)
  logits = model.apply({"params": params}, images, rngs={"quant": key})  # float32 (B, num_classes)
  loss, accuracy = classification_loss(logits, labels)

Patches are flattened and embedded by a Dense ("patch_embed"), so that GEMM goes through the recipe and the
high-precision filter too (by default it, and the classification "head", stay in bf16). Blocks are pre-norm:
LayerNorm, multi-head attention (scores in the compute dtype), LayerNorm, GELU MLP; the norms and GELU have
hand-written backward passes (`qjax.models.ops`) that save their compute-dtype inputs, not float32 copies; under
the data-flow recipes each runs fused with the projection after it and saves its input in 8 bits (`qjax.prologue`).
Parameter tree:

  patch_embed/{kernel,bias}, cls_token (pool="cls" only), pos_embed (1, tokens, dim),
  layers_{i}/attn_norm, layers_{i}/attn/{qkv,o}_proj, layers_{i}/mlp_norm, layers_{i}/mlp/{fc1,fc2},
  norm, head/{kernel,bias}
"""

import dataclasses
from typing import Any, Callable

import flax.linen as nn
import jax
import jax.numpy as jnp
import optax

from qjax.models import layers
from qjax.models import ops
from qjax.models.ops import layer_norm


@dataclasses.dataclass(frozen=True)
class ViTConfig:
    """ViT shape and training numerics.

    Attributes:
      image_size, patch_size, channels: square images of image_size pixels, cut into (image_size / patch_size)²
        patches of patch_size² * channels values.
      num_classes, dim, n_layers, n_heads, mlp_dim: model shape (dim a multiple of n_heads).
      pool: "cls" (a learned class token, read out at the end) or "mean" (average of the patch tokens, no class
        token; the token count is then a whole number of patches, which block-scaled recipes can tile).
      recipe, keep_high_precision, min_features, compute_dtype, param_dtype, attention: as in `LlamaConfig`.
      norm_eps: LayerNorm epsilon.
      gelu_approximate: the MLP's GELU is the tanh approximation (`nn.gelu`'s default) when True, the exact erf
        form (torch's and Hugging Face ViT's "gelu"; `load_hf_vit` sets it) when False.
    """

    image_size: int
    patch_size: int
    channels: int
    num_classes: int
    dim: int
    n_layers: int
    n_heads: int
    mlp_dim: int
    pool: str = "cls"
    norm_eps: float = 1e-6
    gelu_approximate: bool = True
    recipe: Any = "bf16"
    keep_high_precision: tuple[str, ...] = ("patch_embed", "head")
    min_features: int = 0
    compute_dtype: str = "bfloat16"
    param_dtype: str = "float32"
    attention: str = "auto"

    def __post_init__(self):
        layers.check_positive_ints(self, ("image_size", "patch_size", "channels", "num_classes", "dim", "n_layers",
                                          "n_heads", "mlp_dim"))
        if self.image_size % self.patch_size:
            raise ValueError(f"ViTConfig.image_size ({self.image_size}) must be a multiple of patch_size "
                             f"({self.patch_size})")
        if self.dim % self.n_heads:
            raise ValueError(f"ViTConfig.dim ({self.dim}) must be a multiple of n_heads ({self.n_heads})")
        if self.pool not in ("cls", "mean"):
            raise ValueError(f"ViTConfig.pool must be 'cls' or 'mean', got {self.pool!r}")
        if not self.norm_eps > 0:
            raise ValueError(f"ViTConfig.norm_eps must be > 0, got {self.norm_eps}")
        if not isinstance(self.gelu_approximate, bool):
            raise TypeError(f"ViTConfig.gelu_approximate must be True or False, got {self.gelu_approximate!r}")
        layers.check_quantization_fields(self)

    @property
    def num_patches(self) -> int:
        return (self.image_size // self.patch_size) ** 2

    @property
    def num_tokens(self) -> int:
        return self.num_patches + (self.pool == "cls")

    @property
    def patch_features(self) -> int:
        return self.patch_size * self.patch_size * self.channels

    def projections(self) -> dict[str, tuple[int, int]]:
        """{layer name: (features_in, features_out)} for every GEMM with a weight."""
        per_layer = {"attn/qkv_proj": (self.dim, 3 * self.dim), "attn/o_proj": (self.dim, self.dim),
                     "mlp/fc1": (self.dim, self.mlp_dim), "mlp/fc2": (self.mlp_dim, self.dim)}
        out = {"patch_embed": (self.patch_features, self.dim)}
        out.update({f"layers_{i}/{name}": shape for i in range(self.n_layers) for name, shape in per_layer.items()})
        out["head"] = (self.dim, self.num_classes)
        return out


# Presets. "digits" fits sklearn's 8x8 grey digits (our offline default data): 16 patches of 2x2, widths that are
# multiples of 128 so block-scaled recipes quantize the blocks, mean pooling so a batch of 8k images is 128k tokens.
# "s16" is ViT-S/16 at 224 px with global average pooling ("Better plain ViT baselines", Beyer et al. 2022).
VIT_SIZES: dict[str, ViTConfig] = {
    "tiny": ViTConfig(image_size=8, patch_size=4, channels=3, num_classes=5, dim=32, n_layers=2, n_heads=2,
                      mlp_dim=64),
    "digits": ViTConfig(image_size=8, patch_size=2, channels=1, num_classes=10, dim=128, n_layers=4, n_heads=4,
                        mlp_dim=512, pool="mean"),
    "s16": ViTConfig(image_size=224, patch_size=16, channels=3, num_classes=1000, dim=384, n_layers=12, n_heads=6,
                     mlp_dim=1536, pool="mean"),
}


def vit_config(size: str, **overrides) -> ViTConfig:
    """The `VIT_SIZES[size]` preset with fields replaced, e.g. vit_config("digits", recipe="fp8_rowwise")."""
    if size not in VIT_SIZES:
        raise ValueError(f"unknown ViT size {size!r}; valid sizes: {', '.join(VIT_SIZES)}")
    fields = {f.name for f in dataclasses.fields(ViTConfig)}
    unknown = sorted(set(overrides) - fields)
    if unknown:
        raise ValueError(f"unknown ViTConfig fields {unknown}; valid fields: {', '.join(sorted(fields))}")
    return dataclasses.replace(VIT_SIZES[size], **overrides)


def patchify(images: jax.Array, patch_size: int) -> jax.Array:
    """(B, H, W, C) -> (B, H/p * W/p, p * p * C), patches in row-major order, each flattened as (p, p, C)."""
    b, h, w, c = images.shape
    p = patch_size
    x = images.reshape(b, h // p, p, w // p, p, c).transpose(0, 1, 3, 2, 4, 5)
    return x.reshape(b, (h // p) * (w // p), p * p * c)


class LayerNorm(nn.Module):
    """`nn.LayerNorm`'s output and parameters (scale, bias); saves x and the per-row mean and 1/std for its backward
    (`ops.layer_norm`), not float32 copies of x."""

    eps: float
    dtype: Any
    param_dtype: Any

    @nn.compact
    def __call__(self, x):
        scale, bias = _norm_params(self, None, x.shape[-1], self.param_dtype)
        return layer_norm(x, scale, bias, self.eps, self.dtype)


def _norm_params(module, name, dim, param_dtype):
    """A LayerNorm's (scale, bias) at `name/scale`, `name/bias` of `module` (its own when name is None)."""
    specs = (("scale", nn.initializers.ones, (dim,)), ("bias", nn.initializers.zeros, (dim,)))
    if name is None:
        return tuple(module.param(n, init, shape, param_dtype) for n, init, shape in specs)
    return layers.params(module, name, specs, param_dtype)


@dataclasses.dataclass(frozen=True)
class BlockInits:
    """Kernel initializers of a block's projections (biases start at zero): qkv, the MLP's fc1, and the two that
    write into the residual stream (o_proj, fc2)."""

    qkv: Callable
    fc1: Callable
    out: Callable


# Xavier-uniform on the fused (dim, 3 dim) qkv kernel would see fan_out 3 dim; scale 2 gives each third the limit
# sqrt(3 / dim) a separate (dim, dim) xavier-uniform kernel has.
VIT_INITS = BlockInits(qkv=nn.initializers.variance_scaling(2.0, "fan_avg", "uniform"),
                      fc1=nn.initializers.xavier_uniform(), out=nn.initializers.xavier_uniform())


class Attention(nn.Module):
    """Multi-head self-attention after a LayerNorm: (B, S, dim) -> (B, S, dim); causal for a language model.

    config: a `ViTConfig`, or any config with its fields dim, n_heads, norm_eps and the quantization fields
    (`qjax.models.gpt2` runs these blocks too).
    """

    config: Any
    causal: bool = False
    inits: BlockInits = VIT_INITS

    @nn.compact
    def __call__(self, x, norm_params):
        """x: the block's input, normalized here with norm_params (scale, bias) before the qkv projection."""
        c = self.config
        b, s, _ = x.shape
        heads = lambda y: y.reshape(b, s, c.n_heads, c.dim // c.n_heads)
        # One qkv projection (columns [q | k | v]): the input is quantized once, not three times.
        qkv = layers.prologue_dense(self, c, "qkv_proj", _norm(c), x, norm_params, 3 * c.dim, use_bias=True,
                                    kernel_init=self.inits.qkv)
        q, k, v = (heads(y) for y in jnp.split(qkv, 3, axis=-1))
        out = layers.attention(c, q, k, v, is_causal=self.causal)
        return layers.dense(self, c, "o_proj", c.dim, c.dim, use_bias=True, kernel_init=self.inits.out)(out)


class MLP(nn.Module):
    """fc2(gelu(fc1(ln(x)))): (B, S, dim) -> (B, S, dim); config as `Attention`'s, plus mlp_dim."""

    config: Any
    inits: BlockInits = VIT_INITS

    @nn.compact
    def __call__(self, x, norm_params):
        c = self.config
        h = layers.prologue_dense(self, c, "fc1", _norm(c), x, norm_params, c.mlp_dim, use_bias=True,
                                  kernel_init=self.inits.fc1)
        gelu = ops.GELU if c.gelu_approximate else ops.GELU_EXACT
        return layers.prologue_dense(self, c, "fc2", gelu, h, (), c.dim, use_bias=True, kernel_init=self.inits.out)


def _norm(config) -> ops.Prologue:
    return ops.layer_norm_prologue(config.norm_eps, jnp.dtype(config.compute_dtype))


class Block(nn.Module):
    """Pre-norm block: x + attn(ln(x)), then + mlp(ln(x)); each norm runs inside the projection after it
    (`layers.prologue_dense`: fused with its GEMM under the data-flow recipes). config as `MLP`'s."""

    config: Any
    causal: bool = False
    inits: BlockInits = VIT_INITS

    @nn.compact
    def __call__(self, x):
        c = self.config
        norm = lambda name: _norm_params(self, name, c.dim, jnp.dtype(c.param_dtype))
        x = x + Attention(c, causal=self.causal, inits=self.inits, name="attn")(x, norm("attn_norm"))
        return x + MLP(c, inits=self.inits, name="mlp")(x, norm("mlp_norm"))


class ViT(nn.Module):
    """images float (B, image_size, image_size, channels) -> logits float32 (B, num_classes).

    Recipes that round stochastically draw keys from the "quant" RNG stream: apply(..., rngs={"quant": key}).
    """

    config: ViTConfig

    @nn.compact
    def __call__(self, images):
        c = self.config
        images = jnp.asarray(images)
        expected = (c.image_size, c.image_size, c.channels)
        if images.ndim != 4 or images.shape[1:] != expected or not jnp.issubdtype(images.dtype, jnp.floating):
            raise ValueError(f"ViT takes float images of shape (batch, {', '.join(map(str, expected))}); got "
                             f"{images.dtype} {images.shape}")
        compute, param_dtype = jnp.dtype(c.compute_dtype), jnp.dtype(c.param_dtype)
        x = layers.dense(self, c, "patch_embed", c.patch_features, c.dim, use_bias=True,
                         kernel_init=nn.initializers.lecun_normal())(patchify(images, c.patch_size))
        if c.pool == "cls":
            cls = self.param("cls_token", nn.initializers.zeros, (1, 1, c.dim), param_dtype)
            x = jnp.concatenate([jnp.broadcast_to(cls.astype(compute), (x.shape[0], 1, c.dim)), x], axis=1)
        x = x + self.param("pos_embed", nn.initializers.normal(0.02), (1, c.num_tokens, c.dim),
                           param_dtype).astype(compute)
        for i in range(c.n_layers):
            x = Block(c, name=f"layers_{i}")(x)
        x = LayerNorm(c.norm_eps, compute, param_dtype, name="norm")(x)
        pooled = x[:, 0] if c.pool == "cls" else x.mean(axis=1)
        # Zero-initialised head (big_vision): every class starts at logit 0, loss log(num_classes).
        logits = layers.dense(self, c, "head", c.dim, c.num_classes, use_bias=True,
                              kernel_init=nn.initializers.zeros)(pooled)
        return logits.astype(jnp.float32)


def classification_loss(logits: jax.Array, labels: jax.Array) -> tuple[jax.Array, jax.Array]:
    """(mean softmax cross-entropy, accuracy), both float32 scalars. logits (B, classes) float, labels (B,) int."""
    if logits.ndim != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"classification_loss needs logits (B, classes) and labels (B,); got {logits.shape} and "
                         f"{labels.shape}")
    if not jnp.issubdtype(labels.dtype, jnp.integer):
        raise TypeError(f"classification_loss labels must be int class ids, got {labels.dtype}")
    logits = logits.astype(jnp.float32)
    loss = optax.softmax_cross_entropy_with_integer_labels(logits, labels).mean()
    accuracy = (jnp.argmax(logits, axis=-1) == labels).mean(dtype=jnp.float32)
    return loss, accuracy


def flops_per_example(config: ViTConfig) -> float:
    """Training FLOPs per image (forward + backward), the same accounting as `llama.flops_per_token`.

      6 * num_patches * patch_features * dim               patch embedding, once per patch
      + 6 * num_tokens * N_blocks                           q/k/v/o and MLP weights, once per token
      + 6 * dim * num_classes                               head, once per image
      + 12 * n_layers * dim * num_tokens²                   QKᵀ and AV (2 * 2 * tokens² * dim forward, times 3)
    Biases, norms and softmax are left out.
    """
    c = config
    proj = c.projections()
    n_blocks = sum(f_in * f_out for name, (f_in, f_out) in proj.items() if name.startswith("layers_"))
    return float(6 * c.num_patches * c.patch_features * c.dim + 6 * c.num_tokens * n_blocks
                 + 6 * c.dim * c.num_classes + 12 * c.n_layers * c.dim * c.num_tokens ** 2)
