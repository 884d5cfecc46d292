"""The benchmark suites: one entry point, machine-readable results, a results page regenerated from them.

  python -m benchmarks list                          # the suites and the commands each runs
  python -m benchmarks run linear e2e                # run suites; results in runs/benchmarks/<suite>.json + .log
  python -m benchmarks run e2e e2e@.baseline         # the same suite in another exported tree: an A/B in one call
                                                     # (its files: e2e__baseline.json + .log, never published)
  python -m benchmarks publish runs/benchmarks       # merge a run's JSON into benchmarks/results/, rewrite the page
  python -m benchmarks page                          # rewrite benchmarks/README.md from benchmarks/results/

A run never writes a file that git tracks: results go to --out (default runs/benchmarks/, git-ignored). Publishing
is the one step that changes benchmarks/results/ and benchmarks/README.md, so the page always states the latest
published result of each suite's command, with its device, date, jax version and commit (a rerun replaces its
section; sections of other commands stay). On the device machine,
`bash benchmarks/device.sh SUITE...` installs the carried wheels and runs these with --out $OUT.
"""

import argparse
import json
import os
import pathlib
import subprocess
import sys
import threading
import time

REPO = pathlib.Path(__file__).resolve().parent.parent
PUBLISHED = REPO / "benchmarks" / "results"
PAGE = REPO / "benchmarks" / "README.md"
STEPS = ["--steps", "5", "--warmup", "2"]
AB_MARK = "__"  # in the results and log names of a suite run in another tree (SUITE@TREE)


