"""Linear layer forward + backward time per recipe vs bf16: y = x . w^T, then dx and dw from an upstream gradient.

  python benchmarks/linear.py                 # GPU: M=16384, (K, N) in (4096, 4096), (4096, 14336), (14336, 4096)
  python benchmarks/linear.py --small         # CPU-sized shapes (the default when no GPU is present)

Prints a table of milliseconds per step and speedup vs bf16, and appends it to the results JSON with the
device, date, jax version and commit (--no-record to skip). A step's time is the median over --reps samples after
warm-up, each --inner steps queued back to back and one wait: a ~2 ms step waited for one at a time also times the
host's dispatch and wake-up, which varied by ~10% between machines.

Then, unless --no-peer, the same shapes run in torch.compile + torchao in a subprocess (benchmarks/torch_peer.py)
and a side-by-side table pairs bf16<->bf16, fp8_tensorwise<->float8 tensorwise, fp8_rowwise<->float8 rowwise and
int8_rowwise<->int8 mixed precision. The peer needs torch (and torchao: carry its wheel, see torch_peer.py) in the
interpreter named by --peer-python / $QJAX_TORCH_PYTHON (default: this one); without torch it is skipped with a note.
GPU memory: this script sets XLA_PYTHON_CLIENT_PREALLOCATE=false (unless already set) so that JAX keeps only what
its own arrays used (a few GB) instead of 75% of the GPU, leaving the rest to the torch subprocess that runs after
the JAX table. (JAX's allocator still caches and reuses buffers, so steady-state step times are unaffected.)
"""

import os

os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")  # before jax is imported: see the docstring

import argparse  # noqa: E402
import dataclasses  # noqa: E402
import pathlib  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

import qjax  # noqa: E402
from common import record_results, device_kind, time_ms  # noqa: E402
from torch_peer import run_torch_peer  # noqa: E402  (imports no torch)

TN = (((1,), (1,)), ((), ()))
# qjax recipe -> torchao variant measured against it (torch_peer.VARIANTS).
PEERS = {"bf16": "bf16", "fp8_tensorwise": "float8_tensorwise", "fp8_rowwise": "float8_rowwise",
         "int8_rowwise": "int8_mixed_precision"}


def bench_recipes():
    """bf16, every named recipe, the int8 per-GEMM variants (forward only; forward + dgrad), and "<name>@xla" rows:
    the quantized recipes forced onto the XLA path (backend "xla"), to show what the Pallas kernels change (the
    plain rows use backend "auto": the kernels on a Hopper GPU, XLA elsewhere)."""
    int8 = qjax.recipe("int8_rowwise")
    variants = [dataclasses.replace(int8, name="int8_rowwise_fwd_only", dgrad=None, wgrad=None),
                dataclasses.replace(int8, name="int8_rowwise_fwd_dgrad", wgrad=None)]
    named = list(qjax.RECIPES.values())
    xla = [dataclasses.replace(r, name=r.name + "@xla", backend="xla") for r in named if not r.is_high_precision]
    return named + variants + xla


def make_step(recipe):
    """(x, w, g) -> (y, dx, dw): one linear layer's forward and backward, jitted."""

    def step(x, w, g):
        y, vjp = jax.vjp(lambda x, w: qjax.dot_general(x, w, TN, recipe=recipe), x, w)
        return (y, *vjp(g))

    return jax.jit(step)


def run(m, shapes, reps, warmup, inner, names=None):
    rows = {}
    for k, n in shapes:
        keys = jax.random.split(jax.random.key(0), 3)
        x = jax.random.normal(keys[0], (m, k), jnp.bfloat16)
        w = (jax.random.normal(keys[1], (n, k), jnp.float32) * k**-0.5).astype(jnp.bfloat16)
        g = jax.random.normal(keys[2], (m, n), jnp.bfloat16)
        for recipe in bench_recipes():
            if names and recipe.name not in names and recipe.name != "bf16":
                continue
            ms = time_ms(make_step(recipe), (x, w, g), warmup, reps, inner)
            rows.setdefault(recipe.name, {})[(k, n)] = ms
            print(f"  {recipe.name:24s} K={k:6d} N={n:6d} {ms:9.3f} ms", flush=True)
    return rows


def table(rows, m, shapes, reps, inner):
    header = "| recipe | " + " | ".join(f"{k}→{n} ms | speedup" for k, n in shapes) + " |"
    lines = [header, "|---|" + "---:|---:|" * len(shapes)]
    for name, times in rows.items():
        cells = " | ".join(f"{times[s]:.3f} | {rows['bf16'][s] / times[s]:.2f}x" for s in shapes)
        lines.append(f"| {name} | {cells} |")
    flops = " · ".join(f"{k}→{n}: bf16 {6 * m * k * n / rows['bf16'][(k, n)] / 1e9:.0f} TFLOP/s" for k, n in shapes)
    timing = f"median of {reps} samples of {inner} steps queued back to back"
    return "\n".join(lines) + f"\n\nM={m}; x, w, g in bfloat16; y, dx, dw per step; {timing}. {flops}.\n"


