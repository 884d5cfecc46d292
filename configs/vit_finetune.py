"""Full fine-tune of a Hugging Face ViT (ViTForImageClassification or ViTModel) with int8_rowwise GEMMs (see
vit_base.py for all fields):

  python train.py --config configs/vit_finetune.py --config.init_from=path/to/hf_vit_dir \
      --config.data.kind=npz --config.data.path=my_images.npz --config.data.image_size=224

The model's shape and first weights come from `init_from`; the images must have its size and channels
(config.data.image_size resizes them). A checkpoint whose classifier has another number of classes than the data (or
a ViTModel, which has none) gets a new zero-initialized head of the data's classes, which the run's start-up lines
say. A fine-tuned checkpoint goes back to the Hugging Face format with `qjax.models.save_hf_vit`.
"""

from configs import vit_base


def get_config():
    config = vit_base.get_config()
    config.recipe = "int8_rowwise"
    config.batch_size, config.steps = 64, 300
    config.optimizer.lr = 1e-4
    config.optimizer.weight_decay = 0.0
    config.optimizer.warmup_steps = 10
    config.log_every, config.eval_every = 10, 50
    return config
