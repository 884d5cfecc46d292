"""qjax.optim: optimizers with low-precision states and low-precision parameters.

Public API:
  adamw_8bit(learning_rate, ...)            AdamW, m/v on 8-bit dynamic tree maps, blocks of 256 (optax transformation)
  adamw_4bit(learning_rate, ...)            AdamW, m on the 4-bit dynamic map, v on the linear map, blocks of 128
  adamw_fp8(learning_rate, ..., dynamic_range_expansion=False)   AdamW, e4m3 states (COAT expansion optional)
  quantized_adamw(config, learning_rate, ...)  the AdamW they build: a FusedTransformation, state QuantizedAdamState
  apply_gradients(tx, grads, state, params) one step -> (params, state): tx.update + optax.apply_updates, fused into
                                            one kernel per tensor for adamw_8bit / adamw_fp8(use_kernel=True)
  chain_fused(*transforms)                  optax.chain that keeps the last one's fused step (clip, then AdamW)
  FusedTransformation                       an optax transformation with step(grads, state, params) -> (params, state)
  scale_by_quantized_adam(config, ...)      the Adam core (direction only); StateConfig says how m and v are stored
  QuantizedAdamState                        its and the AdamWs' state (count, mu, nu), a plain pytree
  CodebookState, Fp8State, Fp8ExpandedState quantized state tensors (pytrees: orbax and sharding work)
  apply_updates_sr(params, updates, key)    bf16 params + stochastic rounding (no fp32 master copy)
  Int8Param, Int8Dense, to_int8_params, dequantize_params, int8_value_and_grad, apply_updates_int8,
  has_int8_params                           INT8 weight-only training (the param type is qjax.int8_params')
  blockwise, adam, adamw, fused_adam        modules: block quantization, Adam core, AdamWs, the fused step (its kernel
                                            is qjax.kernels.adam_step_mgpu; the code books are qjax.codebooks)
"""

from qjax.optim import adam, adamw, blockwise, fused_adam, sr_params
from qjax.optim.adam import QuantizedAdamState, StateConfig, scale_by_quantized_adam
from qjax.optim.adamw import (FusedTransformation, adamw_4bit, adamw_8bit, adamw_fp8, apply_gradients, chain_fused,
                              quantized_adamw)
from qjax.optim.blockwise import CodebookState, Fp8ExpandedState, Fp8State
from qjax.int8_params import (Int8Dense, Int8Param, dequantize_params, has_int8_params, int8_value_and_grad,
                               to_int8_params)
from qjax.optim.sr_params import apply_updates_int8, apply_updates_sr

__all__ = [
    "CodebookState", "Fp8ExpandedState", "Fp8State", "FusedTransformation", "Int8Dense", "Int8Param",
    "QuantizedAdamState", "StateConfig", "adam", "adamw", "adamw_4bit", "adamw_8bit", "adamw_fp8", "apply_gradients",
    "apply_updates_int8", "apply_updates_sr", "blockwise", "chain_fused", "dequantize_params", "fused_adam",
    "has_int8_params", "int8_value_and_grad", "quantized_adamw", "scale_by_quantized_adam", "sr_params",
    "to_int8_params",
]
