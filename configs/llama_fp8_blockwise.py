"""Llama with the fp8_blockwise recipe: DeepSeek-V3 FP8 blocks (1x128 activations, 128x128 weights).

Layers whose features are not multiples of 128 stay in bf16 (`qjax.recipe_for_layer`), so the CPU default "tiny"
model (dim 64) runs in bf16 throughout: use --config.model.size=125m or 1b to quantize. The tokens per
micro-batch, batch_size / grad_accum_steps * seq_len, must be a multiple of 128 (wgrad contracts over tokens;
checked with the config). See llama_base.py for all fields.
"""

from configs import llama_base


def get_config():
    config = llama_base.get_config()
    config.recipe = "fp8_blockwise"
    return config
