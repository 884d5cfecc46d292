"""Shared defaults of the ViT (image classification) configs: a small ViT on scikit-learn's 8x8 digits, offline.

  python train.py --config configs/vit_int8.py                       # workdir runs/vit_int8
  python train.py --config configs/vit_bf16.py --config.model.size=s16 \
      --config.data.kind=tfds --config.data.name=imagenet2012 --config.data.data_dir=...   # ViT-S/16
  python train.py --config configs/vit_int8.py --config.data.kind=npz --config.data.path=my_images.npz

Model: the `config.model.size` preset of `qjax.models.VIT_SIZES` ("tiny", "digits", "s16"); a config.model
field left at None keeps the preset's value. num_classes, image_size and channels come from the data.
"""

from ml_collections import config_dict

placeholder = config_dict.placeholder


def get_config() -> config_dict.ConfigDict:
    config = config_dict.ConfigDict()
    config.task = "image"
    config.model = config_dict.ConfigDict({
        "size": "digits",
        "patch_size": placeholder(int), "dim": placeholder(int), "n_layers": placeholder(int),
        "n_heads": placeholder(int), "mlp_dim": placeholder(int), "pool": placeholder(str),
        "norm_eps": placeholder(float), "compute_dtype": placeholder(str), "param_dtype": placeholder(str),
        "attention": placeholder(str),
    })
    # Quantization: a name from qjax.RECIPES; layers matching keep_high_precision (None: the model's default,
    # patch_embed and head) or narrower than min_features (None: 0) stay in bf16.
    config.recipe = "bf16"
    config.keep_high_precision = placeholder(tuple)
    config.min_features = placeholder(int)

    # Data: kind "digits" (offline, the default), "npz" (path) or "tfds" (name, data_dir; optionally train_split,
    # test_split, image_key, label_key); image_size resizes. Every kind's fields are here so that the command line
    # can set them (the config is locked); a field left at None is unset.
    config.data = config_dict.ConfigDict({
        "kind": "digits", "image_size": placeholder(int), "path": placeholder(str), "name": placeholder(str),
        "data_dir": placeholder(str), "train_split": placeholder(str), "test_split": placeholder(str),
        "image_key": placeholder(str), "label_key": placeholder(str),
    })
    config.batch_size = 128
    config.steps = 300
    config.grad_accum_steps = 1

    config.optimizer = config_dict.ConfigDict({
        "name": "adamw",  # or adamw_8bit, adamw_4bit, adamw_fp8
        "lr": 1e-3, "warmup_steps": placeholder(int),  # None: min(30, steps // 10)
        "min_lr_ratio": 0.1,
        "b1": 0.9, "b2": 0.999, "eps": 1e-8, "weight_decay": 0.05, "grad_clip": 1.0,
        # dynamic_range_expansion: adamw_fp8 only (COAT). stochastic_rounding: update bfloat16 params
        # (--config.model.param_dtype=bfloat16) with stochastic rounding, no float32 master copy.
        "dynamic_range_expansion": False, "stochastic_rounding": False,
    })

    config.log_every = 25
    config.eval_every = 100  # 0: no eval
    config.eval_batches = 2
    config.checkpoint_every = 100  # 0: only at the end
    config.keep_checkpoints = 3
    config.seed = 0
    return config
