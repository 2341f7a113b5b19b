"""``paraplan profile``: the per-block table of a model (terminal, file or JSON)."""

from __future__ import annotations

import json
import os

from paraplan.profiler import ProfileError, profile_model
from paraplan.profiler.measurements import save_measurements

from .output import human, output_path_problem, print_json, stderr, stdout, table


def _fmt_ms(v):
    return "-" if v is None else f"{v:.3f}"


def write_table(profile, path: str) -> None:
    import pandas as pd

    rows = [x.public_dict() for x in profile.layers]
    df = pd.DataFrame(rows)
    ext = os.path.splitext(path)[1].lower()
    if problem := output_path_problem(path, "--out", folder=False):
        raise ProfileError(problem)
    if ext == ".csv":
        df.to_csv(path, index=False)
    elif ext == ".json":
        with open(path, "w") as f:
            json.dump(profile.to_json_dict(), f, indent=1)
    elif ext == ".parquet":
        try:
            df.to_parquet(path, index=False)
        except ImportError:
            raise ProfileError("--out .parquet needs pyarrow (pip install pyarrow)") from None
    else:
        raise ProfileError(f"--out {path}: use a .csv, .json or .parquet file name")


def run(args) -> int:
    profile = profile_model(args.model, device=args.device, micro_batch=args.micro_batch, seq_length=args.seq_len,
                            dtype=args.dtype, tp_degrees=args.tp)
    if args.out:
        write_table(profile, args.out)
    if args.save_measurements:
        path = save_measurements(profile, gpu=args.save_measurements)
        stderr.print(f"saved measured block times to {path}")
    if args.json:
        print_json(profile.to_json_dict())
        return 0
    rows = [[x.name, x.kind, human(x.params), human(x.fwd_flops), human(x.bwd_flops),
             human(x.activation_bytes, "B"), human(x.output_bytes, "B"), _fmt_ms(x.fwd_ms), _fmt_ms(x.bwd_ms)]
            for x in profile.layers]
    title = (f"{profile.model}: micro-batch {profile.micro_batch}"
             + (f", sequence {profile.seq_length}" if profile.seq_length else "")
             + f", {profile.dtype}, device {profile.device} ({profile.device_name})")
    stdout.print(table(title, ["block", "kind", "params", "fwd FLOPs", "bwd FLOPs", "saved act.", "output", "fwd ms",
                               "bwd ms"], rows, justify_right_from=2))
    active = profile.active_parameters
    active_note = f" ({human(active)} active per token)" if active != profile.num_parameters else ""
    stdout.print(f"parameters {human(profile.num_parameters)}{active_note}   "
                 f"forward {human(profile.total_fwd_flops)}FLOP   "
                 f"backward {human(profile.total_bwd_flops)}FLOP per micro-batch")
    return 0
