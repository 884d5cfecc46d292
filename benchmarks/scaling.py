"""Llama train-step throughput and peak memory per device over a (data, fsdp, tensor) mesh: FSDP and tensor
parallelism, bf16 vs int8_rowwise vs fp8_tensorwise, weights all-gathered as 8-bit codes vs in bf16.

  python benchmarks/scaling.py --size 1b --meshes fsdp=8 fsdp=4,tensor=2 data=2,fsdp=4     # 8 GPUs
  python benchmarks/scaling.py --size 8b --meshes fsdp=8 --batch 8 --remat
  python benchmarks/scaling.py --size tiny --cpu-devices 8                                  # CPU check, toy size

One row = (mesh, recipe, gather) running `qjax.train.make_train_step` on random tokens, in its own subprocess (its
peak memory is its own). "8bit" is the default train step (quantized layers gather their FSDP-split weights as
8-bit codes + scales); "bf16" turns that off (`config.mesh.gather_8bit=False`: XLA all-gathers the float weights).
tokens/s is the global rate, --steps steps queued back to back, median of 3 rounds; peak GB is the largest
`peak_bytes_in_use` over the devices ("–" where the platform does not report it, e.g. the CPU).
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")

import argparse  # noqa: E402
import json  # noqa: E402
import subprocess  # noqa: E402
import sys  # noqa: E402

RECIPES = ("bf16", "int8_rowwise", "fp8_tensorwise")
GATHERS = ("8bit", "bf16")
ROUNDS = 3


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


def measure(args, mesh: dict, recipe: str, gather: str) -> dict:
    """In the child process: one row's tokens/s, step ms, peak memory per device and loss."""
    import jax
    import numpy as np

    from common import REPO, time_ms

    sys.path.insert(0, str(REPO))
    from configs import llama_base
    from qjax.train import make_task, make_train_step
    from qjax.train.mesh import axis_sizes

    config = llama_base.get_config()
    config.model.size = args.size
    config.model.remat = args.remat
    config.recipe = recipe
    config.mesh.update(mesh)
    config.mesh.gather_8bit = gather == "8bit"
    config.seq_len, config.batch_size, config.steps = args.seq, args.batch, 1000
    task = make_task(config)
    init_state, train_step = make_train_step(config, task)
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, task.model_config.vocab_size, (args.batch, args.seq + 1), dtype=np.int32)
    batch = {"inputs": tokens[:, :-1], "targets": tokens[:, 1:]}
    holder, losses = [init_state()], []

    def run_one():  # the state is donated: thread it through
        holder[0], metrics = train_step(holder[0], batch)
        losses.append(metrics["loss"])
        return metrics["loss"]

    ms = time_ms(run_one, (), warmup=args.warmup, reps=ROUNDS, inner=args.steps)
    losses = [float(x) for x in losses]
    if not np.isfinite(losses).all():
        raise RuntimeError(f"non-finite loss: {losses}")
    peaks = [(d.memory_stats() or {}).get("peak_bytes_in_use") for d in jax.devices()]
    sizes = dict(zip(("data", "fsdp", "tensor"), axis_sizes(jax.device_count(), **mesh)))
    return dict(mesh=mesh, sizes=sizes, recipe=recipe, gather=gather, devices=jax.device_count(), step_ms=ms,
                tokens_per_s=args.batch * args.seq / ms * 1e3, loss=losses[-1],
                peak_gb=max(peaks) / 1e9 if all(p is not None for p in peaks) else None,
                device=jax.devices()[0].device_kind)


def run_row(args, mesh: dict, recipe: str, gather: str) -> dict:
    argv = [sys.executable, os.path.abspath(__file__), "--child", json.dumps([mesh, recipe, gather]), "--size",
            args.size, "--batch", str(args.batch), "--seq", str(args.seq), "--steps", str(args.steps), "--warmup",
            str(args.warmup)] + (["--remat"] if args.remat else [])
    env = dict(os.environ)
    if args.cpu_devices:
        env.update(JAX_PLATFORMS="cpu", XLA_FLAGS=f"--xla_force_host_platform_device_count={args.cpu_devices}")
    proc = subprocess.run(argv, stdout=subprocess.PIPE, text=True, env=env,
                          cwd=os.path.dirname(os.path.abspath(__file__)))
    lines = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    result = json.loads(lines[-1]) if lines else {"error": f"exited {proc.returncode}, no result"}
    result.update(mesh=mesh, recipe=recipe, gather=gather)
    mesh_text = ",".join(f"{k}={v}" for k, v in mesh.items())
    print(f"{mesh_text} {recipe} {gather}-gather: " + (f"FAILED {result['error']}" if "error" in result else
          f"{result['tokens_per_s']:,.0f} tok/s, {result['step_ms']:.1f} ms/step"), flush=True)
    return result


