"""ViT baseline: every GEMM in bf16 (see vit_base.py for all fields)."""

from configs import vit_base


def get_config():
    config = vit_base.get_config()
    config.recipe = "bf16"
    return config