def _gpu_count() -> int:
    try:
        out = subprocess.run(["nvidia-smi", "-L"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return 0
    return sum(line.startswith("GPU ") for line in out.splitlines())


def suites(gpus: int) -> dict[str, tuple[str, list[list[str]]]]:
    """Suite name -> (what it measures, the commands it runs). Commands are argv lists run from the tree's root."""
    fsdp_8b = ["--size", "8b", "--seq", "8192", "--batch", str(max(gpus, 1)), "--param-dtype", "bfloat16", "--sr",
               "--optimizer", "adamw_8bit", "--steps", "3", "--warmup", "1", "--profile", "10"]
    return {
        "linear": ("one linear layer fwd+bwd per recipe vs bf16, and torch.compile + torchao beside it", [
            ["benchmarks/linear.py", "--shapes", "4096x4096", "4096x14336", "--reps", "10", "--recipes",
             "int8_rowwise", "fp8_tensorwise", "fp8_rowwise", "fp8_blockwise"]]),
        "e2e": ("the 1.1B Llama train step per recipe vs bf16, and the torch peer (HF Llama, torchao float8)", [
            ["benchmarks/train.py", "--rows", "bf16", "int8_rowwise", "fp8_tensorwise", "int8_dataflow", *STEPS,
             "--peer-variants", "bf16", "float8_tensorwise"]]),
        "e2e-ab": ("the 1.1B train step, bf16 and int8_rowwise only (for a before/after pair: e2e-ab e2e-ab@TREE)", [
            ["benchmarks/train.py", "--rows", "bf16", "int8_rowwise", *STEPS, "--no-peer"]]),
        "linear-ab": ("one linear layer, int8_rowwise and fp8_tensorwise vs bf16, no peer (for a before/after pair)", [
            ["benchmarks/linear.py", "--shapes", "4096x4096", "4096x14336", "--reps", "10", "--recipes",
             "int8_rowwise", "fp8_tensorwise", "--no-peer"]]),
        "e2e-8b": ("the full Llama-3-8B at seq 8192, FSDP over every GPU, bf16 vs the 8-bit recipes, without and "
                   "with remat", [
                       ["benchmarks/scaling.py", *fsdp_8b, "--rows", "bf16", "int8_rowwise", "int8_dataflow"],
                       ["benchmarks/scaling.py", *fsdp_8b, "--remat", "--rows", "bf16", "int8_rowwise"]]),
        "memory": ("peak memory of the 1.1B train step per recipe, compiled (XLA's plan)", [
            ["benchmarks/peak_memory.py", "--recipes", "bf16", "int8_rowwise", "int8_dataflow", "fp8_dataflow"]]),
        "optim": ("the low-bit AdamW step on a 1.1B pytree vs optax.adamw", [
            ["benchmarks/optim.py", "--rows", "8bit", "8bit_kernel", "fp8", "fp8_kernel", "8bit_sr",
             "8bit_sr_kernel", "--rounds", "3"]]),
        "moe": ("MoE grouped GEMMs per recipe vs bf16, and a 4-layer MoE Llama end to end", [
            ["benchmarks/ragged.py"],
            ["benchmarks/train.py", "--rows", "bf16", "int8_rowwise", "--layers", "4", "--moe", "64,8,0,1408",
             *STEPS, "--no-peer"]]),
        "kernels": ("the Pallas kernels alone: quantize and the 8-bit GEMMs at 8192", [
            ["benchmarks/kernels.py", "quantize", "--shapes", "16384x4096", "16384x14336"],
            ["benchmarks/matmul.py", "--layouts", "TN", "--sizes", "8192", "--rows", "bf16", "int8", "fp8",
             "int8_row_kernel", "fp8_row_kernel", "int8_block_kernel", "fp8_block_kernel"]]),
        "generate": ("prefill and decode of the 1B preset: bf16, int8 weight-only, fp8 rowwise", [
            ["benchmarks/generate.py"]]),
        "mesh": ("the 1.1B step over FSDP on every GPU vs one GPU, and torch FSDP2 + torchao float8", [
            ["benchmarks/scaling.py", "--size", "1b", "--rows", "bf16", "int8_rowwise", "fp8_tensorwise",
             "--baselines", "bf16", "int8_rowwise", "--steps", "3", "--warmup", "1"],
            ["benchmarks/torch_fsdp_peer.py"]]),
        "convergence": ("125M Llama on Shakespeare, 750 steps: eval loss per recipe vs bf16", [
            ["benchmarks/convergence.py", "--recipes", "bf16", "int8_rowwise", "fp8_rowwise", "int8_dataflow",
             "--size", "125m", "--seq-len", "1024", "--batch-size", "32", "--steps", "750", "--lr", "6e-4",
             "--workdir", "/tmp/convergence"]]),
        "options": ("what a model option costs the 1.1B step against the same recipe without it, both timed in "
                    "alternating rounds in one process: Smooth-SwiGLU on fp8_rowwise", [
            ["benchmarks/option_cost.py", "--rows", "fp8_rowwise:smooth_swiglu"]]),
        "8b-layers": ("the 8B at 8 of its 32 layers, batch 4 x 2048 (its 128k-vocabulary LM head weighs 4x its share "
                      "of the full model): bf16, int8_rowwise, and int8_rowwise with the LM head in 8 bits", [
            ["benchmarks/train.py", "--size", "8b", "--layers", "8", "--batch", "4", "--seq", "2048", "--rows", "bf16",
             "int8_rowwise", "int8_rowwise:lm_head_8bit", *STEPS, "--no-peer"]]),
        "reproducibility": ("is the 125M train step bit-reproducible? bf16 and int8_rowwise, cuDNN and XLA "
                            "attention, without and with XLA's deterministic ops", [
            ["benchmarks/reproducibility.py", "--attention", "auto", "xla", "--steps", "100"],
            ["benchmarks/reproducibility.py", "--attention", "auto", "xla", "--steps", "100", "--xla-deterministic"]]),
        "health": ("what the quantization health metrics cost the 1.1B train step", [
            ["benchmarks/health_cost.py", "--recipes", "int8_rowwise", "fp8_tensorwise"]]),
        "gpu-tests": ("every GPU-marked test, compiled", [
            ["make", "-s", "test-gpu", f"PY={sys.executable}"]]),  # this interpreter: no venv on the device
    }


def _command(argv: list[str]) -> list[str]:
    return [sys.executable, *argv] if argv[0].endswith(".py") else argv


def result_label(name: str) -> str:
    """SUITE or SUITE@TREE -> the name of its results and log files: SUITE, or SUITE__TREE (the device tool returns
    no file whose name holds an '@')."""
    suite, _, tree = name.partition("@")
    return f"{suite}{AB_MARK}{pathlib.Path(tree).name.lstrip('.')}" if tree else suite


def run(names: list[str], out: pathlib.Path, budget: float) -> int:
    """Runs each suite (NAME or NAME@TREE, TREE an exported tree of another commit) under what is left of the
    budget; every command's output goes to out/<suite>.log as it runs. Returns how many commands failed."""
    table = suites(_gpu_count())
    for name in names:
        if name.split("@")[0] not in table:
            raise SystemExit(f"error: no suite {name.split('@')[0]!r}; the suites are: {', '.join(table)}")
    out.mkdir(parents=True, exist_ok=True)
    deadline, failures = time.monotonic() + budget, 0
    for name in names:
        suite, _, tree = name.partition("@")
        root = (REPO / tree).resolve() if tree else REPO
        label = result_label(name)
        (out / f"{label}.json").unlink(missing_ok=True)
        env = {**os.environ, "QJAX_SUITE": label, "QJAX_RESULTS_DIR": str(out.resolve()), "PYTHONUNBUFFERED": "1",
               "PYTHONPATH": os.pathsep.join(filter(None, [os.environ.get("QJAX_SITE"), str(root)])),
               # NVLink multicast stays off on the lent machines (the device tool's KINDS.md)
               "NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
        with open(out / f"{label}.log", "a") as log:
            for argv in table[suite][1]:
                left = deadline - time.monotonic()
                if left < 10:
                    print(f"[{label}] skipped {' '.join(argv)}: the budget is spent", file=log, flush=True)
                    print(f"[{label}] skipped {' '.join(argv)}: the budget is spent")
                    failures += 1
                    continue
                print(f"[{label}] {' '.join(argv)} (up to {left:.0f} s)", flush=True)
                start = time.monotonic()
                proc = subprocess.Popen(_command(argv), cwd=root, env=env, stdout=subprocess.PIPE,
                                        stderr=subprocess.STDOUT, text=True)
                # SIGTERM at the deadline (scaling.py and train.py keep the rows finished by then), SIGKILL after
                stop = threading.Timer(left, proc.terminate)
                kill = threading.Timer(left + 30, proc.kill)
                stop.start(), kill.start()
                for line in proc.stdout:
                    sys.stdout.write(line)
                    log.write(line)
                    log.flush()
                proc.wait()
                stop.cancel(), kill.cancel()
                failures += proc.returncode != 0
                print(f"[{label}] exit {proc.returncode} after {time.monotonic() - start:.0f} s", flush=True)
    return failures


def write_page() -> None:
    """benchmarks/README.md from the published results: one heading per suite, one section per command."""
    lines = ["# Benchmark results", "",
             "Generated by `python -m benchmarks publish` from `benchmarks/results/*.json`; do not edit by hand.",
             "Each section is the latest published run of its command (`python -m benchmarks list` says what each "
             "suite runs).",
             "Speed ratios are measured side by side in one run on one device.", ""]
    descriptions = {name: what for name, (what, _) in suites(1).items()}
    for path in sorted(PUBLISHED.glob("*.json")):
        results = json.loads(path.read_text())
        suite = results["suite"]
        lines += [f"## {suite}", "", descriptions.get(suite, ""), ""]
        for section in results["sections"]:
            lines += [f"### {section['title']}", "",
                      f"{section['device']}, {section['date']}, jax {section['jax']}, code at {section['commit']}: "
                      f"`{section['command']}`", ""]
            for table in section["tables"]:
                lines += ["| " + " | ".join(table["columns"]) + " |",
                          "|" + "---|" * len(table["columns"])]
                lines += ["| " + " | ".join(row) + " |" for row in table["rows"]]
                lines.append("")
            if section["notes"]:
                lines += [section["notes"], ""]
    PAGE.write_text("\n".join(lines).rstrip() + "\n")
    print(f"wrote {PAGE.relative_to(REPO)}")


def merge_sections(published: dict | None, new: dict) -> dict:
    """A suite's results file after publishing `new` over `published` (both {"suite", "sections"}): a new section
    replaces the published one of the same title and command, in its place; the others stay, so studies run with
    other commands (a convergence study over several device calls) are kept. Remove a stale one by hand."""
    if published is None:
        return new
    key = lambda section: (section["title"], section.get("command"))  # noqa: E731
    fresh = {key(section): section for section in new["sections"]}
    sections = [fresh.pop(key(section), section) for section in published["sections"]]
    return {**published, "sections": sections + list(fresh.values())}


def publish(source: pathlib.Path) -> None:
    """Merges a run's results (not the A/B runs of other trees) into benchmarks/results/ (`merge_sections`) and
    rewrites the page."""
    found = [p for p in sorted(source.glob("*.json")) if AB_MARK not in p.name and "@" not in p.name]
    if not found:
        raise SystemExit(f"error: no suite results (*.json) in {source}: run `python -m benchmarks run SUITE` first")
    PUBLISHED.mkdir(exist_ok=True)
    for path in found:
        target = PUBLISHED / path.name
        published = json.loads(target.read_text()) if target.exists() else None
        target.write_text(json.dumps(merge_sections(published, json.loads(path.read_text())), indent=1,
                                     ensure_ascii=False))
        print(f"published {path.name}")
    write_page()


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = parser.add_subparsers(dest="command", required=True)
    commands.add_parser("list", help="the suites and their commands")
    run_parser = commands.add_parser("run", help="run suites")
    run_parser.add_argument("suites", nargs="+", metavar="SUITE[@TREE]")
    run_parser.add_argument("--out", type=pathlib.Path, default=REPO / "runs" / "benchmarks",
                            help="where the JSON results and logs go (default runs/benchmarks, git-ignored)")
    run_parser.add_argument("--budget", type=float, default=float("inf"),
                            help="seconds for all suites together; a command still running at the end is stopped")
    publish_parser = commands.add_parser("publish", help="copy a run's results into benchmarks/results/")
    publish_parser.add_argument("source", type=pathlib.Path)
    commands.add_parser("page", help="rewrite benchmarks/README.md from benchmarks/results/")
    args = parser.parse_args(argv)
    if args.command == "list":
        for name, (what, commands_) in suites(_gpu_count()).items():
            print(f"{name}: {what}")
            for command in commands_:
                print("    " + " ".join(command))
        return 0
    if args.command == "run":
        return 1 if run(args.suites, args.out, args.budget) else 0
    if args.command == "publish":
        publish(args.source)
    else:
        write_page()
    return 0


if __name__ == "__main__":
    sys.exit(main())
