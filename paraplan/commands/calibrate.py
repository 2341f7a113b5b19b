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
    notes = [cal.busy_note] if cal.busy_note else []
    if args.quick and cal.device == "cpu" and not cal.framework_us:
        # found by a QA pass: a quick calibration replaced a full one's host costs and nothing said so (a gpt-tiny
        # dp2 pp2 step predicted 0.083 s where the full one said 0.189 s and the run took 0.14 s)
        notes.append("--quick does not fit the framework's per-event host costs: this spec has none, and predictions "
                     "on it leave them out (a CPU cluster's steps come out short); calibrate without --quick fits them")
    if args.json:
        print_json({"spec_file": str(path), "seconds": cal.seconds, "phase_seconds": cal.phase_seconds,
                    "load_before": cal.load_before, "notes": notes,
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
    use = f"give --cluster {path} to plan/simulate/validate with it" if args.out else \
        f"plan/simulate/validate on '{args.cluster}' use it now"
    stdout.print(f"spec written to {path} ({cal.seconds:.0f} s); {use}")
    for note in notes:
        stderr.print(f"note: {note}", markup=False)
    return 0
