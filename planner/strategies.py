"""Strategies as users write them on the command line: ``"tp=8,pp=4,dp=2,zero=1"``.

Keys: dp, tp, pp, cp (context parallel), ep and etp (expert and expert-tensor parallel),
mb (micro-batch), schedule, v (virtual stages), zero, recompute, sp (sequence
parallelism: 1/0, true/false), dp_mode (allreduce | ps), ps (parameter servers), staleness, head (a
class-sharded classifier over this many data-parallel ranks: hybrid parallelism for resnet/vgg/mlp).
Degrees left out follow from the GPU count: tp and pp default to 1, dp to gpus / (tp x pp).
"""

from __future__ import annotations

from .errors import PlanError
from .layout import DP_MODES, RECOMPUTE, SCHEDULES, Layout

_INT_KEYS = {"dp", "tp", "pp", "cp", "ep", "etp", "mb", "micro_batch", "v", "virtual_stages", "zero", "ps",
             "ps_servers", "staleness", "head"}
_ALIASES = {"micro_batch": "mb", "virtual_stages": "v", "ps_servers": "ps", "sequence_parallel": "sp"}
KEYS = ("dp", "tp", "pp", "cp", "ep", "etp", "mb", "schedule", "v", "zero", "recompute", "sp", "dp_mode", "ps",
        "staleness", "head")


def parse_strategy(text: str) -> dict:
    """``"tp=8,pp=4"`` -> {"tp": 8, "pp": 4}; one clear error for anything else."""
    out: dict = {}
    if not text.strip():
        raise PlanError('--strategy: empty strategy; write e.g. "tp=8,pp=4,dp=2,zero=1"')
    for part in text.split(","):
        key, sep, value = part.strip().partition("=")
        key = _ALIASES.get(key.strip(), key.strip())
        value = value.strip()
        if not sep or not key or not value:
            raise PlanError(f"--strategy {text!r}: {part.strip()!r} is not key=value")
        if key not in KEYS:
            raise PlanError(f"--strategy {text!r}: unknown key {key!r} (known: {', '.join(KEYS)})")
        if key in out:
            raise PlanError(f"--strategy {text!r}: {key} given twice")
        if key in _INT_KEYS:
            if not (value.isascii() and value.isdigit()) or (int(value) <= 0 and key not in ("zero", "staleness")):
                raise PlanError(f"--strategy {text!r}: {key} must be a positive whole number, got {value!r}")
            out[key] = int(value)
        elif key == "sp":
            if value.lower() not in ("1", "0", "true", "false", "on", "off"):
                raise PlanError(f"--strategy {text!r}: sp must be 1/0, true/false or on/off")
            out[key] = value.lower() in ("1", "true", "on")
        elif key == "schedule" and value not in SCHEDULES:
            raise PlanError(f"--strategy {text!r}: schedule must be one of {', '.join(SCHEDULES)}")
        elif key == "recompute" and value not in RECOMPUTE:
            raise PlanError(f"--strategy {text!r}: recompute must be one of {', '.join(RECOMPUTE)}")
        elif key == "dp_mode" and value not in DP_MODES:
            raise PlanError(f"--strategy {text!r}: dp_mode must be one of {', '.join(DP_MODES)}")
        else:
            out[key] = value
    if out.get("dp_mode") == "allreduce":
        for key in ("ps", "staleness"):
            if key in out:  # priced as all-reduce, the parameter-server field would be dropped unseen
                raise PlanError(f"--strategy {text!r}: {key} is a parameter-server setting; with dp_mode=allreduce "
                                "there are no servers (drop it, or dp_mode=ps)")
    if "staleness" in out and "ps" not in out and out.get("dp_mode") != "ps":
        raise PlanError(f"--strategy {text!r}: staleness is a parameter-server setting; add ps=N (servers) or "
                        "dp_mode=ps")
    return out


def strategy_layout(fields: dict, gpus: int | None, global_batch: int, dtype: str, text: str) -> Layout:
    """The Layout a parsed strategy describes on ``gpus`` GPUs (degrees left out are derived)."""
    tp, pp, cp = fields.get("tp", 1), fields.get("pp", 1), fields.get("cp", 1)
    if "dp" in fields:
        dp = fields["dp"]
    elif gpus is not None:
        if gpus % (tp * pp * cp):
            raise PlanError(f"--strategy {text!r}: cp x tp x pp = {cp * tp * pp} does not divide the {gpus} GPUs")
        dp = gpus // (tp * pp * cp)
    else:
        dp = 1
    if gpus is not None and dp * cp * tp * pp != gpus:
        raise PlanError(f"--strategy {text!r}: dp x cp x tp x pp = {dp * cp * tp * pp}, not the {gpus} GPUs compared")
    v = fields.get("v", 1)
    schedule = fields.get("schedule", "interleaved-1f1b" if v > 1 else "1f1b")
    return Layout(dp=dp, tp=tp, pp=pp, micro_batch=fields.get("mb", 1), global_batch=global_batch,
                  schedule=schedule, virtual_stages=v, zero=fields.get("zero", 0),
                  recompute=fields.get("recompute", "none"), sequence_parallel=fields.get("sp", False), dtype=dtype,
                  dp_mode=fields.get("dp_mode", "ps" if "ps" in fields else "allreduce"),
                  ps_servers=fields.get("ps", 1), ps_staleness=fields.get("staleness", 0),
                  head_parallel=fields.get("head", 1), cp=cp, ep=fields.get("ep", 1), etp=fields.get("etp", 1))
