"""The torch peer of benchmarks/memory.py: Hugging Face LlamaForCausalLM trained the way its rows train qjax's Llama.

  python benchmarks/memory_peer.py --dim 4096 --layers 32 --heads 32 --kv-heads 8 --ffn 14336 --vocab 128256 \\
      --rope-theta 500000 --batch 2 --seq 2048 [--memory-limit-gb 80]     # on a GPU (memory.py passes the shape)
  python benchmarks/memory_peer.py --dim 64 --layers 2 --heads 4 --kv-heads 2 --ffn 128 --vocab 256 --seq 64 \\
      --no-compile                                                         # a toy shape on the CPU, seconds

The model: LlamaForCausalLM of the shape given (memory.py passes a qjax preset's), random weights built in bf16
directly on the device (no float32 copy, no host-side init), SDPA attention, LM head untied. Training as memory.py's
rows: gradient checkpointing of every decoder layer (non-reentrant; qjax's `remat`), each decoder layer
torch.compile'd (the layers share one compiled graph), torchao's `AdamW8bit` with `bf16_stochastic_round=True`
(8-bit states, bf16 params rounded stochastically: qjax's bf16 params + SR + adamw_8bit), random tokens.
Measured: tokens/s (--steps steps queued back to back, median of --rounds rounds after --warmup steps) and the peak
of `torch.cuda.max_memory_allocated`. --memory-limit-gb caps torch's caching allocator with
`torch.cuda.set_per_process_memory_fraction`, so a larger GPU runs out where a smaller one would.

The last stdout line is one JSON object: the result, or {"error": ..., "oom": true/false} (memory.py retries a
smaller batch after an out-of-memory error). No jax here: memory.py computes MFU with qjax's FLOPs formula.
"""

import argparse
import json
import os
import sys

from memory import memory_fraction  # this folder's, imported before it leaves sys.path below
from torch_peer import _log, _median_ms, lm_step

# This folder's scripts (kernels.py, memory.py, ...) must not shadow the packages transformers imports.
HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != HERE]


def build_model(args, torch, device):
    """The bf16 LlamaForCausalLM of args' shape, gradient checkpointing on, decoder layers compiled if args.compile."""
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                         rope_theta=args.rope_theta, tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    # transformers 5 moves rope_theta into rope_parameters, 4.x keeps the field: check that it arrived either way.
    theta = (getattr(config, "rope_parameters", None) or {}).get("rope_theta", getattr(config, "rope_theta", None))
    if theta != args.rope_theta:
        raise RuntimeError(f"LlamaConfig took rope_theta {theta}, not {args.rope_theta}")
    torch.manual_seed(0)
    default_dtype = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # init writes bf16 on the device: no float32 copy, no host-side init
    try:
        with device:
            model = LlamaForCausalLM(config)
    finally:
        torch.set_default_dtype(default_dtype)
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    if args.compile:
        for layer in model.model.layers:
            layer.compile()  # in place, inside the checkpoint wrapper: the recomputation runs the compiled layer
    return model


def train(args, torch, device) -> dict:
    """Builds the model and AdamW8bit, times the steps; raises on a non-finite loss."""
    from torchao.optim import AdamW8bit

    model = build_model(args, torch, device)
    n_params = sum(p.numel() for p in model.parameters())
    optimizer = AdamW8bit(model.parameters(), lr=1e-4, weight_decay=0.1, bf16_stochastic_round=True)
    tokens = torch.randint(0, args.vocab, (args.batch, args.seq), device=device,
                           generator=torch.Generator(device=device).manual_seed(0))
    losses = []
    step = lm_step(model, optimizer, tokens, losses)
    ms = _median_ms(step, torch, device, args.warmup, args.rounds, inner=args.steps)
    first, last = losses[0].item(), losses[-1].item()
    if not (first == first and last == last) or last > first + 1.0:  # NaN, or training diverged
        raise RuntimeError(f"loss went from {first} to {last}")
    states = {type(s).__name__ for state in optimizer.state.values() for s in state.values()}
    cuda = device.type == "cuda"
    return dict(params=n_params, step_ms=ms, tokens_per_s=args.batch * args.seq / ms * 1e3, loss_first=first,
                loss_last=last, state_types=sorted(states),  # OptimState8bit: the 8-bit states are in use
                peak_gb=torch.cuda.max_memory_allocated(device) / 1e9 if cuda else None,
                reserved_gb=torch.cuda.max_memory_reserved(device) / 1e9 if cuda else None)


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    for name in ("dim", "layers", "heads", "kv_heads", "ffn", "vocab", "seq"):
        parser.add_argument("--" + name.replace("_", "-"), type=int, required=True)
    parser.add_argument("--rope-theta", type=float, default=10000.0)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--steps", type=int, default=3, help="steps queued back to back per timed round")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--warmup", type=int, default=1)
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile each decoder layer (--no-compile where no C++ compiler is present)")
    parser.add_argument("--memory-limit-gb", type=float, help="cap on the GPU memory torch may take (default none)")
    return parser.parse_args(argv)


def main():
    args = parse_args()
    out = dict(batch=args.batch, seq=args.seq, compile=args.compile)
    try:
        import torch
        import torchao
    except ImportError as e:
        print(json.dumps(dict(out, error=f"{e}; the torch peer needs torch and torchao (0.17)", oom=False)))
        sys.exit(2)
    # an indexed device: set_per_process_memory_fraction refused a bare "cuda" (torch 2.11)
    device = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    out.update(torch=torch.__version__, torchao=torchao.__version__,
               device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")
    try:
        if args.memory_limit_gb is not None:
            if device.type != "cuda":
                raise ValueError("--memory-limit-gb needs a CUDA GPU")
            total = torch.cuda.get_device_properties(device).total_memory
            torch.cuda.set_per_process_memory_fraction(memory_fraction(args.memory_limit_gb, total), device)
            out["limit_gb"] = args.memory_limit_gb
        elif device.type == "cuda":
            out["limit_gb"] = torch.cuda.get_device_properties(device).total_memory / 1e9
        _log(f"torch peer on {out['device']}: torch {torch.__version__}, torchao {torchao.__version__}, "
             f"batch {args.batch} x {args.seq}, compile={args.compile}, memory limit {args.memory_limit_gb} GB")
        out.update(train(args, torch, device))
    except torch.OutOfMemoryError as e:
        out.update(error=f"OutOfMemoryError: {str(e).splitlines()[0]}"[:300], oom=True)
    except Exception as e:  # reported in memory.py's table rather than lost in a traceback
        out.update(error=f"{type(e).__name__}: {e}"[:500], oom=False)
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    main()
