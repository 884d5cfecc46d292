"""Instruction-tuning batches from a local JSONL file of prompt/answer pairs, with a loss mask on the answers.

  {"prompt": "What is 2 + 3?", "answer": "5"}            one JSON object per line

  ds = InstructDataset("pairs.jsonl", batch_size=8, seq_len=256, seed=0, tokenizer="byte")
  b = ds.batch(step)   # {"inputs", "targets": int32 (8, 256), "loss_mask": float32 (8, 256)}, pure in (seed, step)

An example is the tokens prompt + answer + end token, cut to seq_len + 1 tokens and padded after that with the end
token; inputs = tokens[:-1], targets = tokens[1:] and loss_mask[t] = 1 exactly where targets[t] is an answer token
or the end token that closes the answer (padding and prompt positions are 0), so the loss counts answers only. An
epoch visits every training example once, in an order seeded by (seed, epoch). The last 5% of the lines (at least
one) are held out for `eval_batches`. Tokenizer: "byte" (UTF-8 bytes, vocab 256, end token 0) or the path of a
tokenizer.json (e.g. a Hugging Face model's, read with the `tokenizers` package; its end token: `eos_token`).
"""

import json
import pathlib

import numpy as np

from qjax.data import order, text

VAL_FRACTION = 0.05


def load_examples(path) -> list[tuple[str, str]]:
    """[(prompt, answer)] of a JSONL file; ValueError naming the line for anything else."""
    path = pathlib.Path(path)
    if not path.is_file():
        raise FileNotFoundError(f"instruction data {path} does not exist (a JSONL file of "
                                '{"prompt": ..., "answer": ...} lines)')
    examples = []
    for number, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path}:{number} is not JSON ({e.msg})") from None
        if not (isinstance(record, dict) and isinstance(record.get("prompt"), str)
                and isinstance(record.get("answer"), str)):
            raise ValueError(f'{path}:{number} needs string fields "prompt" and "answer"')
        examples.append((record["prompt"], record["answer"]))
    if len(examples) < 2:
        raise ValueError(f"{path} holds {len(examples)} examples; instruction data needs at least 2 (train and eval)")
    return examples


def make_tokenizer(tokenizer: str):
    """"byte" -> `text.ByteTokenizer`; a tokenizer.json path -> `text.BPETokenizer` (needs `tokenizers`)."""
    if tokenizer == "byte":
        return text.ByteTokenizer()
    if not pathlib.Path(tokenizer).is_file():
        raise FileNotFoundError(f'tokenizer {tokenizer!r} is neither "byte" nor a tokenizer.json file')
    return text.BPETokenizer(tokenizer)


def encode_example(tokenizer, prompt: str, answer: str, seq_len: int, eos: int) -> tuple[np.ndarray, np.ndarray]:
    """(tokens int32 (seq_len + 1,), loss_mask float32 (seq_len,)) of one pair (module docstring)."""
    p = np.asarray(tokenizer.encode(prompt), np.int32)
    a = np.concatenate([np.asarray(tokenizer.encode(answer), np.int32), [eos]]).astype(np.int32)
    tokens = np.full(seq_len + 1, eos, np.int32)
    is_answer = np.zeros(seq_len + 1, bool)
    both = np.concatenate([p, a])[:seq_len + 1]
    tokens[:both.size] = both
    is_answer[p.size:both.size] = True
    return tokens, is_answer[1:].astype(np.float32)  # the mask of target t is that of token t + 1


class InstructDataset:
    """Random-access batches of prompt/answer examples (module docstring).

    Args:
      path: the JSONL file. batch_size, seq_len: B and T. seed: seeds the example order.
      tokenizer: "byte" or a tokenizer.json path. eos_token: the end token id (default: the tokenizer's
        separator; required for a tokenizer.json that has none).

    Attributes:
      vocab_size, tokenizer, eos_token, num_train_examples, num_val_examples.
    """

    def __init__(self, path, *, batch_size: int, seq_len: int, seed: int, tokenizer: str = "byte",
                 eos_token: int | None = None):
        self.batch_size = order.check_int(batch_size, "batch_size", minimum=1)
        self.seq_len = order.check_int(seq_len, "seq_len", minimum=1)
        self.tokenizer = make_tokenizer(tokenizer)
        self.vocab_size = self.tokenizer.vocab_size
        self.eos_token = self.tokenizer.separator_id if eos_token is None else eos_token
        if self.eos_token is None or not 0 <= self.eos_token < self.vocab_size:
            raise ValueError(f"instruction data needs an end token id in [0, {self.vocab_size}): set "
                             f"config.data.eos_token (got {self.eos_token!r})")
        examples = load_examples(path)
        num_val = max(1, round(len(examples) * VAL_FRACTION))
        encoded = [encode_example(self.tokenizer, p, a, self.seq_len, self.eos_token) for p, a in examples]
        self._tokens = np.stack([t for t, _ in encoded])
        self._mask = np.stack([m for _, m in encoded])
        self.num_train_examples, self.num_val_examples = len(examples) - num_val, num_val
        self._order = order.EpochOrder(self.num_train_examples, self.batch_size, seed)

    def _batch(self, indices: np.ndarray) -> dict:
        tokens = self._tokens[indices]
        return {"inputs": tokens[:, :-1], "targets": tokens[:, 1:], "loss_mask": self._mask[indices]}

    def batch(self, step: int) -> dict:
        """Training batch `step`: inputs, targets int32 (B, T) and loss_mask float32 (B, T)."""
        return self._batch(self._order.indices(step))

    def eval_batches(self, num_batches: int) -> list[dict]:
        """`num_batches` batches of the held-out examples, in order (cycling when there are fewer than needed)."""
        num_batches = order.check_int(num_batches, "num_batches", minimum=1)
        positions = np.arange(num_batches * self.batch_size) % self.num_val_examples + self.num_train_examples
        return [self._batch(chunk) for chunk in positions.reshape(num_batches, self.batch_size)]
