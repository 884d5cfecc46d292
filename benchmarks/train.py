"""End-to-end Llama training throughput per recipe vs bf16 (the seed's table), and the torch peer on the same GPU.

  python benchmarks/train.py                                # ~1.1B Llama (TinyLlama shape), batch 8 x 2048
  python benchmarks/train.py --rows bf16 int8_rowwise --steps 5 --no-peer
  python benchmarks/train.py --small                        # tiny model; the default when no GPU is present
  python benchmarks/train.py --rows bf16 int8_rowwise --layers 4 --moe 64,8,0,1408 --no-peer   # a MoE Llama

One row = one jitted train step of `qjax.train.make_train_step` (forward, backward, grad clipping, AdamW; the LM
head in bf16 as in every qjax config) on random tokens, timed as --steps steps queued back to back (the throughput a
training loop sees; rounds of them, median) and as steps each waited for. Each row runs in its own subprocess so
that its peak device memory is its own (JAX cannot reset the allocator's peak) and nothing compiled for one row stays
resident during the next.

Rows (--rows): bf16; int8 fwd only; int8 fwd+dgrad; int8_rowwise (all three GEMMs); the last two with stochastic
rounding of the gradient operand (`qjax.with_stochastic_gradients`; forward-only int8 has no gradient operand to
round); fp8_tensorwise; fp8_blockwise; the data-flow recipes fp8_dataflow and int8_dataflow, and
int8_dataflow_recompute (int8_dataflow with `Recipe.recompute_prologue_output`; int8_dataflow_recompute_w also with
`Recipe.recompute_weight_codes`); bitnet_b158 (ternary forward weights, int8_rowwise backward); fp8_rowwise;
int8_rowwise with int8 weight-only params (`model.param_dtype=int8`: int8 kernels + per-channel scales, SR updates,
the forward reading the stored codes) and with bf16 params + SR, the two ways without a float32 master copy (their
peak memory beside the float32 rows'); and "<recipe>@xla" rows that force the XLA path (no Pallas kernels) to show
what the kernels buy. Options follow a row as ":name" suffixes: ":recompute_attention"
(`config.model.recompute_attention`), ":smooth_swiglu" (`config.model.smooth_swiglu`), ":lm_head_8bit"
(`config.keep_high_precision=()`: the LM head under the row's recipe). A row may then name an optimizer after "+"
("int8_rowwise+adamw_fp8": e4m3 AdamW states through the fused step kernel); without one it is optax AdamW with
fp32 states. Then, unless --no-peer, Hugging Face LlamaForCausalLM of the same shape under torch.compile (bf16,
torchao float8 tensorwise / rowwise, int8 mixed precision) in a subprocess (benchmarks/torch_peer.py).
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # rows and the torch peer run in subprocesses

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import time  # noqa: E402

ROWS = ("bf16", "int8_fwd", "int8_fwd_dgrad", "int8_rowwise", "int8_fwd_dgrad_sr", "int8_rowwise_sr",
        "fp8_tensorwise", "fp8_blockwise", "bitnet_b158", "int8_rowwise_int8_params", "int8_rowwise_bf16_params_sr",
        "int8_rowwise@xla", "fp8_tensorwise@xla", "fp8_dataflow", "int8_dataflow", "fp8_rowwise",
        "int8_dataflow_recompute", "int8_dataflow_recompute_w", "int8_dataflow_sr")
# Rows whose params are not float32: row -> (config.model.param_dtype, config.optimizer.stochastic_rounding); their
# recipe is int8_rowwise.
PARAM_ROWS = {"int8_rowwise_int8_params": ("int8", False), "int8_rowwise_bf16_params_sr": ("bfloat16", True)}
DEFAULT_ROWS = ("bf16", "int8_fwd", "int8_fwd_dgrad", "int8_rowwise", "int8_rowwise_sr", "fp8_tensorwise",
                "fp8_blockwise", "int8_rowwise@xla")
PEER_VARIANTS = ("bf16", "float8_tensorwise", "float8_rowwise", "int8_mixed_precision")
ROUNDS = 3  # throughput: median over this many rounds of --steps steps queued back to back


def _split_row(row: str) -> tuple[str, tuple[str, ...], str]:
    """"name:option:option+optimizer" -> (name, options, optimizer or "")."""
    from common import split_options

    recipe_row, _, optimizer = row.partition("+")
    return *split_options(recipe_row), optimizer


def row_name(row: str) -> str:
    """argparse type of a row: one of ROWS, then any of common.MODEL_OPTIONS as ":option" suffixes, then optionally
    "+<optimizer>" (one of qjax.train.OPTIMIZERS)."""
    from common import MODEL_OPTIONS
    from qjax.train import OPTIMIZERS

    try:
        name, _, optimizer = _split_row(row)
    except ValueError:
        name, optimizer = "", ""
    if name not in ROWS or ("+" in row and optimizer not in OPTIMIZERS):
        raise argparse.ArgumentTypeError(f"unknown row {row!r}: use one of {', '.join(ROWS)}, optionally followed by "
                                         f"any of :{', :'.join(MODEL_OPTIONS)}, then optionally by + and one of "
                                         f"{', '.join(OPTIMIZERS)}")
    return row


def _recipe_row(row: str) -> str:
    """The row's ROWS entry: without "+optimizer" and ":options"."""
    return _split_row(row)[0]


