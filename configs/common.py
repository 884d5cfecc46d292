"""Fields every training config shares: the optimizer, the device mesh and the loop's cadence (llama_base.py and
vit_base.py add them with their own defaults). One field per line, its trailing comment the one-line doc `train.py --show_config` prints."""

from ml_collections import config_dict


def add_optimizer_and_loop(config: config_dict.ConfigDict, *, lr: float, b2: float, weight_decay: float,
                           eval_batches: int) -> config_dict.ConfigDict:
    """Adds `config.optimizer`, `config.mesh` and the logging / eval / checkpoint cadence to `config`; returns it."""
    config.optimizer = config_dict.ConfigDict({
        "name": "adamw",  # adamw (fp32 states), adamw_8bit, adamw_4bit or adamw_fp8 (qjax.optim low-bit states)
        "lr": lr,  # peak learning rate (linear warmup, then cosine decay)
        "warmup_steps": config_dict.placeholder(int),  # None: min(30, steps // 10)
        "min_lr_ratio": 0.1,  # final learning rate as a fraction of lr
        "b1": 0.9,  # Adam first-moment decay
        "b2": b2,  # Adam second-moment decay
        "eps": 1e-8,  # Adam epsilon
        "weight_decay": weight_decay,  # decoupled (AdamW) weight decay
        "grad_clip": 1.0,  # clip the global gradient norm to this
        "dynamic_range_expansion": False,  # adamw_fp8 only: COAT's dynamic range expansion of the states
        "stochastic_rounding": False,  # bfloat16 params (model.param_dtype) updated with SR, no fp32 master copy
    })

    config.mesh = config_dict.ConfigDict({
        "data": -1,  # data-parallel devices (-1: the devices the others leave; 1 if fsdp or tensor is -1)
        "fsdp": 1,  # devices params, gradients and optimizer states are split over (the batch too)
        "tensor": 1,  # tensor-parallel devices: attention heads and the FFN split (Megatron)
        "gather_8bit": True,  # quantized layers gather FSDP-split weights as 8-bit codes (False: whole float weights)
    })

    config.log_every = 25  # steps between progress lines
    config.eval_every = 100  # steps between evals (0: no eval)
    config.eval_batches = eval_batches  # batches per eval
    config.checkpoint_every = 100  # steps between checkpoints (0: only at the end)
    config.keep_checkpoints = 3  # newest checkpoints kept
    config.seed = 0  # seed of init, data order and stochastic rounding
    config.health_every = 0  # steps between quantization health stats of every quantized GEMM operand (0: off)
    config.health_saturation_warn = 0.05  # warn when an operand's share of codes at the format's max exceeds this
    config.health_amax_growth_warn = 32.0  # warn when x or w amax grows past this many times its first measurement
    return config
