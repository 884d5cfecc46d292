"""Training configs for `python train.py --config configs/<name>.py` (ml_collections `get_config()` files).

llama_base.py / vit_base.py hold every field and its default (the optimizer and loop fields they share come from
common.py); the other files change only what differs.
"""