def peer_table(rows, peer, shapes):
    """Side-by-side qjax vs torchao (torch.compile) table; each speedup is against its own framework's bf16."""
    lines = ["| K→N | recipe ↔ torchao | qjax ms | qjax speedup | torchao ms | torchao speedup |",
             "|---|---|---:|---:|---:|---:|"]
    results = peer.get("results", {})
    for k, n in shapes:
        for recipe, variant in PEERS.items():
            if recipe not in rows:
                continue
            ours = rows[recipe][(k, n)]
            cells = [f"{k}→{n}", f"{recipe} ↔ {variant}", f"{ours:.3f}", f"{rows['bf16'][(k, n)] / ours:.2f}x"]
            theirs = results.get(variant, {}).get(f"{k}x{n}")
            base = results.get("bf16", {}).get(f"{k}x{n}")
            if theirs and base:
                cells += [f"{theirs['ms']:.3f}", f"{base['ms'] / theirs['ms']:.2f}x"]
            else:
                cells += ["—", "—"]
            lines.append("| " + " | ".join(cells) + " |")
    notes = [f"torch {peer.get('torch')}, torchao {peer.get('torchao')}, torch.compile={peer.get('compile')}, "
             f"{peer.get('device')}, same M, shapes and data distribution (benchmarks/torch_peer.py linear)."]
    notes += [f"{variant}: not run ({reason})." for variant, reason in peer.get("skipped", {}).items()]
    return "\n".join(lines) + "\n\n" + "\n".join(notes) + "\n"


def run_peer(args, m, shapes, reps, inner):
    """The torch peer's result dict for the PEERS variants of the recipes that ran ("error" set if it failed)."""
    variants = [PEERS[name] for name in PEERS if name == "bf16" or not args.recipes or name in args.recipes]
    print(f"\ntorch/torchao peer ({', '.join(variants)}) in a subprocess...", flush=True)
    peer = run_torch_peer("linear", python=args.peer_python, m=m, shapes=[f"{k}x{n}" for k, n in shapes],
                          variants=variants, reps=reps, inner=inner, warmup=args.warmup,
                          compile=args.peer_compile)
    if "error" in peer:
        print(f"torch peer not measured: {peer['error']}" + ("" if args.peer else " (--no-peer skips it)"))
    return peer


def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--small", action="store_true", help="CPU-sized shapes (default when no GPU is present)")
    parser.add_argument("--reps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--inner", type=int, default=10, help="steps queued back to back per timed sample")
    parser.add_argument("--shapes", nargs="*", help="K x N pairs, e.g. 4096x14336 (default: the three GPU shapes)")
    parser.add_argument("--recipes", nargs="*", help="recipe names to time (default: all; bf16 always runs)")
    parser.add_argument("--no-record", action="store_true", help="do not record results")
    parser.add_argument("--peer", action=argparse.BooleanOptionalAction, default=None,
                        help="torch/torchao side-by-side table (default: on when the peer interpreter has torch)")
    parser.add_argument("--peer-python", help="interpreter with torch + torchao (default $QJAX_TORCH_PYTHON or this)")
    parser.add_argument("--peer-compile", action=argparse.BooleanOptionalAction, default=True,
                        help="torch.compile in the peer (--no-peer-compile where no C++ compiler is present)")
    args = parser.parse_args()
    small = args.small or jax.default_backend() != "gpu"
    m, shapes = (512, [(256, 256), (256, 1024)]) if small else (16384, [(4096, 4096), (4096, 14336), (14336, 4096)])
    if args.shapes:
        shapes = [tuple(int(d) for d in s.split("x")) for s in args.shapes]
    reps = args.reps if not small else min(args.reps, 5)
    inner = args.inner if not small else 1
    print(f"linear fwd+bwd on {device_kind()} ({jax.default_backend()}), jax {jax.__version__}, M={m}", flush=True)
    rows = run(m, shapes, reps, args.warmup, inner, args.recipes)
    report = table(rows, m, shapes, reps, inner)
    print("\n" + report)
    peer = run_peer(args, m, shapes, reps, inner) if args.peer is not False else {}
    if peer and "error" not in peer:
        side_by_side = peer_table(rows, peer, shapes)
        print("\n" + side_by_side)
        report += "\nqjax vs torch.compile + torchao, each against its own bf16:\n\n" + side_by_side
    if not args.no_record:
        record_results("linear fwd+bwd", report)
    if args.peer and "error" in peer:  # asked for explicitly: keep the JAX table, then fail loudly
        raise SystemExit(f"torch peer failed: {peer['error']}")


if __name__ == "__main__":
    main()
