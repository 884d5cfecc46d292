"""Llama train-step throughput and peak memory per device over a (data, fsdp, tensor) mesh: FSDP and tensor
parallelism, bf16 vs the 8-bit recipes, weights all-gathered as 8-bit codes vs in bf16, and the scaling efficiency
against one device.

  python benchmarks/scaling.py --size 1b --rows bf16 int8_rowwise int8_rowwise:bf16 fp8_tensorwise \
      --baselines bf16 int8_rowwise --steps 3 --warmup 1                          # fsdp over every GPU
  python benchmarks/scaling.py --size 1b --meshes fsdp=4,tensor=2 data=2,fsdp=4   # 8 GPUs
  python benchmarks/scaling.py --size 8b --batch 4 --remat --param-dtype bfloat16 --sr --optimizer adamw_8bit \
      --rows bf16 int8_rowwise --steps 3 --warmup 1                               # 8B on 2 x 80 GB
  python benchmarks/scaling.py --size tiny --cpu-devices 2 --baselines bf16       # CPU check, toy size
  python benchmarks/scaling.py --size 1b --rows int8_rowwise --steps 3 --warmup 1 --profile 30   # + GPU 0's time
  python benchmarks/scaling.py --size 1b --xla-flags=--xla_gpu_enable_pipelined_all_gather=true   # with XLA flags

A row (`--rows`, recipe[:gather][:option...]) runs `qjax.train.make_train_step` on random tokens over each mesh of
`--meshes` (default fsdp over all `--devices`), in its own subprocess (its peak memory is its own). Gather "8bit" (the
default; the train step's own) has the quantized layers gather their FSDP-split weights as 8-bit codes + scales
(BitNet's ternary codes packed 2 bits each: the table says "2bit"); "bf16" turns that off
(`config.mesh.gather_8bit=False`: XLA all-gathers the float weights); the bf16 recipe always gathers floats. Options are
benchmarks/common.py's MODEL_OPTIONS (e.g. "int8_rowwise:lm_head_8bit": the LM head in 8 bits too). `--baselines` adds
one-device rows of those recipes at the mesh rows' batch per device (weak scaling): "vs 1 device" is tokens/s per device
over the baseline's tokens/s. Baselines run side by side, one per GPU (CUDA_VISIBLE_DEVICES), since nothing connects
them. tokens/s is the global rate, --steps steps queued back to back, median of 3 rounds; peak GB is the largest
`peak_bytes_in_use` over the devices ("–" where the platform does not report it, e.g. the CPU). Model TFLOP/s per device
is NeMo's count (`nemo_flops_per_token`), beside MFU by qjax's own count. With --profile, GPU 0's time per step by
category is a second table. Rows finished before a SIGTERM (a `timeout`) are still recorded.
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import pathlib  # noqa: E402
import signal  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

from gpus import NO_MULTICAST, visible_gpus  # noqa: E402

RECIPES = ("bf16", "int8_rowwise", "fp8_tensorwise", "fp8_dataflow", "int8_dataflow", "bitnet_b158")
GATHERS = ("8bit", "bf16")
ROUNDS = 3
# NVLink multicast stays off on the shared multi-GPU machines (NCCL and the libraries beside it).


def parse_mesh(text: str) -> dict:
    """"fsdp=4,tensor=2" -> {"data": -1, "fsdp": 4, "tensor": 2} (unnamed axes: data the rest, others 1)."""
    sizes = {"data": -1, "fsdp": 1, "tensor": 1}
    for part in filter(None, text.split(",")):
        name, _, value = part.partition("=")
        if name not in sizes or not value.lstrip("-").isdigit():
            raise argparse.ArgumentTypeError(f"mesh {text!r}: use axis=size pairs of data, fsdp, tensor, e.g. "
                                             "fsdp=4,tensor=2")
        sizes[name] = int(value)
    return sizes


def parse_row(text: str) -> tuple[str, str, tuple[str, ...]]:
    """"int8_rowwise" -> ("int8_rowwise", "8bit", ()); "int8_rowwise:bf16" -> ("int8_rowwise", "bf16", ());
    "int8_rowwise:lm_head_8bit" -> ("int8_rowwise", "8bit", ("lm_head_8bit",)): RECIPE[:GATHER][:OPTION...], the
    options benchmarks/common.py's MODEL_OPTIONS."""
    from common import MODEL_OPTIONS, split_options

    recipe, *rest = text.split(":")
    gather = rest.pop(0) if rest and rest[0] in GATHERS else ""
    try:
        _, options = split_options(":".join([recipe, *rest]))
    except ValueError:
        options = None
    if recipe not in RECIPES or options is None:
        raise argparse.ArgumentTypeError(f"row {text!r}: use RECIPE[:GATHER][:OPTION...], RECIPE one of {RECIPES}, "
                                         f"GATHER one of {GATHERS}, OPTION any of {tuple(MODEL_OPTIONS)}, e.g. "
                                         "int8_rowwise:bf16 or int8_rowwise:lm_head_8bit")
    return recipe, "bf16" if recipe == "bf16" else gather or "8bit", options


