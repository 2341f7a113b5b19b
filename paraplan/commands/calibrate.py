"""``paraplan calibrate``: measure this machine (or, under torchrun, the cluster) into a hardware spec."""

from __future__ import annotations

from paraplan.executor.calibrate import calibrate_cluster, check_ranks

from .output import print_json, stderr, stdout, table


def run(args) -> int:
    import os

    if int(os.environ.get("WORLD_SIZE", "1")) == 1:  # alone: this machine's processes
        check_ranks(args.cluster, args.ranks)
    stderr.print(f"calibrating {args.cluster}: GEMMs, memory bandwidth, per-kernel overhead, collectives over "
                 f"{args.ranks} processes{' (quick)' if args.quick else ''}...")
    path, cal, spec = calibrate_cluster(args.cluster, args.ranks, args.quick, args.out)
    if path is None:  # a non-zero rank under torchrun
        return 0
    gpu, link = spec["gpu"], spec["intra_node"]
    if args.json:
        print_json({"spec_file": str(path), "seconds": cal.seconds, "phase_seconds": cal.phase_seconds,
                    "load_before": cal.load_before, "notes": [cal.busy_note] if cal.busy_note else [],
                    "machine": cal.machine, "threads_per_rank": cal.threads,
                    "peak_tflops": gpu["peak_tflops"], "hbm_GBps": gpu["hbm_GBps"],
                    "op_overhead_us": gpu["efficiency"]["op_overhead_us"], "matmul": gpu["efficiency"]["matmul"],
                    "intra_node": link, "collectives": [list(c) for c in cal.collectives],
                    "framework_us": cal.framework_us, "framework_runs": cal.framework_runs})
        return 0
    rows = [[d, f"{v:.4g}" if v else "-"] for d, v in gpu["peak_tflops"].items()]
    stdout.print(table(f"{gpu['name']}: best GEMM rate per dtype (TFLOP/s), {cal.threads} thread(s) per rank",
                       ["dtype", "TFLOP/s"], rows))
    stdout.print(f"memory bandwidth {gpu['hbm_GBps']:.3g} GB/s per rank; {gpu['efficiency']['op_overhead_us']:.3g} µs "
                 f"per kernel; link {link['bandwidth_GBps']:.3g} GB/s, {link['latency_us']:.3g} µs latency "
                 f"({len(cal.collectives)} collective timings)")
    if cal.framework_us:
        fit = ", ".join(f"{k} {v:.3g}" for k, v in cal.framework_us.items())
        errs = [abs(r["predicted_s"] / r["measured_s"] - 1) for r in cal.framework_runs]
        stdout.print(f"framework cost per event (µs): {fit}; fitted to {len(errs)} executor runs of "
                     f"llama-tiny, mean error {100 * sum(errs) / len(errs):.1f}%")
    stdout.print(f"spec written to {path} ({cal.seconds:.0f} s); plan/simulate/validate on '{args.cluster}' use it now")
    if cal.busy_note:
        stderr.print(f"note: {cal.busy_note}", markup=False)
    return 0
