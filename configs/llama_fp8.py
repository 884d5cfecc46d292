"""Llama with the fp8_tensorwise recipe: FP8 GEMMs with one scale per tensor (e4m3 forward, e5m2 gradients) (see llama_base.py for all fields)."""

from configs import llama_base


def get_config():
    config = llama_base.get_config()
    config.recipe = "fp8_tensorwise"
    return config
