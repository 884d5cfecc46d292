"""Shared defaults of the Llama (language model) configs: a tiny Llama on Shakespeare bytes, a few minutes on a CPU.

  python -m qjax.data.prepare shakespeare --out data/shakespeare     # once
  python train.py --config configs/llama_int8.py                     # workdir runs/llama_int8
  python train.py --config configs/llama_int8.py --config.model.size=1b --config.seq_len=2048 \
      --config.batch_size=8 --config.optimizer.lr=3e-4                # the ~1B model, on a GPU

Model: the `config.model.size` preset of `qjax.models.LLAMA_SIZES` ("tiny", "125m", "1b"); any other
config.model field left at None keeps the preset's value, a value replaces it (e.g. --config.model.n_layers=4).
vocab_size comes from the data and max_seq_len from seq_len unless set here.
"""

from ml_collections import config_dict

placeholder = config_dict.placeholder


def get_config() -> config_dict.ConfigDict:
    config = config_dict.ConfigDict()
    config.task = "lm"
    config.model = config_dict.ConfigDict({
        "size": "tiny",
        "vocab_size": placeholder(int), "dim": placeholder(int), "n_layers": placeholder(int),
        "n_heads": placeholder(int), "n_kv_heads": placeholder(int), "ffn_dim": placeholder(int),
        "max_seq_len": placeholder(int), "tie_embeddings": placeholder(bool), "rope_theta": placeholder(float),
        "norm_eps": placeholder(float), "compute_dtype": placeholder(str), "param_dtype": placeholder(str),
        "remat": placeholder(bool), "attention": placeholder(str),
    })
    # Quantization: a name from qjax.RECIPES; layers matching keep_high_precision (None: the model's default,
    # the LM head) or narrower than min_features (None: 0) stay in bf16.
    config.recipe = "bf16"
    config.keep_high_precision = placeholder(tuple)
    config.min_features = placeholder(int)

    config.data = config_dict.ConfigDict({"kind": "tokens", "path": "data/shakespeare"})
    config.batch_size = 16  # sequences per optimizer step (all micro-batches together)
    config.seq_len = 128
    config.steps = 300
    config.grad_accum_steps = 1

    config.optimizer = config_dict.ConfigDict({
        "name": "adamw",  # or adamw_8bit, adamw_4bit, adamw_fp8 (qjax.optim low-bit states)
        "lr": 2e-3, "warmup_steps": placeholder(int),  # None: min(30, steps // 10)
        "min_lr_ratio": 0.1,
        "b1": 0.9, "b2": 0.95, "eps": 1e-8, "weight_decay": 0.1, "grad_clip": 1.0,
        # dynamic_range_expansion: adamw_fp8 only (COAT). stochastic_rounding: update bfloat16 params
        # (--config.model.param_dtype=bfloat16) with stochastic rounding, no float32 master copy.
        "dynamic_range_expansion": False, "stochastic_rounding": False,
    })

    config.log_every = 25
    config.eval_every = 100  # 0: no eval
    config.eval_batches = 4
    config.checkpoint_every = 100  # 0: only at the end
    config.keep_checkpoints = 3
    config.seed = 0
    return config
