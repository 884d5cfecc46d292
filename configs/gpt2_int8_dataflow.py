"""GPT-2 with the int8_dataflow recipe (Jetfire's setting): int8 GEMMs, LayerNorm / GELU inputs saved int8 in 1x32
groups, gradients rounded to nearest (Jetfire rounds them stochastically: qjax.with_stochastic_gradients; see
gpt2_base.py for all fields)."""

from configs import gpt2_base


def get_config():
    config = gpt2_base.get_config()
    config.recipe = "int8_dataflow"
    return config