def nemo_flops_per_token(config, seq: int) -> float:
    """Model FLOPs per trained token of a Llama by Megatron / NeMo's count: 12 L H^2 (1 + G/A + S/(2H) + 1.5 F/H)
    + 6 H V (the causal attention half counted, the gated MLP as 1.5 GEMMs of F, the LM head); 51.5 GFLOP for
    Llama-3-8B at seq 8192. config: a `LlamaConfig` (dim H, n_layers L, n_heads A, n_kv_heads G, ffn_dim F,
    vocab_size V)."""
    h = config.dim
    per_layer = 1 + config.n_kv_heads / config.n_heads + seq / (2 * h) + 1.5 * config.ffn_dim / h
    return 12 * config.n_layers * h * h * per_layer + 6 * h * config.vocab_size


def measure(args, mesh: dict, recipe: str, gather: str, options: list, batch: int) -> dict:
    """In the child process: one row's tokens/s, step ms, MFU, model TFLOP/s per device (NeMo's count), peak memory
    per device, loss and (--profile) GPU 0's ms per step by category."""
    import jax
    import numpy as np

    from common import REPO, apply_options, random_lm_batch, time_ms
    from profile_train import category_ms, device_events, print_report  # before REPO joins the path

    sys.path.insert(0, str(REPO))
    from configs import llama_base
    from qjax.train import make_task, make_train_step, peak_flops
    from qjax.train.mesh import axis_sizes

    config = llama_base.get_config()
    config.model.size = args.size
    config.model.remat = args.remat
    config.model.param_dtype = args.param_dtype
    config.optimizer.name = args.optimizer
    config.optimizer.stochastic_rounding = args.sr
    config.recipe = recipe
    config.mesh.update(mesh)
    config.mesh.gather_8bit = gather == "8bit"
    apply_options(config, tuple(options))
    config.seq_len, config.batch_size, config.steps = args.seq, batch, 1000
    task = make_task(config)
    init_state, train_step = make_train_step(config, task)
    data = random_lm_batch(np.random.default_rng(0), task.model_config.vocab_size, batch, args.seq)
    holder, losses = [init_state()], []

    def run_one():  # the state is donated: thread it through
        holder[0], metrics = train_step(holder[0], data)
        losses.append(metrics["loss"])
        return metrics["loss"]

    ms = time_ms(run_one, (), warmup=args.warmup, reps=ROUNDS, inner=args.steps)
    profile = None
    if args.profile and gather != "–":  # mesh rows, not the one-device baselines
        trace_dir = tempfile.mkdtemp(prefix="qjax_scaling_profile_")
        with jax.profiler.trace(trace_dir):  # 2 more steps; the report goes to stderr (stdout carries the result)
            jax.block_until_ready([run_one() for _ in range(2)])
        print(f"\nprofile of {recipe} {gather}-gather over {mesh}, GPU 0, per step:", file=sys.stderr)
        events = device_events(pathlib.Path(trace_dir))
        print_report(events, 2, args.profile, file=sys.stderr)
        profile = category_ms(events, 2)
    losses = [float(x) for x in losses]
    if not np.isfinite(losses).all():
        raise RuntimeError(f"non-finite loss: {losses}")
    devices = jax.devices()
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in devices]
    tokens_per_s = batch * args.seq / ms * 1e3
    peak = peak_flops(devices[0])
    return dict(sizes=dict(zip(("data", "fsdp", "tensor"), axis_sizes(len(devices), **mesh))),
                devices=len(devices), batch=batch, step_ms=ms, tokens_per_s=tokens_per_s, loss=losses[-1],
                mfu=tokens_per_s / len(devices) * task.flops_per_unit / peak if peak else None,
                nemo_tflops=tokens_per_s / len(devices) * nemo_flops_per_token(task.model_config, args.seq) / 1e12,
                profile=profile,
                peak_gb=max(peaks) / 1e9 if all(p is not None for p in peaks) else None,
                device=devices[0].device_kind)


