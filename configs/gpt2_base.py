"""Shared defaults of the GPT-2 configs: a tiny GPT-2 (nanoGPT's shape) on Shakespeare bytes, a few minutes on a CPU.

  python -m qjax.data.prepare shakespeare --out data/shakespeare     # once
  python train.py --config configs/gpt2_int8_dataflow.py             # workdir runs/gpt2_int8_dataflow
  python train.py --config configs/gpt2_base.py --config.model.size=gpt2 --config.seq_len=1024 \
      --config.batch_size=32 --config.optimizer.lr=6e-4                # GPT-2 small (124M), on a GPU

Everything but the model is llama_base.py's (data, batch, schedule, optimizer, mesh, cadence); init_from is not
offered (it loads Hugging Face Llama checkpoints). Model: the `config.model.size` preset of
`qjax.models.GPT2_SIZES` ("tiny", "gpt2"); a config.model field left at None keeps the preset's value. vocab_size
comes from the data and max_seq_len (the learned position table's rows) from seq_len unless set here.
"""

from ml_collections import config_dict

from configs import llama_base

placeholder = config_dict.placeholder


def get_config() -> config_dict.ConfigDict:
    # One field per line, its trailing comment the one-line doc `train.py --show_config` prints.
    config = llama_base.get_config()
    config.model = config_dict.ConfigDict({
        "arch": "gpt2",  # model family of an lm task: gpt2 (qjax.models.GPT2) or llama (the default without it)
        "size": "tiny",  # preset of qjax.models.GPT2_SIZES: tiny, gpt2 (124M); the fields below replace its values
        "vocab_size": placeholder(int),  # None: from the data
        "dim": placeholder(int),  # width of the residual stream (None: the preset's)
        "n_layers": placeholder(int),  # transformer blocks (None: the preset's)
        "n_heads": placeholder(int),  # attention heads, divide dim (None: the preset's)
        "mlp_dim": placeholder(int),  # GELU MLP hidden width (None: the preset's, 4 * dim)
        "max_seq_len": placeholder(int),  # rows of the learned position table (None: seq_len)
        "norm_eps": placeholder(float),  # LayerNorm epsilon (None: 1e-5)
        "compute_dtype": placeholder(str),  # dtype of activations: float32, bfloat16, float16 (None: bfloat16)
        "param_dtype": placeholder(str),  # float32, bfloat16, or int8: weight-only int8 kernels, SR updates (None: f32)
        "remat": placeholder(bool),  # recompute each block in the backward pass: less activation memory
        "attention": placeholder(str),  # auto (cuDNN flash attention on GPU where it applies), xla or cudnn
    })
    del config.init_from
    return config
