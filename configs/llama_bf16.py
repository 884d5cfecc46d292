"""Llama baseline: every GEMM in bf16 (see llama_base.py for all fields)."""

from configs import llama_base


def get_config():
    config = llama_base.get_config()
    config.recipe = "bf16"
    return config
