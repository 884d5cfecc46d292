"""The torch peer of benchmarks/scaling.py: Hugging Face LlamaForCausalLM (TinyLlama 1.1B shape) trained with FSDP2
(`fully_shard`) over N GPUs, bf16 vs torchao float8 tensorwise with float8 weight all-gathers.

  python benchmarks/torch_fsdp_peer.py                            # on every GPU: table, recorded
  python benchmarks/torch_fsdp_peer.py --dry-run                  # anywhere, no torch needed: the plan it runs
  python benchmarks/torch_fsdp_peer.py --nproc 2 --cpu --small --no-compile --no-record   # CPU check (gloo)

Each variant runs in its own `python -m torch.distributed.run --nproc_per_node=N` (torchrun), so its peak memory
and compile caches are its own and a failure loses only its row; rank 0 prints one JSON line, which this launcher
(no torch imported) turns into the table. Per rank: the model in bf16 (params, gradients and fused AdamW states,
as benchmarks/torch_peer.py), the LM head in bf16 in every variant; `float8_tensorwise` is
`convert_to_float8_training` with `Float8LinearConfig(enable_fsdp_float8_all_gather=True)` (each weight's shard is
cast to e4m3 and the codes all-gathered) and `precompute_float8_dynamic_scale_for_fsdp` after every optimizer step
(every weight's amax in one all-reduce); then `fully_shard` on each decoder layer and on the root, each decoder
layer `torch.compile`d. The global batch (default 8 x 2048) splits over the ranks; tokens/s is the global rate over
--steps steps queued back to back, median of 3 rounds after --warmup steps; peak GB is the largest
`max_memory_allocated` over the ranks. --cpu: gloo on CPU processes, float8 emulated (a check, not a speed).
NVLink multicast stays off: the launcher sets NCCL_NVLS_ENABLE=0 and its neighbours for every rank.
"""

import argparse
import json
import os
import statistics
import subprocess
import sys
import time

from gpus import NO_MULTICAST, visible_gpus
from torch_peer import lm_step

VARIANTS = ("bf16", "float8_tensorwise")
SHAPE = dict(dim=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000)  # TinyLlama 1.1B, as torch_peer.py
SMALL = dict(dim=128, layers=2, heads=4, kv_heads=2, ffn=256, vocab=512, batch=4, seq=64)
ROUNDS = 3


def _log(msg):
    print(msg, file=sys.stderr, flush=True)


# ------------------------------------------------------------------------------------ one rank (under torchrun)


def build_model(args, variant, torch, device):
    """The bf16 LlamaForCausalLM of `args`' shape, converted per `variant`, sharded with FSDP2 over every rank."""
    from torch.distributed.fsdp import fully_shard
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(vocab_size=args.vocab, hidden_size=args.dim, intermediate_size=args.ffn,
                         num_hidden_layers=args.layers, num_attention_heads=args.heads,
                         num_key_value_heads=args.kv_heads, max_position_embeddings=args.seq,
                         tie_word_embeddings=False, use_cache=False)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)  # every rank builds the same weights; fully_shard keeps its own shard of them
    model = LlamaForCausalLM(config).to(device=device, dtype=torch.bfloat16)
    if variant == "float8_tensorwise":
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training
        float8 = Float8LinearConfig(enable_fsdp_float8_all_gather=True, emulate=device.type != "cuda")
        convert_to_float8_training(model, config=float8, module_filter_fn=lambda module, fqn: fqn != "lm_head")
        converted = sum(type(m).__name__ == "Float8Linear" for m in model.modules())
        if converted != 7 * args.layers:  # q, k, v, o, gate, up, down per layer
            raise RuntimeError(f"torchao converted {converted} linear layers, expected {7 * args.layers}")
    elif variant != "bf16":
        raise ValueError(f"unknown variant {variant!r}; use one of {VARIANTS}")
    for layer in model.model.layers:
        if args.compile:
            layer.compile()  # in place: parameter names unchanged
        fully_shard(layer)
    fully_shard(model)
    if variant == "float8_tensorwise":  # the shards FSDP2 all-gathers are the ones torchao casts to float8 first
        from torchao.float8.fsdp_utils import WeightWithDynamicFloat8CastTensor
        cast = sum(isinstance(getattr(m.weight, "_local_tensor", None), WeightWithDynamicFloat8CastTensor)
                   for m in model.modules() if type(m).__name__ == "Float8Linear")
        if cast != 7 * args.layers:
            raise RuntimeError(f"{cast} sharded weights gather in float8, expected {7 * args.layers}")
    return model


