"""Per-device temp memory of the FSDP + remat train step, bf16 vs 8-bit recipes, from XLA's compiled memory analysis
on CPU host devices: no GPU needed, the same program structure (8-bit weight all-gathers, per-layer remat) as
`benchmarks/scaling.py --remat --param-dtype bfloat16 --sr --optimizer adamw_8bit` on a Llama of the 8B's shape,
scaled down so it compiles in seconds.

  python benchmarks/fsdp_memory.py                                # 2 and 4 layers, bf16 and int8_rowwise
  python benchmarks/fsdp_memory.py --layers 2 4 8 --dim 1024 --ffn 3584 --seq 512 --dump /tmp/fsdp_dump

temp MB: XLA's temp buffers per device (everything but params, optimizer state and batch); per layer: its growth
per added layer. --dump writes XLA's buffer assignment (and the live buffers at the peak, in
*live-range.txt) per row to a folder. XLA:CPU schedules differently from XLA:GPU, so this shows what the program
makes live, not the GPU's peak.
"""

import argparse
import json
import os
import subprocess
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

CHILD = """
import json, sys
import jax, jax.numpy as jnp
from configs import llama_base
from qjax.train import make_task, make_train_step
args = json.loads(sys.argv[1])
config = llama_base.get_config()
config.model.update(size="tiny", n_layers=args["layers"], dim=args["dim"], n_heads=8, n_kv_heads=2,
                    ffn_dim=args["ffn"], vocab_size=512, remat=True, param_dtype="bfloat16")
config.optimizer.name, config.optimizer.stochastic_rounding = "adamw_8bit", True
config.recipe, config.seq_len, config.batch_size, config.steps = args["recipe"], args["seq"], 2, 100
config.mesh.update(data=1, fsdp=2)
init_state, train_step = make_train_step(config, make_task(config))
batch = {k: jax.ShapeDtypeStruct((2, args["seq"]), jnp.int32) for k in ("inputs", "targets")}
memory = train_step.lower(jax.eval_shape(init_state), batch).compile().memory_analysis()
print(json.dumps({"temp": memory.temp_size_in_bytes, "args": memory.argument_size_in_bytes}))
"""


def measure(recipe: str, layers: int, args) -> dict:
    flags = "--xla_force_host_platform_device_count=2"
    if args.dump:
        flags += f" --xla_dump_to={args.dump}/{recipe}_{layers} --xla_dump_hlo_module_re=.*train_step.*"
    env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS=f"{os.environ.get('XLA_FLAGS', '')} {flags}".strip(),
               PYTHONPATH=REPO)
    spec = json.dumps(dict(recipe=recipe, layers=layers, dim=args.dim, ffn=args.ffn, seq=args.seq))
    out = subprocess.run([sys.executable, "-c", CHILD, spec], env=env, capture_output=True, text=True, cwd=REPO)
    if out.returncode:
        raise SystemExit(out.stderr[-3000:])
    return json.loads(out.stdout.strip().splitlines()[-1])


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--recipes", nargs="+", default=["bf16", "int8_rowwise"])
    parser.add_argument("--layers", nargs="+", type=int, default=[2, 4])
    parser.add_argument("--dim", type=int, default=1024)
    parser.add_argument("--ffn", type=int, default=3584)
    parser.add_argument("--seq", type=int, default=512, help="tokens per device (batch 2 over fsdp=2)")
    parser.add_argument("--dump", help="folder for XLA's dumps (buffer assignment, live ranges) per row")
    args = parser.parse_args()
    print(f"Llama dim {args.dim}, ffn {args.ffn}, 8/2 heads, seq {args.seq}, fsdp=2 on 2 CPU devices, remat, bf16 "
          "params + SR, adamw_8bit\n\n| recipe | layers | temp MB | per layer MB |\n|---|---:|---:|---:|")
    for recipe in args.recipes:
        previous = None
        for layers in sorted(args.layers):
            temp = measure(recipe, layers, args)["temp"] / 1e6
            slope = f"{(temp - previous[1]) / (layers - previous[0]):.1f}" if previous else "–"
            print(f"| {recipe} | {layers} | {temp:.1f} | {slope} |", flush=True)
            previous = (layers, temp)


if __name__ == "__main__":
    main()
