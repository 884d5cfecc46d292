"""Shared defaults of the ViT (image classification) configs: a small ViT on scikit-learn's 8x8 digits, offline.

  python train.py --config configs/vit_int8.py                       # workdir runs/vit_int8
  python train.py --config configs/vit_bf16.py --config.model.size=s16 \
      --config.data.kind=tfds --config.data.name=imagenet2012 --config.data.data_dir=...   # ViT-S/16
  python train.py --config configs/vit_int8.py --config.data.kind=npz --config.data.path=my_images.npz

Model: the `config.model.size` preset of `qjax.models.VIT_SIZES` ("tiny", "digits", "s16"); a config.model
field left at None keeps the preset's value. num_classes, image_size and channels come from the data. With
`init_from` (a Hugging Face ViT directory, `qjax.models.load_hf_vit`) the shape and first weights come from that
checkpoint and only config.model's numerics fields apply; configs/vit_finetune.py.
"""

from ml_collections import config_dict

from configs import common

placeholder = config_dict.placeholder


def get_config() -> config_dict.ConfigDict:
    # One field per line, its trailing comment the one-line doc `train.py --show_config` prints.
    config = config_dict.ConfigDict()
    config.task = "image"  # "image" (classification) or "lm" (next-token prediction)
    config.model = config_dict.ConfigDict({
        "size": "digits",  # preset of qjax.models.VIT_SIZES: tiny, digits, s16; the fields below replace its values
        "patch_size": placeholder(int),  # pixels per patch side (None: the preset's)
        "dim": placeholder(int),  # width of the residual stream (None: the preset's)
        "n_layers": placeholder(int),  # transformer blocks (None: the preset's)
        "n_heads": placeholder(int),  # attention heads (None: the preset's)
        "mlp_dim": placeholder(int),  # MLP hidden width (None: the preset's)
        "pool": placeholder(str),  # cls (a learned class token) or mean (patch tokens averaged) (None: preset's)
        "norm_eps": placeholder(float),  # LayerNorm epsilon (None: the preset's)
        "compute_dtype": placeholder(str),  # dtype of activations: float32, bfloat16, float16 (None: bfloat16)
        "param_dtype": placeholder(str),  # dtype of params: float32 or bfloat16 (None: float32)
        "attention": placeholder(str),  # auto (cuDNN flash attention on GPU where it applies), xla or cudnn
    })
    config.recipe = "bf16"  # how GEMMs are quantized: a name from qjax.RECIPES, e.g. int8_rowwise, fp8_tensorwise
    config.keep_high_precision = placeholder(tuple)  # regexes of layer names kept in bf16 (None: patch_embed, head)
    config.min_features = placeholder(int)  # layers narrower than this stay in bf16 (None: 0)
    config.init_from = placeholder(str)  # Hugging Face ViT dir whose weights and shape start the run (None: random)

    # Every data kind's fields are here so that the command line can set them (the config is locked); a field left
    # at None is unset.
    config.data = config_dict.ConfigDict({
        "kind": "digits",  # digits (scikit-learn's 8x8 digits, offline), npz (path) or tfds (name, data_dir)
        "image_size": placeholder(int),  # resize images to this side (None: as stored)
        "path": placeholder(str),  # npz: file with train_images, train_labels, test_images, test_labels
        "name": placeholder(str),  # tfds: dataset name, e.g. imagenet2012
        "data_dir": placeholder(str),  # tfds: where the prepared dataset lives
        "train_split": placeholder(str),  # tfds: split to train on (None: train)
        "test_split": placeholder(str),  # tfds: split to evaluate on (None: test)
        "image_key": placeholder(str),  # tfds: feature holding the image (None: image)
        "label_key": placeholder(str),  # tfds: feature holding the label (None: label)
    })
    config.batch_size = 128  # images per optimizer step (all micro-batches together)
    config.steps = 300  # optimizer steps of the run (the LR schedule ends here)
    config.grad_accum_steps = 1  # micro-batches per step (batch_size / grad_accum_steps images each)

    return common.add_optimizer_and_loop(config, lr=1e-3, b2=0.999, weight_decay=0.05, eval_batches=2)
