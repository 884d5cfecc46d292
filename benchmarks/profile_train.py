"""Where a train step's GPU time goes: profile one row of benchmarks/train.py and print its top kernels.

  python benchmarks/profile_train.py --row int8_rowwise             # ~1.1B Llama, batch 8 x 2048, on a GPU
  python benchmarks/profile_train.py --row bf16 --small             # tiny model (CPU: host ops, no GPU events)

Runs --warmup steps, then --steps steps under `jax.profiler.trace`, reads the trace's `*.trace.json.gz` (written by
jax itself, no TensorBoard plugin needed) and sums the duration of every device event per HLO op. Prints per step:
the total device time, the idle time between kernels (host dispatch, launch latency), a breakdown by category
(cuBLAS/cuDNN GEMMs, Pallas kernels, attention, XLA fusions), the --top ops with their kernel names (--dump-hlo
writes the optimized HLO those fusion names come from) and the --top longest idle gaps.
The trace folder (--trace-dir) can be opened in Perfetto or TensorBoard.
"""

import argparse
import collections
import functools
import gzip
import json
import pathlib
import sys
import tempfile

from train import add_model_args, build_row, resolve_model_args, row_name

# Category by kernel-name substring, first match wins (cuBLAS/cuDNN/Mosaic GPU naming as seen on Hopper).
CATEGORIES = (("attention", ("fmha", "flash", "cudnn", "sdpa")),
              ("gemm (cuBLAS, XLA Triton)", ("gemm", "nvjet", "xmma", "cutlass", "cublas")),
              ("pallas", ("mosaic", "pallas", "qjax")),
              ("copy/memset", ("memcpy", "memset")),
              ("collective (NCCL)", ("nccl", "all-gather", "all_gather", "reduce-scatter", "reduce_scatter",
                                     "all-reduce", "all_reduce")))


def category(kernel: str, hlo_op: str) -> str:
    text = f"{kernel} {hlo_op}".lower()
    for name, needles in CATEGORIES:
        if any(n in text for n in needles):
            return name
    return "xla fusion / other"


def device_events(trace_dir: pathlib.Path) -> list[tuple[float, float, str, str]]:
    """(start us, duration us, hlo op or kernel name, kernel name) of every kernel on a CUDA stream of the first
    GPU (under a mesh every GPU runs the same program), newest trace."""
    trace_file = max(trace_dir.glob("plugins/profile/*/*.trace.json.gz"), key=lambda p: p.stat().st_mtime)
    events = json.load(gzip.open(trace_file))["traceEvents"]
    gpus = sorted((e["args"]["name"], e["pid"]) for e in events if e.get("ph") == "M"
                  and e.get("name") == "process_name" and "/device:" in e["args"].get("name", "")
                  and "CPU" not in e["args"]["name"])
    device_pids = {gpus[0][1]} if gpus else set()
    # A GPU's process also holds derived lines ("XLA Ops", "XLA Modules", "Steps") that repeat the kernels' time:
    # count the CUDA stream lines only.
    stream_tids = {(e["pid"], e["tid"]) for e in events if e.get("ph") == "M" and e.get("name") == "thread_name"
                   and e["pid"] in device_pids and e["args"].get("name", "").startswith("Stream")}
    out = []
    for e in events:
        if e.get("ph") != "X" or (e.get("pid"), e.get("tid")) not in stream_tids:
            continue
        # Under CUDA graphs every kernel's hlo_op is the command buffer: key by the kernel's own name, which for
        # XLA's kernels is the fusion's name in the optimized HLO.
        hlo_op = e.get("args", {}).get("hlo_op", "")
        key = e["name"] if not hlo_op or hlo_op.startswith("command_buffer") else hlo_op
        out.append((float(e["ts"]), float(e.get("dur", 0.0)), key, e["name"]))
    return sorted(out)


def device_ops(events) -> dict:
    """{hlo op or kernel name: [total us, count, kernel name]} over `device_events`."""
    ops = collections.defaultdict(lambda: [0.0, 0, ""])
    for _, dur, key, kernel in events:
        ops[key][0] += dur
        ops[key][1] += 1
        ops[key][2] = kernel
    return dict(ops)


def idle_gaps(events) -> tuple[float, float, list[tuple[float, str, str, str]]]:
    """Span from the first kernel's start to the last one's end, the time no kernel ran in it (us), and the gaps
    between kernels as (us, op before, op after, kernel after), largest first. Idle time is what a faster kernel cannot
    win back: host dispatch, synchronisation, launch latency."""
    gaps, busy_until, previous = [], None, ""
    for start, dur, key, kernel in events:
        if busy_until is not None and start > busy_until:
            gaps.append((start - busy_until, previous, key, kernel))
        if busy_until is None or start + dur >= busy_until:
            busy_until, previous = start + dur, key
    span = busy_until - events[0][0]
    return span, sum(g[0] for g in gaps), sorted(gaps, reverse=True)

