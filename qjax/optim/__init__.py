"""qjax.optim: optimizers with low-precision states and low-precision parameters.

Public API:
  adamw_8bit(learning_rate, ...)            AdamW, m/v on 8-bit dynamic tree maps, blocks of 256 (optax transformation)
  adamw_4bit(learning_rate, ...)            AdamW, m on the 4-bit dynamic map, v on the linear map, blocks of 128
  adamw_fp8(learning_rate, ..., dynamic_range_expansion=False)   AdamW, e4m3 states (COAT expansion optional)
  apply_gradients(tx, grads, state, params) one step -> (params, state): tx.update + optax.apply_updates, fused into
                                            one kernel per tensor for adamw_8bit / adamw_fp8(use_kernel=True)
  scale_by_quantized_adam(config, ...)      the shared Adam core; StateConfig says how m and v are stored
  QuantizedAdamState                        its state (count, mu, nu), a plain pytree
  CodebookState, Fp8State, Fp8ExpandedState quantized state tensors (pytrees: orbax and sharding work)
  apply_updates_sr(params, updates, key)    bf16 params + stochastic rounding (no fp32 master copy)
  Int8Param, Int8Dense, to_int8_params, dequantize_params, int8_value_and_grad, apply_updates_int8
                                            INT8 weight-only training
  blockwise, fused_adam                     modules: block-quantized states, the fused step (kernel entry point)
                                            (the code books are `qjax.codebooks`)
"""

from qjax.optim import blockwise, fused_adam, sr_params
from qjax.optim.adam import (QuantizedAdamState, QuantizedAdamW, StateConfig, adamw_4bit, adamw_8bit, adamw_fp8,
                             apply_gradients, scale_by_quantized_adam)
from qjax.optim.blockwise import CodebookState, Fp8ExpandedState, Fp8State
from qjax.optim.int8_params import (Int8Dense, Int8Param, apply_updates_int8, dequantize_params,
                                    int8_value_and_grad, to_int8_params)
from qjax.optim.sr_params import apply_updates_sr

__all__ = [
    "CodebookState", "Fp8ExpandedState", "Fp8State", "Int8Dense", "Int8Param", "QuantizedAdamState", "QuantizedAdamW",
    "StateConfig", "adamw_4bit", "adamw_8bit", "adamw_fp8", "apply_gradients", "apply_updates_int8",
    "apply_updates_sr", "blockwise", "dequantize_params", "fused_adam", "int8_value_and_grad",
    "scale_by_quantized_adam", "sr_params",
    "to_int8_params",
]
