"""Llama with the int8_rowwise recipe: INT8 GEMMs with one scale per row (fwd, dgrad and wgrad) (see llama_base.py for all fields)."""

from configs import llama_base


def get_config():
    config = llama_base.get_config()
    config.recipe = "int8_rowwise"
    return config