def main():
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--row", default="int8_rowwise", type=row_name)
    add_model_args(parser)
    parser.add_argument("--steps", type=int, default=3, help="profiled steps (after --warmup)")
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--top", type=int, default=30)
    parser.add_argument("--trace-dir", help="where the trace goes (default: a temporary folder)")
    parser.add_argument("--dump-hlo", help="also write the step's optimized HLO to this file (maps fusion names to ops)")
    args = parser.parse_args()
    if args.steps < 1:
        raise ValueError(f"--steps must be >= 1, got {args.steps}")

    import jax

    resolve_model_args(args)
    state, train_step, batch, _ = build_row(args.row, args)
    train_step = train_step.lower(state, batch).compile()  # compiled once, for the HLO dump and the steps
    if args.dump_hlo:
        pathlib.Path(args.dump_hlo).write_text(train_step.as_text())
    for _ in range(args.warmup):
        state, metrics = train_step(state, batch)
    jax.block_until_ready(state)
    trace_dir = pathlib.Path(args.trace_dir or tempfile.mkdtemp(prefix="qjax_profile_"))
    with jax.profiler.trace(str(trace_dir)):
        for _ in range(args.steps):
            state, metrics = train_step(state, batch)
        jax.block_until_ready((state, metrics))

    print(f"{args.row}: Llama {args.size}, batch {args.batch} x seq {args.seq}, {jax.devices()[0].device_kind}; "
          f"trace in {trace_dir}")
    print_report(device_events(trace_dir), args.steps, args.top)


def category_ms(events, steps: int) -> dict[str, float]:
    """{category: ms per step} of `events` (`device_events`) over `steps` steps, and "idle": the time no kernel
    ran between the first kernel and the last."""
    out = collections.Counter()
    for key, (us, _, kernel) in device_ops(events).items():
        out[category(kernel, key)] += us / steps / 1e3
    if events:
        out["idle"] = idle_gaps(events)[1] / steps / 1e3
    return dict(out)


def print_report(events, steps: int, top: int, file=None) -> None:
    """The per-step tables of `events` (`device_events`) over `steps` profiled steps: device time and idle time,
    time by category, the `top` ops and the `top` longest idle gaps; to `file` (default stdout)."""
    say = functools.partial(print, file=file or sys.stdout)
    ops = device_ops(events)
    if not ops:
        say("no device events in the trace (a CPU run records host ops only)")
        return
    total = sum(us for us, _, _ in ops.values()) / steps
    by_category = collections.Counter()
    for key, (us, _, kernel) in ops.items():
        by_category[category(kernel, key)] += us / steps
    span, idle, gaps = idle_gaps(events)
    over_5us = sum(g[0] for g in gaps if g[0] > 5)
    say(f"\ndevice time per step: {total / 1e3:.2f} ms (sum over events; streams may overlap); first kernel to last: "
        f"{span / steps / 1e3:.2f} ms, of it idle (no kernel running) {idle / steps / 1e3:.2f} ms in "
        f"{len(gaps) / steps:g} gaps; gaps over 5 us: {over_5us / steps / 1e3:.2f} ms\n")
    idle_before = collections.Counter()  # idle time by the category of the kernel that ends the gap
    for gap, _, key, kernel in gaps:
        idle_before[category(kernel, key)] += gap / steps
    say("| category | ms / step | share | idle before its kernels, ms / step |\n|---|---:|---:|---:|")
    for name, us in by_category.most_common():
        say(f"| {name} | {us / 1e3:.2f} | {us / total:.1%} | {idle_before[name] / 1e3:.2f} |")
    say("\n| hlo op | kernel | ms / step | calls / step | share |\n|---|---|---:|---:|---:|")
    for key, (us, count, kernel) in sorted(ops.items(), key=lambda kv: -kv[1][0])[:top]:
        say(f"| {key[:60]} | {kernel[:70]} | {us / steps / 1e3:.3f} | {count / steps:g} | {us / steps / total:.1%} |")
    say("\n| idle gap (us) | previous kernel | next kernel |\n|---:|---|---|")
    for gap, before, after, _ in gaps[:top]:
        say(f"| {gap:.1f} | {before[:60]} | {after[:60]} |")


if __name__ == "__main__":
    main()
