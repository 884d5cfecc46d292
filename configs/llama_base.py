"""Shared defaults of the Llama (language model) configs: a tiny Llama on Shakespeare bytes, a few minutes on a CPU.

  python -m qjax.data.prepare shakespeare --out data/shakespeare     # once
  python train.py --config configs/llama_int8.py                     # workdir runs/llama_int8
  python train.py --config configs/llama_int8.py --config.model.size=1b --config.seq_len=2048 \
      --config.batch_size=8 --config.optimizer.lr=3e-4                # the ~1B model, on a GPU

Model: the `config.model.size` preset of `qjax.models.LLAMA_SIZES` ("tiny", "125m", "350m", "1b", "8b"); any other
config.model field left at None keeps the preset's value, a value replaces it (e.g. --config.model.n_layers=4).
vocab_size comes from the data (a larger one pads it, a smaller one is an error) and max_seq_len from seq_len
unless set here. With `init_from` (a Hugging Face
Llama directory, `qjax.models.load_hf_llama`) the model's shape and initial weights come from that checkpoint, and
only config.model's numerics fields (compute_dtype, param_dtype, remat, attention) apply; configs/llama_finetune.py.
With `model.convert` ("package.module:factory") the run trains your own plain Flax model, factory(LlamaConfig),
converted by `qjax.quantize_model` per recipe, keep_high_precision and min_features (qjax.train.task's docstring
says what the model must look like; docs/quantize_model.md shows one).
"""

from ml_collections import config_dict

from configs import common

placeholder = config_dict.placeholder


def get_config() -> config_dict.ConfigDict:
    # One field per line, its trailing comment the one-line doc `train.py --show_config` prints.
    config = config_dict.ConfigDict()
    config.task = "lm"  # "lm" (next-token prediction) or "image" (classification)
    config.model = config_dict.ConfigDict({
        "size": "tiny",  # a qjax.models.LLAMA_SIZES preset: tiny, 125m, 350m, 1b, 8b; the fields below replace it
        "vocab_size": placeholder(int),  # None: the data tokenizer's; a larger value pads the embedding
        "dim": placeholder(int),  # width of the residual stream (None: the preset's)
        "n_layers": placeholder(int),  # transformer blocks (None: the preset's)
        "n_heads": placeholder(int),  # query heads; head_dim = dim // n_heads must be even (None: the preset's)
        "n_kv_heads": placeholder(int),  # key/value heads, divides n_heads (grouped-query attention)
        "ffn_dim": placeholder(int),  # SwiGLU hidden width (None: the preset's)
        "max_seq_len": placeholder(int),  # longest sequence the model takes (None: seq_len)
        "tie_embeddings": placeholder(bool),  # LM head reuses the embedding table (None: the preset's, False)
        "rope_theta": placeholder(float),  # RoPE base (None: 10000)
        "norm_eps": placeholder(float),  # RMSNorm epsilon (None: 1e-5)
        "compute_dtype": placeholder(str),  # dtype of activations: float32, bfloat16, float16 (None: bfloat16)
        "param_dtype": placeholder(str),  # float32, bfloat16, or int8: weight-only int8 kernels, SR updates (None: f32)
        "remat": placeholder(bool),  # recompute each block in the backward pass: less activation memory
        "recompute_attention": placeholder(bool),  # recompute norm, qkv, RoPE, attention in the backward (None: no)
        "attention": placeholder(str),  # auto (cuDNN flash attention on GPU where it applies), xla or cudnn
        "smooth_swiglu": placeholder(bool),  # Smooth-SwiGLU outlier guard before down_proj's quantization (None: off)
        "convert": placeholder(str),  # "pkg.module:factory": your plain Flax Llama, run through qjax.quantize_model
    })
    config.recipe = "bf16"  # how GEMMs are quantized: a name from qjax.RECIPES, e.g. int8_rowwise, fp8_tensorwise
    config.keep_high_precision = placeholder(tuple)  # regexes of layer names kept in bf16 (None: ('lm_head',))
    config.min_features = placeholder(int)  # layers narrower than this stay in bf16 (None: 0)

    config.init_from = placeholder(str)  # Hugging Face Llama dir whose weights and shape start the run (None: random)
    config.data = config_dict.ConfigDict({
        "kind": "tokens",  # tokens: shards made by `python -m qjax.data.prepare`; instruct: prompt/answer JSONL
        "path": "data/shakespeare",  # tokens: directory with train.bin, val.bin, meta.json; instruct: the .jsonl
        "tokenizer": placeholder(str),  # instruct: "byte" or a tokenizer.json path (None: "byte")
        "eos_token": placeholder(int),  # instruct: end token id (None: the tokenizer's separator)
    })
    config.batch_size = 16  # sequences per optimizer step (all micro-batches together)
    config.seq_len = 128  # tokens per sequence
    config.steps = 300  # optimizer steps of the run (the LR schedule ends here)
    config.grad_accum_steps = 1  # micro-batches per step (batch_size / grad_accum_steps sequences each)

    return common.add_optimizer_and_loop(config, lr=2e-3, b2=0.95, weight_decay=0.1, eval_batches=4)