def start_row(args, mesh: dict, recipe: str, gather: str, options: tuple, batch: int, devices: list):
    """Starts one row's child process on `devices` (CUDA_VISIBLE_DEVICES entries; on the CPU, as many host
    devices)."""
    argv = [sys.executable, os.path.abspath(__file__), "--child", json.dumps([mesh, recipe, gather, options, batch]),
            "--size", args.size, "--seq", str(args.seq), "--steps", str(args.steps), "--warmup", str(args.warmup),
            "--optimizer", args.optimizer, "--param-dtype", args.param_dtype, "--profile", str(args.profile)] + \
        (["--remat"] if args.remat else []) + (["--sr"] if args.sr else [])
    env = dict(os.environ, **NO_MULTICAST)
    if args.cpu_devices:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={len(devices)}")
    else:
        env.update(CUDA_VISIBLE_DEVICES=",".join(devices))
    if args.xla_flags:
        env["XLA_FLAGS"] = " ".join([env.get("XLA_FLAGS", ""), *args.xla_flags]).strip()
    proc = subprocess.Popen(argv, stdout=subprocess.PIPE, text=True, env=env,
                            cwd=os.path.dirname(os.path.abspath(__file__)))
    return proc, dict(mesh=mesh, recipe=recipe, gather=gather, options=list(options), start=time.perf_counter())


