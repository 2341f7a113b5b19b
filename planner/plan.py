"""The Plan: what the planner picks, ``simulate --write-plan`` writes and ``execute`` runs (DESIGN.md).

One object passes from planner to simulator to executor: the layout, the stage boundaries (module
names per pipeline stage, in stage order) and the prediction. The executor never decides a layout
by itself; it validates the plan against the model and refuses one that does not fit.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import dataclass, field
from typing import Any

from paraplan.hardware_specs import ClusterSpec, HardwareSpecError, cluster_from_mapping, load_cluster, read_data_file

from .atomic import atomic_open
from .compute import ATTENTION_KERNELS
from .errors import InvalidLayout, PlanError
from .framework import FRAMEWORKS
from .layout import RECOMPUTE, Layout

PLAN_KEYS = ("model", "cluster", "global_batch", "micro_batch", "num_micro_batches", "dp", "tp", "pp", "schedule",
             "virtual_stages", "zero", "recompute", "sequence_parallel", "dtype", "seed", "stages")
OPTIONAL_KEYS = ("prediction", "layer_strategies", "model_spec", "seq_length", "nodes", "dp_mode", "ps_servers",
                 "ps_staleness", "stage_recompute", "attention", "cp", "ep", "etp", "framework", "framework_switches",
                 "cluster_spec", "model_numerics")


@dataclass
class Plan:
    model: str
    cluster: str
    layout: Layout
    stages: list[list[str]]
    seed: int = 0
    model_spec: dict[str, Any] | None = None  # the spec itself, so a plan runs where the model file is not
    # a cluster file's spec itself (hardware_specs.cluster_mapping), so the plan reads the same where the file is not
    # (a named cluster is the package's everywhere; 'local' is each machine's own calibration)
    cluster_spec: dict[str, Any] | None = None
    seq_length: int | None = None
    nodes: int | None = None
    stage_recompute: list[str] | None = None  # per stage, when the planner chose recomputation per stage
    layer_strategies: dict[str, dict[str, Any]] = field(default_factory=dict)
    attention: str = "flash"
    framework: str = "paraplan"  # the software stack the prediction prices (paraplan = this executor)
    # the framework switches the prediction was priced with (framework.switches_of: --optimizer-states, ...)
    framework_switches: dict[str, Any] = field(default_factory=dict)
    prediction: dict[str, Any] | None = None
    # an HF config.json's numerics the spec does not carry ({"rope_theta", "rms_norm_eps", "rope_scaling", "source"}:
    # read where the plan was made), so exports read them where the config file is not
    model_numerics: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        lay = self.layout
        out: dict[str, Any] = {
            "model": self.model, "cluster": self.cluster, "global_batch": lay.global_batch,
            "micro_batch": lay.micro_batch, "num_micro_batches": lay.num_micro_batches, "dp": lay.dp, "tp": lay.tp,
            "pp": lay.pp, "schedule": lay.schedule, "virtual_stages": lay.virtual_stages, "zero": lay.zero,
            "recompute": lay.recompute, "sequence_parallel": lay.sequence_parallel, "dtype": lay.dtype,
            "seed": self.seed, "stages": self.stages, "dp_mode": lay.dp_mode, "ps_servers": lay.ps_servers,
            "ps_staleness": lay.ps_staleness, "seq_length": self.seq_length, "nodes": self.nodes,
            "attention": self.attention, "model_spec": self.model_spec, "cp": lay.cp, "ep": lay.ep, "etp": lay.etp,
            "framework": self.framework,
        }
        if self.framework_switches:
            out["framework_switches"] = dict(self.framework_switches)
        if self.cluster_spec is not None:
            out["cluster_spec"] = self.cluster_spec
        if self.model_numerics is not None:
            out["model_numerics"] = self.model_numerics
        if self.stage_recompute is not None:
            out["stage_recompute"] = self.stage_recompute
        strategies = dict(self.layer_strategies)
        if lay.head_parallel > 1:
            strategies["head"] = {"parallel": "tensor", "degree": lay.head_parallel}
        if strategies:
            out["layer_strategies"] = strategies
        if self.prediction is not None:
            out["prediction"] = self.prediction
        return out

    def load_cluster(self) -> ClusterSpec:
        """The plan's cluster for its ``nodes``: the spec it carries, else its name or file as found here
        (HardwareSpecError where neither is known)."""
        if self.cluster_spec is not None:
            return cluster_from_mapping(self.cluster_spec, f"{self.cluster} (the plan's cluster_spec)").with_nodes(
                self.nodes or self.cluster_spec["nodes"])
        return load_cluster(self.cluster, nodes=self.nodes)

    def memory_warning(self) -> str | None:
        """Why this plan will run out of GPU memory, by its own prediction (``simulate --write-plan`` writes plans
        that do not fit, on request), as one line for the commands that launch or export it; None when it fits
        or says nothing."""
        pred = self.prediction or {}
        peak, capacity = pred.get("peak_memory_gib"), pred.get("memory_capacity_gib")
        if pred.get("fits") is not False or not isinstance(peak, int | float) or not isinstance(capacity, int | float):
            return None
        return (f"the plan does not fit: its prediction needs {peak:.1f} GiB per GPU of {capacity:.0f} on "
                f"{self.cluster}; expect the run to fail out of memory (paraplan plan finds a layout that fits)")

    def write(self, path: str) -> None:
        try:
            with atomic_open(path) as f:
                json.dump(self.to_dict(), f, indent=1)
                f.write("\n")
        except OSError as e:
            raise PlanError(f"cannot write plan {path}: {e.strerror}") from None

    @classmethod
    def from_dict(cls, data: Any, source: str = "plan") -> Plan:
        if not isinstance(data, dict):
            raise PlanError(f"{source}: a plan must be a JSON object")
        missing = [k for k in PLAN_KEYS if k not in data]
        if missing:
            raise PlanError(f"{source}: missing key '{missing[0]}'")
        unknown = [k for k in data if k not in PLAN_KEYS and k not in OPTIONAL_KEYS and k != "num_micro_batches"]
        if unknown:
            raise PlanError(f"{source}: unknown key '{unknown[0]}'")
        ints = ("global_batch", "micro_batch", "dp", "tp", "pp", "virtual_stages", "zero", "seed", "cp", "ep", "etp",
                "ps_servers", "ps_staleness")
        for k in ints:
            if k in data and (isinstance(data[k], bool) or not isinstance(data[k], int)):
                raise PlanError(f"{source}: '{k}' must be a whole number, got {data[k]!r}")
        framework = data.get("framework", "paraplan")
        if framework not in FRAMEWORKS:
            raise PlanError(f"{source}: unknown framework {framework!r} (one of {', '.join(FRAMEWORKS)})")
        switches = _framework_switches({} if data.get("framework_switches") is None else data["framework_switches"],
                                       framework, source, data.get("attention", "flash"))
        for k in ("model", "cluster"):
            if not isinstance(data[k], str) or not data[k]:
                raise PlanError(f"{source}: '{k}' must be a name, got {data[k]!r}")
        if not isinstance(data["sequence_parallel"], bool):
            raise PlanError(f"{source}: 'sequence_parallel' must be true or false, got {data['sequence_parallel']!r}")
        if data.get("attention", "flash") not in ATTENTION_KERNELS:
            raise PlanError(f"{source}: 'attention' must be one of {', '.join(ATTENTION_KERNELS)}, "
                            f"got {data.get('attention')!r}")
        stages = data["stages"]
        if (not isinstance(stages, list) or not stages
                or not all(isinstance(s, list) and s and all(isinstance(n, str) for n in s) for s in stages)):
            raise PlanError(f"{source}: 'stages' must be a non-empty list of non-empty lists of module names")
        strategies = data.get("layer_strategies") or {}
        head_parallel = _head_parallel(strategies, source)
        try:
            layout = Layout(dp=data["dp"], tp=data["tp"], pp=data["pp"], micro_batch=data["micro_batch"],
                            global_batch=data["global_batch"], schedule=data["schedule"],
                            virtual_stages=data["virtual_stages"], zero=data["zero"], recompute=data["recompute"],
                            sequence_parallel=bool(data["sequence_parallel"]), dtype=data["dtype"],
                            dp_mode=data.get("dp_mode", "allreduce"), ps_servers=data.get("ps_servers", 1),
                            ps_staleness=data.get("ps_staleness", 0), head_parallel=head_parallel,
                            cp=data.get("cp", 1), ep=data.get("ep", 1), etp=data.get("etp", 1))
        except TypeError as e:
            raise PlanError(f"{source}: {e}") from None
        try:
            layout.check_fields()
        except InvalidLayout as e:
            raise PlanError(f"{source}: {e}") from None
        _check_optional(data, layout, source)
        if layout.global_batch % max(layout.dp * layout.micro_batch, 1) == 0 and \
                data["num_micro_batches"] != layout.num_micro_batches:
            raise PlanError(f"{source}: num_micro_batches {data['num_micro_batches']} disagrees with "
                            f"global_batch / (dp x micro_batch) = {layout.num_micro_batches}")
        return cls(model=str(data["model"]), cluster=str(data["cluster"]), layout=layout, stages=stages,
                   seed=data["seed"], model_spec=data.get("model_spec"), cluster_spec=data.get("cluster_spec"),
                   seq_length=data.get("seq_length"),
                   nodes=data.get("nodes"), stage_recompute=data.get("stage_recompute"),
                   layer_strategies={k: v for k, v in strategies.items() if k != "head"},
                   attention=data.get("attention", "flash"), framework=framework, framework_switches=switches,
                   prediction=_known_figures(data.get("prediction")),
                   model_numerics=_numerics(data.get("model_numerics"), source))

    @classmethod
    def read(cls, path: str) -> Plan:
        return cls.from_dict(read_data_file(path, "plan", PlanError), source=path)

    def validate_stages(self, block_names: list[str]) -> None:
        """Every block exactly once, in model order, in pp x virtual_stages non-empty stages (one PlanError line
        naming the field: ``execute`` and every export target check a plan file with it)."""
        lay = self.layout
        if len(self.stages) != lay.num_stages:
            raise PlanError(f"'stages' lists {len(self.stages)} stages but pp x virtual_stages = {lay.pp} x "
                            f"{lay.virtual_stages} = {lay.num_stages}")
        flat = [n for s in self.stages for n in s]
        known = set(block_names)
        for n in flat:
            if n not in known:
                raise PlanError(f"'stages' lists {n!r}, which is not a block of {self.model}")
        seen: set[str] = set()
        for n in flat:
            if n in seen:
                raise PlanError(f"'stages' lists block {n!r} twice")
            seen.add(n)
        missing = [n for n in block_names if n not in seen]
        if missing:
            raise PlanError(f"'stages' leaves out block {missing[0]!r} of {self.model}")
        if flat != block_names:
            at = next(i for i, (a, b) in enumerate(zip(flat, block_names, strict=True)) if a != b)
            raise PlanError(f"'stages' must hold contiguous blocks in model order: {flat[at]!r} stands where "
                            f"{block_names[at]!r} belongs")
        if self.stage_recompute is not None and len(self.stage_recompute) != lay.num_stages:
            raise PlanError("'stage_recompute' must give one mode per stage")

    def stack(self):
        """The software stack the plan was priced for (planner/framework.Framework): its framework profile with its
        attention kernel and switches."""
        from .framework import framework

        return framework(self.framework, attention=self.attention, **self.framework_switches)

    def replace(self, **changes) -> Plan:
        return dataclasses.replace(self, **changes)


def _head_parallel(strategies: object, source: str) -> int:
    """The class-sharded classifier degree a plan's ``layer_strategies`` asks for (1 = none).

    Supported: ``{"head": {"parallel": "tensor", "degree": k}}`` — the classifier of a resnet, vgg or
    mlp model sharded over k data-parallel ranks (DESIGN.md: hybrid per-layer parallelism).
    """
    if not isinstance(strategies, dict):
        raise PlanError(f"{source}: 'layer_strategies' must map module-name prefixes to strategies")
    for prefix, strat in strategies.items():
        if prefix != "head":
            raise PlanError(f"{source}: layer_strategies for {prefix!r}: only the classifier 'head' can run "
                            "differently from the rest")
        if not (isinstance(strat, dict) and strat.get("parallel") == "tensor" and set(strat) == {"parallel", "degree"}
                and isinstance(strat.get("degree"), int) and not isinstance(strat.get("degree"), bool)
                and strat["degree"] >= 1):
            raise PlanError(f"{source}: layer_strategies['head'] must be {{\"parallel\": \"tensor\", \"degree\": k}}")
    return strategies["head"]["degree"] if "head" in strategies else 1


def _framework_switches(switches: Any, framework: str, source: str, attention: Any = None) -> dict[str, Any]:
    """A plan's 'framework_switches', checked as the CLI checks them (framework.framework), beside the plan's
    attention kernel (some switches need the unfused one)."""
    from .framework import NAMED_SWITCHES, NUMBER_SWITCHES, SWITCHES
    from .framework import framework as build

    if not isinstance(switches, dict):
        raise PlanError(f"{source}: 'framework_switches' must be an object")
    for key, value in switches.items():
        if key not in SWITCHES:
            raise PlanError(f"{source}: unknown framework switch '{key}' (known: {', '.join(SWITCHES)})")
        kind = str if key in NAMED_SWITCHES else (int, float) if key in NUMBER_SWITCHES else bool
        if not isinstance(value, kind) or (kind is not bool and isinstance(value, bool)):
            raise PlanError(f"{source}: framework switch '{key}' has the wrong type: {value!r}")
    try:
        build(framework, attention=attention if attention in ATTENTION_KERNELS else None, **switches)
    except PlanError as e:
        raise PlanError(f"{source}: framework_switches: {e}") from None
    return dict(switches)


def _numerics(value: Any, source: str) -> dict[str, Any] | None:
    """The plan's model_numerics, checked: positive numbers for the RoPE base and norm eps, an object (or null) for
    the RoPE scaling, the config it came from."""
    if value is None:
        return None
    keys = ("rope_theta", "rms_norm_eps", "rope_scaling", "source")
    if not isinstance(value, dict) or set(value) != set(keys):
        raise PlanError(f"{source}: 'model_numerics' must be an object with exactly {', '.join(keys)}")
    for k in ("rope_theta", "rms_norm_eps"):
        v = value[k]
        if isinstance(v, bool) or not isinstance(v, int | float) or not 0 < v < float("inf"):
            raise PlanError(f"{source}: 'model_numerics.{k}' must be a positive number, got {v!r}")
    if value["rope_scaling"] is not None and not isinstance(value["rope_scaling"], dict):
        raise PlanError(f"{source}: 'model_numerics.rope_scaling' must be an object or null")
    if not isinstance(value["source"], str):
        raise PlanError(f"{source}: 'model_numerics.source' must be a file name")
    return dict(value)


def hf_numerics(cfg: Any, source: str) -> dict[str, Any] | None:
    """An HF config's RoPE base, RMSNorm eps and RoPE scaling (transformers' defaults, 10,000 and 1e-5, where it has
    none; a Llama 4 wrapper's from its text_config), as plan.json's model_numerics; None for anything else (a paraplan
    spec written as JSON) or values no plan could be read back with."""
    if isinstance(cfg, dict) and isinstance(cfg.get("text_config"), dict):  # Llama 4's wrapper
        cfg = {**cfg["text_config"], "model_type": cfg.get("model_type")}
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        return None
    try:
        theta, eps = float(cfg.get("rope_theta", 10000.0)), float(cfg.get("rms_norm_eps", 1e-5))
    except (ValueError, TypeError):
        return None
    if not (0 < theta < float("inf") and 0 < eps < float("inf")):
        return None
    scaling = cfg.get("rope_scaling")
    return {"rope_theta": theta, "rms_norm_eps": eps, "rope_scaling": scaling if isinstance(scaling, dict) else None,
            "source": source}


def config_numerics(path: str) -> dict[str, Any] | None:
    """:func:`hf_numerics` of the config.json at ``path`` (what the planner read the model from); None where it is
    no readable HF config (a paraplan spec, a preset)."""
    import json

    if not path.endswith(".json"):
        return None
    try:
        with open(path) as f:
            return hf_numerics(json.load(f), path)
    except (OSError, ValueError):
        return None


def _check_optional(data: dict, layout: Layout, source: str) -> None:
    """The optional keys' types and ranges: sizes positive whole numbers (or null), one known recomputation mode
    per stage, a prediction object whose figures are numbers."""
    for k in ("seq_length", "nodes"):
        v = data.get(k)
        if v is not None and (isinstance(v, bool) or not isinstance(v, int) or v <= 0):
            raise PlanError(f"{source}: '{k}' must be a positive whole number or null, got {v!r}")
    spec = data.get("model_spec")
    ref = data["model"]
    if isinstance(spec, dict) and isinstance(spec.get("name"), str) and spec["name"] != ref \
            and not any(c in ref for c in "/\\:") and not ref.endswith((".yaml", ".yml", ".json")):
        # a model named (not a file): the plan trains model_spec, its exports are labelled by 'model'
        raise PlanError(f"{source}: 'model' {ref!r} disagrees with 'model_spec', which describes {spec['name']!r} "
                        "(the model the plan trains): edit both, or neither")
    cluster = data.get("cluster_spec")
    if cluster is not None:
        try:
            cluster_from_mapping(cluster, f"{source}: 'cluster_spec'")
        except HardwareSpecError as e:
            raise PlanError(str(e)) from None
    modes = data.get("stage_recompute")
    if modes is not None:
        if not isinstance(modes, list) or len(modes) != layout.num_stages or \
                not all(isinstance(m, str) and m in RECOMPUTE for m in modes):
            raise PlanError(f"{source}: 'stage_recompute' must list one of {', '.join(RECOMPUTE)} for each of the "
                            f"{layout.num_stages} stages, got {modes!r}")
    pred = data.get("prediction")
    if pred is not None:  # (a null figure is read as a missing one: _known_figures)
        if not isinstance(pred, dict):
            raise PlanError(f"{source}: 'prediction' must be an object or null")
        for k in ("iteration_time_s", "peak_memory_gib"):  # the figures a plan's readers print
            v = pred.get(k)
            if v is not None and (isinstance(v, bool) or not isinstance(v, int | float)):
                raise PlanError(f"{source}: prediction '{k}' must be a number, got {v!r}")


def _known_figures(prediction: dict | None) -> dict | None:
    """A plan's prediction without its null figures: a reader treats a null like a figure left out (a run printed
    every step, then failed to format a null peak memory and lost its record)."""
    if prediction is None:
        return None
    return {k: v for k, v in prediction.items() if v is not None}


def calibration_notes(work, validating: bool = False) -> tuple[bool, list[str]]:
    """(calibrated, notes) of the predictions on ``work``'s cluster: the calibration's word (calibrated, or
    uncalibrated and why; measurements found but not used) and the workload's own notes, each once."""
    from paraplan.hardware_specs.identity import calibration_status

    calibrated, notes = calibration_status(work.cluster, validating)
    return calibrated, notes + [n for n in work.notes if n not in notes]


def label_prediction(plan, work) -> None:
    """A plan file's prediction says whether the hardware figures were calibrated and carries the notes that
    say so (uncalibrated, measurements not used), as the command's output does."""
    calibrated, notes = calibration_notes(work)
    plan.prediction["calibrated"] = calibrated
    own = list(plan.prediction.get("notes") or [])
    plan.prediction["notes"] = own + [n for n in notes if n not in own]
