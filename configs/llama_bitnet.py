"""Llama with BitNet b1.58 (the bitnet_b158 recipe): ternary weights x int8 activations (llama_base.py: all fields).

Every projection's forward GEMM multiplies int8 activations (one absmax / 127 scale per token) by the weight's
ternary codes (-1, 0, 1; one scale per tensor, mean |w|) on the int8 GEMM; the float32 weight is what AdamW updates
(straight-through estimator) and the backward GEMMs run int8_rowwise. The model needs no other change: BitNet b1.58's
architecture is Llama's (RMSNorm, SwiGLU, RoPE, no biases), and it keeps the embeddings and the LM head in high
precision, as qjax's default keep_high_precision=('lm_head',) does. bitnet_b158_bf16_bwd runs the backward in bf16.
"""

from configs import llama_base


def get_config():
    config = llama_base.get_config()
    config.recipe = "bitnet_b158"
    return config