def table(results: list[dict], args) -> str:
    lines = ["| mesh (data, fsdp, tensor) | recipe | weight gather | tokens/s | tokens/s per device | vs bf16, "
             "bf16 gather | step ms | peak GB per device |", "|---|---|---|---:|---:|---:|---:|---:|"]
    for r in results:
        mesh = "{data} x {fsdp} x {tensor}".format(**r.get("sizes", r["mesh"]))
        if "error" in r:
            lines.append(f"| {mesh} | {r['recipe']} | {r['gather']} | failed: {r['error'][:100]} | | | | |")
            continue
        base = next((b for b in results if b["mesh"] == r["mesh"] and b["recipe"] == "bf16" and b["gather"] == "bf16"
                     and "error" not in b), None)
        speedup = f"{r['tokens_per_s'] / base['tokens_per_s']:.2f}x" if base else "–"
        peak = f"{r['peak_gb']:.1f}" if r.get("peak_gb") else "–"
        lines.append(f"| {mesh} | {r['recipe']} | {r['gather']} | {r['tokens_per_s']:,.0f} | "
                     f"{r['tokens_per_s'] / r['devices']:,.0f} | {speedup} | {r['step_ms']:.1f} | {peak} |")
    note = (f"Llama {args.size}, batch {args.batch} x seq {args.seq}, remat={args.remat}, random tokens, optax AdamW "
            f"(fp32 states), LM head in bf16; {args.steps} steps queued back to back, median of {ROUNDS} rounds "
            f"after {args.warmup} warm-up steps; one subprocess per row"
            + (f"; {args.cpu_devices} CPU host devices (a check that it runs, not a speed)" if args.cpu_devices
               else "") + ".")
    return "\n".join(lines) + "\n\n" + note + "\n"


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", default="1b", help="a preset of qjax.models.LLAMA_SIZES (tiny, 1b, 8b, ...)")
    parser.add_argument("--meshes", nargs="+", type=parse_mesh, default=None,
                        help="meshes as axis=size lists (default: fsdp=-1, and fsdp=-1,tensor=2 with an even count)")
    parser.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=RECIPES)
    parser.add_argument("--gathers", nargs="+", default=list(GATHERS), choices=GATHERS)
    parser.add_argument("--batch", type=int, default=None, help="global batch (default 8; tiny: 8)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default 2048; tiny: 32)")
    parser.add_argument("--remat", action="store_true")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--cpu-devices", type=int, default=0, help="run on this many CPU host devices (toy check)")
    parser.add_argument("--no-append", action="store_true")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    tiny = args.size == "tiny"
    args.batch = args.batch or 8
    args.seq = args.seq or (32 if tiny else 2048)
    if args.child:
        try:
            print(json.dumps(measure(args, *json.loads(args.child))), flush=True)
        except Exception as e:  # reported in the table rather than ending the whole benchmark
            print(json.dumps({"error": f"{type(e).__name__}: {e}"[:2000]}), flush=True)
        return
    meshes = args.meshes or [parse_mesh("fsdp=-1"), parse_mesh("fsdp=-1,tensor=2")]
    results = [run_row(args, mesh, recipe, gather) for mesh in meshes for recipe in args.recipes
               for gather in args.gathers if not (recipe == "bf16" and gather == "8bit")]  # bf16 gathers bf16
    report = table(results, args)
    print("\n" + report)
    if not args.no_append:
        if args.cpu_devices:
            os.environ.update(JAX_PLATFORMS="cpu")
        from common import append_results
        append_results(f"Llama {args.size} scaling over a mesh", report)


if __name__ == "__main__":
    main()
