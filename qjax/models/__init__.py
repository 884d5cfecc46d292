"""Flax models whose projections run quantized GEMMs per a qjax recipe: Llama and GPT-2 (language), ViT (images).

  import jax, jax.numpy as jnp
  from qjax import models

  config = models.llama_config("tiny", recipe="int8_rowwise")       # presets: models.LLAMA_SIZES
  model = models.Llama(config)
  tokens = jnp.zeros((2, 16), jnp.int32)
  params = jax.jit(model.init)(jax.random.key(0), tokens)["params"]
  loss_fn = lambda p, key: models.lm_loss(
      model.apply({"params": p}, tokens, rngs={"quant": key})[:, :-1], tokens[:, 1:])
  grads = jax.jit(jax.grad(loss_fn))(params, jax.random.key(1))     # int8 fwd, dgrad and wgrad GEMMs
  print(models.num_params(params), models.layer_recipes(config)["lm_head"].name)   # the LM head stays bf16

  gpt2 = models.GPT2(models.gpt2_config("tiny", recipe="int8_dataflow"))   # nanoGPT's shape; "gpt2": 124M

  vit = models.ViT(models.vit_config("digits", recipe="fp8_rowwise"))
  images = jnp.zeros((8, 8, 8, 1), jnp.float32)
  logits = jax.jit(vit.apply)(jax.jit(vit.init)(jax.random.key(0), images), images)   # (8, 10) float32

The "quant" RNG stream is needed only by recipes with stochastic rounding (`qjax.with_stochastic_gradients`).
Hugging Face Llama checkpoints: `load_hf_llama(dir)` -> (config, params), `save_hf_llama(config, params, dir)`;
text: `generate(config, params, prompt_tokens, max_new_tokens, ...)` with a KV cache (`qjax.models.generate`).
Hugging Face ViT checkpoints: `load_hf_vit(dir)` -> (config, params), `save_hf_vit(config, params, dir)`.
`LM_ARCHS`: the language-model architectures by name (a train config's `model.arch`), each with its presets, config
function and Flax module.
"""

import dataclasses
from typing import Callable

from qjax.models.generate import dequantize_weights, generate, int8_weights
from qjax.models.gpt2 import GPT2, GPT2_SIZES, GPT2Config, gpt2_config
from qjax.models.hf_llama import load_hf_config, load_hf_llama, save_hf_llama
from qjax.models.hf_vit import load_hf_vit, save_hf_vit
from qjax.models.layers import layer_recipes
from qjax.models.lm_head import lm_head_loss
from qjax.models.llama import LLAMA_SIZES, Llama, LlamaConfig, flops_per_token, llama_config, lm_loss, num_params
from qjax.models.moe import MoEConfig
from qjax.models.vit import VIT_SIZES, ViT, ViTConfig, classification_loss, flops_per_example, vit_config


@dataclasses.dataclass(frozen=True)
class LMArch:
    sizes: dict  # preset name -> shape fields
    make_config: Callable  # (size, **overrides) -> the model's config
    model: type  # the Flax module, built from that config


LM_ARCHS = {"llama": LMArch(LLAMA_SIZES, llama_config, Llama), "gpt2": LMArch(GPT2_SIZES, gpt2_config, GPT2)}

__all__ = [
    "GPT2", "GPT2Config", "GPT2_SIZES", "LLAMA_SIZES", "LMArch", "LM_ARCHS", "Llama", "LlamaConfig", "MoEConfig",
    "VIT_SIZES", "ViT", "ViTConfig", "classification_loss", "dequantize_weights", "flops_per_example",
    "flops_per_token", "generate", "gpt2_config", "int8_weights", "layer_recipes", "llama_config", "lm_head_loss",
    "lm_loss", "load_hf_config", "load_hf_llama", "load_hf_vit", "num_params", "save_hf_llama", "save_hf_vit",
    "vit_config",
]
