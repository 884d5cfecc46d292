"""qjax.optim: optimizers with low-precision states and low-precision parameters.

Public API:
  adamw_8bit(learning_rate, ...)            AdamW, m/v on 8-bit dynamic tree maps, blocks of 256 (optax transformation)
  adamw_4bit(learning_rate, ...)            AdamW, m on the 4-bit dynamic map, v on the linear map, blocks of 128
  adamw_fp8(learning_rate, ..., dynamic_range_expansion=False)   AdamW, e4m3 states (COAT expansion optional)
  apply_gradients(tx, grads, state, params) one step -> (params, state): tx.update + optax.apply_updates, fused into
                                            one kernel per tensor for adamw_8bit / _4bit / _fp8(use_kernel=True)
  chain_fused(*transforms)                  optax.chain that keeps the last one's fused step (clip, then AdamW)
  clip_by_global_norm(max_norm)             optax's, folded by chain_fused into the AdamW step (no clipped copy)
  apply_updates_sr(params, updates, key)    bf16 params + stochastic rounding (no fp32 master copy)
  Int8Param, to_int8_params, dequantize_params, int8_value_and_grad, apply_updates_int8
                                            INT8 weight-only training (the param type is qjax.int8_params')

The building blocks (quantized_adamw and StateConfig in adamw / adam, the state types in blockwise) are imported
by their module path.

Low-bit Adam lives here whole, one module per concept, lowest first:
  adam_math, codebooks   the formulas the jnp code and the fused kernel share (Adam update, e4m3 state codecs, code
                         book maps); numerics-level: they import only qjax.numerics and qjax.formats
  blockwise, streaming   the quantized state tensors, and updating a tree in groups to bound peak memory
  adam, fused_adam       the Adam core, and the fused step's entry (its kernel: qjax.kernels.adam_step_mgpu)
  clipping               clipping by the global norm, folded into the fused step
  adamw, sr_params       the AdamWs users build, and params updated with stochastic rounding (bf16, int8)

Names are imported on first use (module `__getattr__`), so importing `adam_math` or `codebooks`, as the kernel
does, runs none of the optimizer code that imports the kernel.
"""

import importlib

# Module names written out in full: tests/test_layering.py reads them as this package's imports.
_SUBMODULES = {
    "adam": "qjax.optim.adam", "adam_math": "qjax.optim.adam_math", "adamw": "qjax.optim.adamw",
    "blockwise": "qjax.optim.blockwise", "clipping": "qjax.optim.clipping", "codebooks": "qjax.optim.codebooks",
    "fused_adam": "qjax.optim.fused_adam", "sr_params": "qjax.optim.sr_params", "streaming": "qjax.optim.streaming",
}
# public name -> the module that defines it
_EXPORTS = {
    "adamw_4bit": "qjax.optim.adamw", "adamw_8bit": "qjax.optim.adamw", "adamw_fp8": "qjax.optim.adamw",
    "apply_gradients": "qjax.optim.adamw", "chain_fused": "qjax.optim.adamw",
    "clip_by_global_norm": "qjax.optim.clipping",
    "apply_updates_int8": "qjax.optim.sr_params", "apply_updates_sr": "qjax.optim.sr_params",
    "Int8Param": "qjax.int8_params", "dequantize_params": "qjax.int8_params",
    "int8_value_and_grad": "qjax.int8_params", "to_int8_params": "qjax.int8_params",
}
__all__ = sorted(_EXPORTS)  # the modules stay importable by path (qjax.optim.adamw, ...), not re-exported


def __getattr__(name):
    if name in _SUBMODULES:
        return importlib.import_module(_SUBMODULES[name])
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'qjax.optim' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_SUBMODULES) | set(_EXPORTS))