def finish_row(proc, row: dict) -> dict:
    stdout, _ = proc.communicate()
    lines = [line for line in stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": f"exited {proc.returncode}, no result"}
    seconds = time.perf_counter() - row.pop("start")
    result.update(row)
    where = "one device" if row["gather"] == "–" else ",".join(f"{k}={v}" for k, v in row["mesh"].items()) + \
        f" {row['gather']}-gather"
    print(f"{row_label(row)} {where}: " + (
        f"FAILED {result['error']}" if "error" in result else
        f"{result['tokens_per_s']:,.0f} tok/s on {result['devices']}, {result['step_ms']:.1f} ms/step")
        + f" ({seconds:.0f} s with compilation)", flush=True)
    return result


def _tflops(x: float) -> str:
    return f"{x:.0f}" if x >= 10 else f"{x:.2g}"


def row_label(row: dict) -> str:
    return ":".join([row["recipe"], *row.get("options", ())])


def table(results: list[dict], args) -> str:
    lines = ["| mesh (data x fsdp x tensor) | recipe | weight gather | batch | tokens/s | tokens/s per device | "
             "vs 1 device | vs bf16, bf16 gather | MFU | model TFLOP/s per device (NeMo) | step ms | "
             "peak GB per device |", "|---|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    ok = [r for r in results if "error" not in r]
    for r in results:
        sizes = r.get("sizes", r["mesh"])
        mesh = "one device" if r["gather"] == "–" else "{data} x {fsdp} x {tensor}".format(**sizes)
        if "error" in r:
            lines.append(f"| {mesh} | {row_label(r)} | {r['gather']} | | failed: {r['error'][:100]} | | | | | | | |")
            continue
        per_device = r["tokens_per_s"] / r["devices"]
        base = next((b for b in ok if b["mesh"] == r["mesh"] and b["recipe"] == "bf16" and b["gather"] == "bf16"
                     and not b.get("options")), None) if r["gather"] != "–" else \
            next((b for b in ok if b["gather"] == "–" and b["recipe"] == "bf16"), None)
        one = next((b for b in ok if b["gather"] == "–" and b["recipe"] == r["recipe"] and not r.get("options")),
                   None)
        speedup = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "–"
        efficiency = f"{per_device / one['tokens_per_s']:.2f}" if one and r["gather"] != "–" else "–"
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "–"
        mfu = f"{r['mfu']:.2f}" if r.get("mfu") else "–"
        gathered = "2bit" if r["recipe"].startswith("bitnet") and r["gather"] == "8bit" else r["gather"]  # ternary
        lines.append(f"| {mesh} | {row_label(r)} | {gathered} | {r['batch']} | {r['tokens_per_s']:,.0f} | "
                     f"{per_device:,.0f} | {efficiency} | {speedup} | {mfu} | {_tflops(r['nemo_tflops'])} | "
                     f"{r['step_ms']:.1f} | {peak} |")
    note = (f"Llama {args.size}, seq {args.seq}, remat={args.remat}, params {args.param_dtype}"
            f"{' + stochastic rounding' if args.sr else ''}, optimizer {args.optimizer}, random tokens, LM head in "
            f"bf16 unless :lm_head_8bit; {args.steps} steps queued back to back, median of {ROUNDS} rounds after "
            f"{args.warmup} warm-up steps; one subprocess per row. vs 1 device: tokens/s per device over the "
            "one-device row of the same recipe at the same batch per device; one-device rows ran side by side, one "
            "per GPU. MFU: qjax's count (task.flops_per_unit) over the device's bf16 peak; model TFLOP/s (NeMo): "
            "tokens/s per device x 12 L H^2 (1 + G/A + S/(2H) + 1.5 F/H) + 6 H V FLOPs per token (51.5 G for "
            "Llama-3-8B at seq 8192)"
            + (f"; {args.cpu_devices} CPU host devices (a check that it runs, not a speed)" if args.cpu_devices
               else "") + (f"; XLA_FLAGS += {' '.join(args.xla_flags)}" if args.xla_flags else "") + ".")
    profiled = [r for r in ok if r.get("profile")]
    if profiled:
        names = sorted({name for r in profiled for name in r["profile"]},
                       key=lambda name: -profiled[0]["profile"].get(name, 0))
        note += ("\n\n| GPU 0, ms per step | " + " | ".join(names) + " |\n|---|" + "---:|" * len(names) + "\n"
                 + "\n".join(f"| {row_label(r)} {r['gather']}-gather | "
                             + " | ".join(f"{r['profile'].get(n, 0):.1f}" for n in names) + " |" for r in profiled)
                 + "\n\n--profile: 2 more steps under jax.profiler, GPU 0's kernels summed by category "
                 "(benchmarks/profile_train.py); 'idle' is the time no kernel ran.")
    return "\n".join(lines) + "\n\n" + note + "\n"


def run_all(args, results: list[dict]) -> None:
    """Mesh rows one after another on the first `--devices` devices, then the one-device baselines side by side
    (one per GPU; one at a time on the CPU). Appends to `results` as rows finish."""
    gpus = list(range(args.cpu_devices)) if args.cpu_devices else visible_gpus()
    devices = gpus[:args.devices] if args.devices else gpus
    if not devices:
        raise SystemExit("no GPU visible (nvidia-smi -L lists none): pass --cpu-devices N for the CPU check")
    for mesh in args.meshes:
        for recipe, gather, options in args.rows:
            results.append(finish_row(*start_row(args, mesh, recipe, gather, options, args.batch, devices)))
    if not args.baselines:
        return
    if args.batch % len(devices):
        raise SystemExit(f"--batch {args.batch} does not split over {len(devices)} devices for the baselines")
    batch, width = args.batch // len(devices), 1 if args.cpu_devices else len(gpus)
    pending = list(args.baselines)
    while pending:
        started = [start_row(args, parse_mesh(""), recipe, "–", (), batch, [gpu] if not args.cpu_devices else [0])
                   for recipe, gpu in zip(pending[:width], gpus)]
        pending = pending[width:]
        results.extend(finish_row(*row) for row in started)


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1b", help="a preset of qjax.models.LLAMA_SIZES (tiny, 1b, 8b, ...)")
    parser.add_argument("--meshes", nargs="+", type=parse_mesh, default=None,
                        help="meshes as axis=size lists (default: fsdp=-1, FSDP over every device)")
    parser.add_argument("--rows", nargs="+", type=parse_row, default=None,
                        help="RECIPE[:GATHER][:OPTION...] per mesh, GATHER 8bit (default) or bf16, OPTION one of "
                             "benchmarks/common.py's MODEL_OPTIONS (e.g. lm_head_8bit); default: bf16, then "
                             "int8_rowwise and fp8_tensorwise with both gathers")
    parser.add_argument("--baselines", nargs="*", default=[], choices=RECIPES,
                        help="recipes to run on one device too (scaling efficiency)")
    parser.add_argument("--devices", type=int, default=0, help="the mesh rows use the first N GPUs (default all)")
    parser.add_argument("--batch", type=int, default=8, help="global batch of the mesh rows")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny: 32)")
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--param-dtype", default="float32", choices=("float32", "bfloat16"))
    parser.add_argument("--sr", action="store_true", help="stochastic rounding of the param updates (bf16 params)")
    parser.add_argument("--optimizer", default="adamw", help="config.optimizer.name (adamw, adamw_8bit, ...)")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cpu-devices", type=int, default=0, help="run on this many CPU host devices (toy check)")
    parser.add_argument("--profile", type=int, default=0, metavar="TOP",
                        help="also profile 2 steps of each mesh row: GPU 0's time by category and its TOP ops")
    parser.add_argument("--xla-flags", action="append", default=[], help="a flag added to every row's XLA_FLAGS "
                        "(written --xla-flags=..., once per flag), e.g. --xla-flags=--xla_gpu_enable_pipelined_all_"
                        "gather=true")
    parser.add_argument("--no-record", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    args.seq = args.seq or (32 if args.size == "tiny" else 2048)
    if args.child:
        try:
            print(json.dumps(measure(args, *json.loads(args.child))), flush=True)
        except Exception as e:  # reported in the table rather than ending the whole benchmark
            print(json.dumps({"error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)
        return
    args.meshes = args.meshes or [parse_mesh("fsdp=-1")]
    args.rows = args.rows or [parse_row(r) for r in ("bf16", "int8_rowwise", "int8_rowwise:bf16", "fp8_tensorwise",
                                                     "fp8_tensorwise:bf16")]
    # `timeout` sends SIGTERM: end through the finally below, so that the rows done so far are kept.
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))
    results = []
    try:
        run_all(args, results)
    finally:
        if results:
            report = table(results, args)
            print("\n" + report, flush=True)
            if not args.no_record:
                if args.cpu_devices:
                    os.environ.update(JAX_PLATFORMS="cpu")
                from common import record_results
                record_results(f"Llama {args.size} scaling over a mesh", report)


if __name__ == "__main__":
    main()