def row_optimizer(row: str) -> str:
    return row.partition("+")[2] or "adamw"


def row_recipe(row: str):
    """The qjax.Recipe a row name stands for ("name@xla": that recipe with backend "xla"; "+optimizer" ignored)."""
    from common import recipe_variant

    name, _, backend = _recipe_row(row).partition("@")
    recipe = recipe_variant("int8_rowwise" if name in PARAM_ROWS else name)
    return dataclasses.replace(recipe, backend=backend) if backend else recipe


def build_row(row: str, args):
    """(train_state, train_step, batch, task) for one row: the model per --size, random tokens (batch, seq)."""
    import numpy as np

    from common import apply_options, llama_config, random_lm_batch
    from qjax.train import make_task, make_train_step

    config = llama_config(args.size)
    if args.layers:
        config.model.n_layers = args.layers
    if args.moe:
        n_experts, top_k, n_shared, expert_ffn_dim = args.moe
        config.model.moe = dict(n_experts=n_experts, top_k=top_k, n_shared_experts=n_shared,
                                expert_ffn_dim=expert_ffn_dim, aux_loss_weight=0.01)
    config.model.remat = args.remat
    apply_options(config, _split_row(row)[1])
    config.min_features = args.min_features
    del config.recipe  # the config file's field is a recipe name; rows need Recipe objects (variants, backend)
    config.recipe = row_recipe(row)
    config.optimizer.name = row_optimizer(row)
    param_dtype, sr = PARAM_ROWS.get(_recipe_row(row).partition("@")[0], (None, False))
    config.model.param_dtype, config.optimizer.stochastic_rounding = param_dtype, sr
    config.seq_len, config.batch_size = args.seq, args.batch
    config.steps = 1000  # the LR schedule's length; irrelevant to the timing
    task = make_task(config)
    init_state, train_step = make_train_step(config, task)
    batch = random_lm_batch(np.random.default_rng(0), task.model_config.vocab_size, args.batch, args.seq)
    return init_state(), train_step, batch, task


def measure_row(row: str, args) -> dict:
    """Runs in the child process: tokens/s, step ms, peak memory, MFU and the loss over the timed steps."""
    import jax
    import numpy as np

    from common import time_ms
    from qjax.train import peak_flops

    state, train_step, batch, task = build_row(row, args)
    losses = []

    def step(state):
        state, metrics = train_step(state, batch)
        losses.append(metrics["loss"])
        return state

    holder = [state]

    def run_one():  # the state is donated: thread it through; wait on the loss (never donated)
        holder[0] = step(holder[0])
        return losses[-1]

    # Throughput as train.py's loop sees it (steps queued back to back, one wait per --steps steps), and with a wait
    # after every step (adds the host's dispatch latency: ~8 ms for int8_rowwise on an H100; what this benchmark
    # reported before 2026-11-23).
    ms = time_ms(run_one, (), warmup=args.warmup, reps=ROUNDS, inner=args.steps)
    synced_ms = time_ms(run_one, (), warmup=0, reps=args.steps)
    losses = [float(x) for x in losses]
    if not all(np.isfinite(losses)):
        raise RuntimeError(f"non-finite loss: {losses}")
    device = jax.devices()[0]
    stats = device.memory_stats() or {}
    tokens_per_s = args.batch * args.seq / ms * 1e3
    peak = peak_flops(device)
    return dict(row=row, tokens_per_s=tokens_per_s, step_ms=ms, synced_step_ms=synced_ms, loss_first=losses[0],
                loss_last=losses[-1],
                peak_mem_gb=stats["peak_bytes_in_use"] / 1e9 if "peak_bytes_in_use" in stats else None,
                mfu=tokens_per_s * task.flops_per_unit / peak if peak else None, device=device.device_kind)


