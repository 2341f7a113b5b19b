"""``paraplan profile``: the per-block table of a model (terminal, file or JSON)."""

from __future__ import annotations

import json
import os

from paraplan.profiler import ProfileError, profile_model
from paraplan.profiler.measurements import save_measurements

from .output import human, output_path_problem, print_json, stderr, stdout, table


def _fmt_ms(v):
    return "-" if v is None else f"{v:.3f}"


def _tp_degrees(profile) -> list[int]:
    """The tensor-parallel degrees whose per-rank view was asked for (``--tp``)."""
    return sorted({t for x in profile.layers for t in x.tp_views})


def _collective_bytes(collectives) -> int:
    """The sizes of the tensors a rank's tensor-parallel collectives produce or reduce per micro-batch, forward and
    backward summed (records.Collective.bytes; what the wire carries follows from each op and the degree)."""
    return sum(c.bytes for c in collectives)


def _tp_columns(layer, tp: int) -> dict[str, int]:
    """One block's per-rank view at tensor-parallel degree ``tp`` (profiler/tp_view.py), as flat columns: what the
    table file holds beside the whole block's (``--tp`` was asked for: it must show)."""
    v = layer.tp_views[tp]
    return {f"tp{tp}_fwd_flops": v.fwd_flops, f"tp{tp}_bwd_flops": v.bwd_flops, f"tp{tp}_param_bytes": v.param_bytes,
            f"tp{tp}_activation_bytes": v.activation_bytes, f"tp{tp}_activation_bytes_sp": v.activation_bytes_sp,
            f"tp{tp}_collective_bytes": _collective_bytes(v.collectives),
            f"tp{tp}_collective_bytes_sp": _collective_bytes(v.collectives_sp)}


def write_table(profile, path: str) -> None:
    import pandas as pd

    tps = _tp_degrees(profile)
    rows = [{**x.public_dict(), **{k: val for t in tps for k, val in _tp_columns(x, t).items()}}
            for x in profile.layers]
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
    for tp in _tp_degrees(profile):  # per rank: what each of the tp ranks holds, computes and sends
        rows = []
        for x in profile.layers:
            c = _tp_columns(x, tp)
            rows.append([x.name, human(c[f"tp{tp}_param_bytes"], "B"),
                         human(c[f"tp{tp}_fwd_flops"]), human(c[f"tp{tp}_bwd_flops"]),
                         human(c[f"tp{tp}_activation_bytes"], "B"), human(c[f"tp{tp}_activation_bytes_sp"], "B"),
                         human(c[f"tp{tp}_collective_bytes"], "B"), human(c[f"tp{tp}_collective_bytes_sp"], "B")])
        stdout.print(table(f"per rank at tensor parallelism {tp} (sp: with sequence parallelism; collectives: the "
                           "tensors they produce or reduce per micro-batch)",
                           ["block", "param bytes", "fwd FLOPs", "bwd FLOPs", "saved act.", "saved act. sp",
                            "collectives", "collectives sp"], rows, justify_right_from=1))
    active = profile.active_parameters
    active_note = f" ({human(active)} active per token)" if active != profile.num_parameters else ""
    stdout.print(f"parameters {human(profile.num_parameters)}{active_note}   "
                 f"forward {human(profile.total_fwd_flops)}FLOP   "
                 f"backward {human(profile.total_bwd_flops)}FLOP per micro-batch")
    return 0
