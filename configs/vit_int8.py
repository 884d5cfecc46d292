"""ViT with the int8_rowwise recipe: INT8 GEMMs with one scale per row in fwd, dgrad and wgrad (see vit_base.py)."""

from configs import vit_base


def get_config():
    config = vit_base.get_config()
    config.recipe = "int8_rowwise"
    return config