def run_row_subprocess(row: str, args) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", row, "--size", args.size, "--batch",
            str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup)]
    argv += ["--remat"] if args.remat else []
    argv += ["--min-features", str(args.min_features)]
    argv += ["--layers", str(args.layers)] if args.layers else []
    argv += ["--moe", ",".join(map(str, args.moe))] if args.moe else []
    print(f"{row}: running...", flush=True)
    start = time.perf_counter()
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, cwd=os.path.dirname(os.path.abspath(__file__)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"row": row, "error": f"exited {proc.returncode}, no result"}
    if "error" in result:
        print(f"{row}: FAILED {result['error']}", flush=True)
    else:
        print(f"{row}: {result['tokens_per_s']:,.0f} tok/s, {result['step_ms']:.1f} ms/step, loss "
              f"{result['loss_first']:.3f} -> {result['loss_last']:.3f} ({time.perf_counter() - start:.0f} s with "
              "compilation)", flush=True)
    return result


def table(results: list[dict], peer: dict, args) -> str:
    base = next((r for r in results if r["row"] == "bf16" and "error" not in r), None)
    lines = ["| row | recipe | optimizer | tokens/s | vs qjax bf16 | step ms | synced step ms | peak GB | MFU |",
             "|---|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        if "error" in r:
            lines.append(f"| {r['row']} | failed: {r['error'][:120]} | | | | | | | |")
            continue
        speedup = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "–"
        peak = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") else "–"
        mfu = f"{r['mfu']:.2f}" if r.get("mfu") else "–"
        lines.append(f"| {r['row']} | {row_recipe(r['row']).name} | {row_optimizer(r['row'])} | "
                     f"{r['tokens_per_s']:,.0f} | {speedup} | {r['step_ms']:.1f} | {r['synced_step_ms']:.1f} | "
                     f"{peak} | {mfu} |")
    optimizers = {row_optimizer(r["row"]) for r in results}
    about = {"adamw": "adamw: optax, fp32 states", "adamw_fp8": "adamw_fp8: e4m3 states, fused step kernel on one "
             "Hopper GPU", "adamw_8bit": "adamw_8bit: 8-bit states, fused step kernel on one Hopper GPU",
             "adamw_4bit": "adamw_4bit: 4-bit states"}
    shape = (f", {args.layers} layers" if args.layers else "") + (
        ", MoE: {} experts, top {}, {} shared, expert FFN {}".format(*args.moe) if args.moe else "")
    notes = [f"Llama {args.size}{shape} (batch {args.batch} x seq {args.seq}, remat={args.remat}, min_features="
             f"{args.min_features}), random tokens, AdamW ({'; '.join(about[o] for o in sorted(optimizers))}), "
             f"LM head in bf16 unless :lm_head_8bit; one subprocess per row. tokens/s and step ms: {args.steps} "
             f"steps queued back to back and one wait (as train.py's loop between log lines), median of {ROUNDS} rounds after {args.warmup} "
             f"warm-up steps; synced step ms: median of {args.steps} steps each waited for (adds host dispatch "
             "latency). The torch peer is timed the same two ways."]
    if peer.get("results"):
        torch_bf16 = peer["results"].get("bf16", {}).get("tokens_per_s")
        lines += ["", "| torch peer (HF LlamaForCausalLM, torch.compile) | tokens/s | vs torch bf16 | vs qjax bf16 | "
                  "step ms | synced step ms | peak GB |", "|---|---:|---:|---:|---:|---:|---:|"]
        for variant, r in peer["results"].items():
            vs_torch = f"{r['tokens_per_s'] / torch_bf16:.2f}x" if torch_bf16 else "–"
            vs_qjax = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "–"
            peak = f"{r['peak_mem_gb']:.1f}" if r.get("peak_mem_gb") else "–"
            lines.append(f"| {variant} | {r['tokens_per_s']:,.0f} | {vs_torch} | {vs_qjax} | {r['step_ms']:.1f} | "
                         f"{r['synced_step_ms']:.1f} | {peak} |")
        if torch_bf16:
            notes.append("qjax rows against torch bf16 ({:,.0f} tok/s): ".format(torch_bf16) + ", ".join(
                f"{r['row']} {r['tokens_per_s'] / torch_bf16:.2f}x" for r in results if "error" not in r))
        notes.append(f"torch {peer.get('torch')}, torchao {peer.get('torchao')}, torch.compile={peer.get('compile')}.")
        notes += [f"{v}: not run ({why})." for v, why in peer.get("skipped", {}).items()]
    elif peer:
        notes.append(f"torch peer not measured: {peer.get('error')}")
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def _moe_arg(text: str) -> tuple[int, int, int, int]:
    try:
        values = tuple(int(v) for v in text.split(","))
    except ValueError:
        values = ()
    if len(values) != 4:
        raise argparse.ArgumentTypeError(f"--moe {text!r}: give EXPERTS,TOP_K,SHARED,EXPERT_FFN, e.g. 64,8,0,1408")
    return values


def add_model_args(parser):
    """The flags that pick a row's model and batch (shared with benchmarks/profile_train.py)."""
    parser.add_argument("--size", default=None, help="model preset: 1b (default on GPU) or tiny (--small)")
    parser.add_argument("--batch", type=int)
    parser.add_argument("--seq", type=int)
    parser.add_argument("--remat", action="store_true", help="rematerialize each block (less memory, more FLOPs)")
    parser.add_argument("--min-features", type=int, default=0,
                        help="keep projections with fewer features in or out than this in bf16")
    parser.add_argument("--small", action="store_true", help="tiny model, tiny batch (default without a GPU)")
    parser.add_argument("--layers", type=int, help="blocks (default: the preset's)")
    parser.add_argument("--moe", type=_moe_arg, metavar="EXPERTS,TOP_K,SHARED,EXPERT_FFN",
                        help="every block's feed-forward a mixture of experts (qjax.models.MoEConfig), e.g. "
                             "64,8,0,1408")


def resolve_model_args(args) -> bool:
    """Fills --size/--batch/--seq defaults: tiny on CPU or with --small, the 1.1B shape otherwise. Returns small."""
    import jax

    small = args.small or jax.default_backend() != "gpu"
    args.size = args.size or ("tiny" if small else "1b")
    args.batch = args.batch or (2 if small else 8)
    args.seq = args.seq or (64 if small else 2048)
    return small


def parse_args():
    from common import MODEL_OPTIONS

    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", nargs="*", type=row_name, metavar="ROW[:OPTION...][+OPTIMIZER]",
                        help=f"rows: {' '.join(ROWS)}, each optionally followed by options ("
                             + "; ".join(f":{k}: {v}" for k, v in MODEL_OPTIONS.items())
                             + "), then +OPTIMIZER (qjax.train.OPTIMIZERS; default adamw); default "
                             f"rows: {' '.join(DEFAULT_ROWS)}")
    add_model_args(parser)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=True)
    parser.add_argument("--peer-variants", nargs="+", default=list(PEER_VARIANTS), choices=PEER_VARIANTS,
                        help="torch peer variants to run (each compiles for minutes on the 1b model)")
    parser.add_argument("--peer-python", help="interpreter with torch + torchao (default $QJAX_TORCH_PYTHON or this)")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    return parser.parse_args()


