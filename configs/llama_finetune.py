"""Full fine-tune of a Hugging Face Llama on prompt/answer pairs with int8_rowwise GEMMs (see llama_base.py for all
fields):

  python train.py --config configs/llama_finetune.py --config.init_from=path/to/hf_model_dir \
      --config.data.path=examples/pairs.jsonl --config.data.tokenizer=path/to/hf_model_dir/tokenizer.json \
      --config.data.eos_token=2

examples/pairs.jsonl holds a few dozen byte-level pairs (the byte tokenizer is the default). seq_len is 128 tokens,
the context of the smallest checkpoints; raise it (--config.seq_len=) for longer examples on a longer-context model.

The loss counts the answer tokens only (`qjax.data.instruct`); the model's shape and first weights come from
`init_from`; a fine-tuned checkpoint goes back to the Hugging Face format with `qjax.models.save_hf_llama`.
"""

from configs import llama_base


def get_config():
    config = llama_base.get_config()
    config.recipe = "int8_rowwise"
    config.data.kind = "instruct"
    config.data.path = "data/instruct.jsonl"
    config.batch_size, config.seq_len, config.steps = 8, 128, 300  # seq_len: fits a checkpoint of max_seq_len 128
    config.optimizer.lr = 2e-5
    config.optimizer.weight_decay = 0.0
    config.optimizer.warmup_steps = 20
    config.log_every, config.eval_every = 10, 50
    return config
