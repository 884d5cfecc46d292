"""placeholder"""
from qjax.optim.adam import adamw_8bit, adamw_4bit, adamw_fp8, scale_by_quantized_adam, StateConfig, QuantizedAdamState