def run_rank(args, variant):
    """Trains `variant` on this rank; rank 0 returns the JSON result, the others None."""
    import torch
    import torch.distributed as dist

    backend = "gloo" if args.cpu else "nccl"
    rank, world = int(os.environ["RANK"]), int(os.environ["WORLD_SIZE"])
    if args.cpu:
        device = torch.device("cpu")
    else:
        device = torch.device("cuda", int(os.environ["LOCAL_RANK"]))
        torch.cuda.set_device(device)
    dist.init_process_group(backend)
    if args.batch % world:
        raise ValueError(f"--batch {args.batch} does not split over {world} ranks")
    if variant == "float8_tensorwise" and not args.cpu and torch.cuda.get_device_capability(device) < (8, 9):
        raise RuntimeError("float8 training needs compute capability >= 8.9 (torch._scaled_mm)")
    model = build_model(args, variant, torch, device)
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4, weight_decay=0.1, fused=device.type == "cuda")
    precompute = None
    if variant == "float8_tensorwise":
        from torchao.float8 import precompute_float8_dynamic_scale_for_fsdp as precompute
    generator = torch.Generator(device=device).manual_seed(rank)  # each rank its own examples
    tokens = torch.randint(0, args.vocab, (args.batch // world, args.seq), device=device, generator=generator)
    losses = []
    # after each step, precompute: the next forward's fp8 weight scales, one all-reduce of every weight's amax
    step = lm_step(model, optimizer, tokens, losses, after=precompute)

    def sync():
        if device.type == "cuda":
            torch.cuda.synchronize(device)
        dist.barrier()

    for _ in range(args.warmup):
        step()
    sync()
    times = []
    for _ in range(ROUNDS):
        start = time.perf_counter()
        for _ in range(args.steps):
            step()
        sync()
        times.append((time.perf_counter() - start) * 1e3 / args.steps)
    ms = statistics.median(times)
    peak = torch.tensor([torch.cuda.max_memory_allocated(device) / 1e9 if device.type == "cuda" else 0.0],
                        device=device)
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    first, last = losses[0].item(), losses[-1].item()
    dist.destroy_process_group()
    if rank:
        return None
    if not (first == first and last == last) or last > first + 1.0:  # NaN, or training diverged
        raise RuntimeError(f"loss went from {first} to {last}")
    return dict(variant=variant, world=world, batch=args.batch, seq=args.seq, step_ms=ms,
                tokens_per_s=args.batch * args.seq / ms * 1e3, peak_gb=peak.item() if device.type == "cuda" else None,
                loss_first=first, loss_last=last, torch=torch.__version__,
                device=torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu")


# ------------------------------------------------------------------------------------- the launcher (no torch)


def child_argv(args, variant) -> list[str]:
    python = os.environ.get("QJAX_TORCH_PYTHON") or sys.executable
    shape = [f"--{k.replace('_', '-')}={getattr(args, k)}" for k in (*SHAPE, "batch", "seq")]
    # No --nproc here: torchrun's own parser takes it for an abbreviation of --nproc-per-node (the ranks read
    # WORLD_SIZE instead).
    flags = shape + [f"--steps={args.steps}", f"--warmup={args.warmup}"] + \
        ["--cpu"] * args.cpu + ["--no-compile"] * (not args.compile)
    return [python, "-m", "torch.distributed.run", "--standalone", f"--nproc_per_node={args.nproc}",
            os.path.abspath(__file__), "--rank-variant", variant, *flags]


def run_variant(args, variant) -> dict:
    env = dict(os.environ, **NO_MULTICAST)
    start = time.perf_counter()
    try:
        proc = subprocess.run(child_argv(args, variant), stdout=subprocess.PIPE, text=True, env=env,
                              timeout=args.timeout)
    except subprocess.TimeoutExpired:
        return dict(variant=variant, error=f"no result within {args.timeout} s")
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else dict(variant=variant, error=f"torchrun exited {proc.returncode}")
    _log(f"{variant}: " + (result.get("error") or f"{result['tokens_per_s']:,.0f} tok/s") +
         f" ({time.perf_counter() - start:.0f} s with start-up and compilation)")
    return result


def table(results: list[dict], args) -> str:
    lines = ["| variant | GPUs | batch x seq (global) | tokens/s | tokens/s per GPU | vs bf16 | step ms | "
             "peak GB per GPU | loss first -> last |", "|---|---:|---|---:|---:|---:|---:|---:|---|"]
    base = next((r for r in results if r["variant"] == "bf16" and "error" not in r), None)
    for r in results:
        if "error" in r:
            lines.append(f"| {r['variant']} | {args.nproc} | | failed: {r['error'][:120]} | | | | | |")
            continue
        speedup = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "–"
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "–"
        lines.append(f"| {r['variant']} | {r['world']} | {r['batch']} x {r['seq']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / r['world']:,.0f} | {speedup} | {r['step_ms']:.1f} | {peak} | "
                     f"{r['loss_first']:.3f} -> {r['loss_last']:.3f} |")
    torch_version = next((r["torch"] for r in results if "torch" in r), "?")
    note = (f"Hugging Face LlamaForCausalLM, dim {args.dim}, {args.layers} layers, {args.heads} heads / "
            f"{args.kv_heads} KV heads, FFN {args.ffn}, vocab {args.vocab}; bf16 params, gradients and fused AdamW "
            "states, FSDP2 fully_shard per decoder layer and root, each decoder layer torch.compile'd"
            f"{'' if args.compile else ' (here: eager)'}, LM head bf16; float8_tensorwise: torchao float8 "
            "tensorwise with float8 all-gather and precomputed scales; random tokens; torch "
            f"{torch_version}; {args.steps} steps queued back to back, median of {ROUNDS} rounds after "
            f"{args.warmup} warm-up steps; one torchrun per variant."
            + (" CPU processes (gloo, float8 emulated): a check that it runs, not a speed." if args.cpu else ""))
    return "\n".join(lines) + "\n\n" + note + "\n"


def parse_args(argv=None):
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--nproc", type=int, default=0, help="ranks per variant (default: every GPU; --cpu: 2)")
    parser.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=VARIANTS)
    for name, default in dict(SHAPE, batch=8, seq=2048).items():
        parser.add_argument("--" + name.replace("_", "-"), type=int, default=default)
    parser.add_argument("--small", action="store_true", help="a toy shape (the CPU check); overrides shape flags")
    parser.add_argument("--cpu", action="store_true", help="gloo on CPU processes, float8 emulated")
    parser.add_argument("--compile", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--timeout", type=int, default=900, help="seconds per variant")
    parser.add_argument("--dry-run", action="store_true", help="print the torchrun commands and the shape; run none")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--rank-variant", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.small:
        for key, value in SMALL.items():
            setattr(args, key, value)
    if args.rank_variant:  # a rank under torchrun
        args.nproc = int(os.environ.get("WORLD_SIZE", 1))
    args.nproc = args.nproc or (2 if args.cpu or args.dry_run else len(visible_gpus()))
    if args.nproc < 1:
        parser.error("no GPU visible (nvidia-smi -L lists none): pass --cpu for the CPU check, or --dry-run")
    if args.batch % args.nproc:
        parser.error(f"--batch {args.batch} must split evenly over --nproc {args.nproc} ranks")
    return args


def main():
    args = parse_args()
    if args.rank_variant:
        # This folder's scripts (kernels.py, generate.py, ...) must not shadow the packages transformers imports.
        here = os.path.dirname(os.path.abspath(__file__))
        sys.path[:] = [p for p in sys.path if os.path.abspath(p or ".") != here]
        try:
            result = run_rank(args, args.rank_variant)
        except Exception as e:
            if os.environ.get("RANK", "0") == "0":  # the launcher tabulates rank 0's JSON line, error or result
                print(json.dumps(dict(variant=args.rank_variant, error=f"{type(e).__name__}: {e}"[:500])), flush=True)
            raise  # a non-zero exit, so that torchrun ends the other ranks rather than leave them in a collective
        if result is not None:
            print(json.dumps(result), flush=True)
        return
    if args.dry_run:
        for variant in args.variants:
            print(" ".join(child_argv(args, variant)))
        print(f"per rank: batch {args.batch // args.nproc} x {args.seq}; shape " +
              ", ".join(f"{k}={getattr(args, k)}" for k in SHAPE))
        return
    results = [run_variant(args, variant) for variant in args.variants]
    report = table(results, args)
    print("\n" + report, flush=True)
    if not args.no_record:
        os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # common.py names the device through jax
        sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
        from common import record_results
        record_results(f"torch FSDP2 peer, Llama {args.dim}d x {args.layers} layers, {args.nproc} GPUs", report)


if __name__ == "__main__":
    main()