def main():
    args = parse_args()
    if args.child:  # one row, in its own process: print its JSON result
        try:
            print(json.dumps(measure_row(args.child, args)), flush=True)
        except Exception as e:  # reported in the table rather than ending the whole benchmark
            print(json.dumps({"row": args.child, "error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)
        return
    import jax

    from common import record_results, device_kind
    from torch_peer import run_torch_peer

    small = resolve_model_args(args)
    if small:
        args.steps, args.warmup = min(args.steps, 3), min(args.warmup, 1)
    rows = args.rows or DEFAULT_ROWS
    print(f"Llama {args.size} train step on {device_kind()}, jax {jax.__version__}: {len(rows)} rows", flush=True)
    results = [run_row_subprocess(row, args) for row in rows]
    peer = {}
    if args.peer:
        shape = dict(dim=2048, layers=22, heads=32, kv_heads=4, ffn=5632, vocab=32000) if args.size == "1b" else {}
        peer = run_torch_peer("llama", python=args.peer_python, batch=args.batch, seq=args.seq, steps=args.steps,
                              warmup=args.warmup, small=small, variants=list(args.peer_variants), **shape)
    report = table(results, peer, args)
    print("\n" + report)
    if not args.no_record:
        record_results(f"Llama {args.size} train step", report)


if __name__ == "__main__":
    main()
