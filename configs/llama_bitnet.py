"""Llama with BitNet b1.58 (the bitnet_b158 recipe): ternary weights x int8 activations (llama_base.py: all fields).

Every projection's forward GEMM multiplies int8 activations (one absmax / 127 scale per token) by the weight's
ternary codes (-1, 0, 1; one scale per tensor, mean |w|) on the int8 GEMM; dgrad multiplies the output gradient by
the same ternary weight, the float32 weight is what AdamW updates (straight-through estimator) and wgrad runs
int8_rowwise. The model needs no other change: BitNet b1.58's architecture is Llama's (RMSNorm, SwiGLU, RoPE, no
biases), and it keeps the embeddings and the LM head in high precision, as qjax's default
keep_high_precision=('lm_head',) does (the qkv and gate_up inputs are RMSNorm'd already; an extra norm before
o_proj and down_proj, as BitLinear's own, trained worse on the toy sweep).

Training: twice the full-precision configs' peak LR, as BitNet b1.58 is trained at higher LRs than full precision
(the 2B4T report's peak is 1.5e-3); on 750 Shakespeare steps at 125M it ended +0.45% from bf16 at this LR against
+2.3% at bf16's, and over 250M tokens of mixed English it reached a lowest eval loss 0.79% below bf16's, later
(docs/recipes.md). A larger model keeps the ratio, e.g. --config.model.size=125m --config.optimizer.lr=1.2e-3
beside bf16's 6e-4.
"""

from configs import llama_base


def get_config():
    config = llama_base.get_config()
    config.recipe = "bitnet_b158"
    config.optimizer.lr = 2 * config.optimizer.lr
    return config
