"""The executor's dry run (issue 12): the plan's own code at full world size on a fake process group, and the
cost model's prediction beside it — peak memory within 10% on every traced rank, bytes within 5% per kind.

The spread (benchmarks/bench_dry_run.py's) covers GPT and LLaMA, ZeRO 0-3, tensor parallelism with and
without sequence parallelism, pipelines under 1F1B, interleaving and ZB-V, recomputation none / selective /
mlp / full, with and without gradient accumulation. Sizes are small (4 layers, h=1024) so that tracing is quick; the
model states, activations, logits and collectives all matter at that size.
"""

from __future__ import annotations

import importlib.util
import json
import multiprocessing
import subprocess
import sys
from concurrent.futures import ProcessPoolExecutor

import pytest

from conftest import ROOT
from paraplan.executor.dry_run import dry_run, trace_rank
from paraplan.executor.job import Job
from paraplan.models import build_model, load_model_spec
from paraplan.planner.layout import recomputes_core

_spec = importlib.util.spec_from_file_location("bench_dry_run", ROOT / "benchmarks" / "bench_dry_run.py")
bench = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bench)

CLI = [sys.executable, "-m", "paraplan"]


def _plan(tmp_path, model: str, batch: int, flags: str) -> str:
    path = str(tmp_path / "plan.json")
    p = subprocess.run([*CLI, "simulate", "--model", model, "--cluster", "dgx-h100", "--global-batch", str(batch),
                        *flags.split(), "--write-plan", path, "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return path


def _local_plan(tmp_path, monkeypatch, model: str, flags: str, name: str = "plan.json") -> str:
    """``paraplan simulate --write-plan`` of ``model`` on this machine's cluster ("local"), global batch 8, uncalibrated
    and with no measurements of its own (the CPU dry runs of the tiny models below)."""
    monkeypatch.setenv("PARAPLAN_MEASUREMENTS", str(tmp_path / "meas"))
    monkeypatch.setenv("PARAPLAN_NO_CALIBRATE", "1")
    path = str(tmp_path / name)
    p = subprocess.run([*CLI, "simulate", "--model", model, "--cluster", "local", "--global-batch", "8", *flags.split(),
                        "--write-plan", path, "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    return path


# The default suite traces one plan of each kind (ZeRO-3 with full recomputation, TP with SP and selective
# recomputation, ZB-V under ZeRO-2, context parallelism with TP, TP with SP and MLP recomputation, DeepSeek-style
# MoE under ZeRO-3 and under selective+mlp recomputation); the rest of the spread is marked slow (CI runs it).
QUICK = {3, 5, 9, 11, 14, len(bench.SPREAD) - 4, len(bench.SPREAD) - 2}
CASES = [pytest.param(c, marks=() if i in QUICK else pytest.mark.slow,
                      id=f"{c[0].rsplit('/', 1)[-1].removesuffix('.yaml')} {c[2]}") for i, c in enumerate(bench.SPREAD)]


@pytest.mark.parametrize("case", CASES)
def test_prediction_matches_the_trace(tmp_path, case):
    model, batch, flags = case
    job = Job.load(_plan(tmp_path, model, batch, flags))
    result = dry_run(job, "cuda").to_dict()
    assert len(result["ranks"]) == job.layout.pp  # one traced rank per pipeline stage
    for rank in result["ranks"]:
        peak_err, _, traffic_err, _ = bench.errors(rank)
        assert abs(peak_err) <= 0.10, (rank["rank"], rank["peak_memory_gib"], rank["predicted_memory_gib"])
        assert traffic_err <= 0.05, (rank["rank"], rank["comm_bytes"], rank["predicted_comm_bytes"])
        # the flash kernels' backward recomputes the scores, a matmul the model's FLOPs leave out (0.5-2.5% on this
        # spread; the MoE plans' within that too: the MoE block's GEMMs divided over tp as each rank routes its own
        # tokens, its recomputed experts at the mean rank's load, MLA's down-projections whole on every rank as the
        # executor runs them). Known: MLA's selective recomputation is counted 2-2.2% above the trace, exactly its
        # probabilities x V matmul: MLA's value head differs from its query/key head, the trace runs its attention as
        # separate matmuls, and the early-stopping checkpoint skips the last, whose output nothing saves (a fused
        # kernel saves its output for its backward: on a GPU it reruns, as priced)
        mla_selective = bool(getattr(job.spec, "kv_lora_rank", 0)) and recomputes_core(job.layout.recompute)
        high = 0.03 if mla_selective else 0.001
        assert -0.03 <= rank["predicted_flops"] / rank["flops"] - 1 <= high, \
            (rank["rank"], rank["flops"], rank["predicted_flops"])


def test_cli_contract_and_table(tmp_path):
    plan = _plan(tmp_path, "gpt-tiny", 8, "--dp 2 --tp 1 --pp 2 --micro-batch 2")
    p = subprocess.run([*CLI, "execute", "--plan", plan, "--dry-run", "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    r = json.loads(p.stdout)
    assert r["dry_run"] is True and r["world_size"] == 4 and r["fits"] is True
    assert [x["pp_rank"] for x in r["ranks"]] == [0, 1]
    for x in r["ranks"]:
        assert set(x["memory_gib"]) == {"params", "grads", "optimizer", "activations", "other"}
        assert set(x["comm_bytes"]) == set(x["predicted_comm_bytes"]) == set(bench_kinds())
        assert x["comm_bytes"]["send_recv"] > 0  # the pipeline's sends and receives
    assert r["peak_memory_gib"] == max(x["peak_memory_gib"] for x in r["ranks"])
    p = subprocess.run([*CLI, "execute", "--plan", plan, "--dry-run"], capture_output=True, text=True)
    assert p.returncode == 0 and "traced peak" in p.stdout and "all_reduce" in p.stdout


def bench_kinds():
    return ("all_reduce", "all_gather", "reduce_scatter", "all_to_all", "send_recv")


def test_a_plan_the_executor_cannot_run_fails_in_one_line(tmp_path):
    plan = _plan(tmp_path, "gpt-tiny", 8, "--dp 1 --tp 2 --pp 1 --micro-batch 2")
    data = json.loads(open(plan).read())
    data["tp"] = 3  # the executor shards whole heads: 3 does not divide gpt-tiny's 4
    with open(plan, "w") as f:
        json.dump(data, f)
    p = subprocess.run([*CLI, "execute", "--plan", plan, "--dry-run"], capture_output=True, text=True)
    assert p.returncode == 2 and "Traceback" not in p.stderr
    assert len(p.stderr.strip().splitlines()) == 1 and "tp 3" in p.stderr


def test_plan_verify_drops_a_plan_whose_trace_does_not_fit(tmp_path, monkeypatch):
    """plan --verify: the first plan's traced peak exceeds the GPU, so the next one is chosen and the report says
    both (the dry run is stubbed here with a verdict; the tests above check the dry run itself)."""
    import paraplan.executor.dry_run as dr
    from paraplan.commands.plan import verify_by_dry_run
    from paraplan.planner.search import search
    from paraplan.planner.workload import Workload

    work = Workload.create("gpt-tiny", "dgx-h100", 16, nodes=1)
    result = search(work, 2, top_k=3)
    first = result.best
    verdicts = iter([False, True])

    class Traced:
        def __init__(self, fits):
            self.fits = fits

        def to_dict(self):
            return {"fits": self.fits, "peak_memory_gib": 99.0 if not self.fits else 1.0}

    monkeypatch.setattr(dr, "dry_run", lambda job, device, progress: Traced(next(verdicts)))
    assert verify_by_dry_run(result, work, quiet=True) == [first]  # those left out, in the order tried
    assert result.best is not first and first.status == "traced oom"
    assert result.best.traced_peak_gib == 1.0
    assert "99.0 GiB" in first.status_text()


@pytest.mark.slow
def test_the_readme_demo_plan_fits_by_its_trace(tmp_path):
    """The README's example: llama2-70b on 8 DGX H100 nodes, global batch 512 — the planner's pick dry-runs
    at full world size (64 ranks) and fits 80 GiB by the trace, within 10% of the prediction on every rank, and the
    plan's peak (its fullest rank's) within 2%: dp8 tp2 pp4 1F1B ZeRO-3 traced 73.31 GiB, priced 73.97 (75.50 while
    the flash kernel's output was priced twice and the weight gradients of the unit in its backward not at all)."""
    out = tmp_path / "report"
    p = subprocess.run([*CLI, "plan", "--out", str(out), "--no-charts", "--json"], capture_output=True, text=True)
    assert p.returncode == 0, p.stderr
    job = Job.load(str(out / "plan.json"))
    result = dry_run(job, "cuda").to_dict()
    assert result["world_size"] == 64 and result["fits"] is True
    for rank in result["ranks"]:
        assert abs(bench.errors(rank)[0]) <= 0.10
    assert result["predicted_peak_memory_gib"] == pytest.approx(result["peak_memory_gib"], rel=0.02)


@pytest.mark.parametrize("flags", ["--dp 2 --tp 1 --pp 1 --micro-batch 2 --zero 3 --recompute full",
                                   "--dp 2 --tp 1 --pp 1 --micro-batch 2 --zero 1"])
def test_a_model_without_a_pipeline_peaks_at_its_loss_or_its_layers_backward(tmp_path, flags):
    """Without a pipeline the peak is either the loss's backward (its working set, no unit gathered, no weight gradient
    or reduce buffer yet) or a layer's backward (gathered units, the root's too under ZeRO-3, a layer's 16-bit weight
    gradients and the reduce buffer; the head's activations freed): costmodel._loss_moments prices both apart.
    Priced together, llama-small's plans below came 7.7% (ZeRO-3, full recomputation) and 1.7% (ZeRO-1) over their
    traces; now within 0.5%, the weights to the byte."""
    job = Job.load(_plan(tmp_path, bench.MODEL, 16, flags))
    rank = dry_run(job, "cuda").to_dict()["ranks"][0]
    assert rank["predicted_memory_gib"] == pytest.approx(rank["peak_memory_gib"], rel=0.005)
    traced, priced = rank["memory_gib"]["params"], rank["predicted_memory_breakdown_gib"]["params"]
    assert traced * 2**30 == pytest.approx(priced * 2**30, abs=1)


@pytest.mark.parametrize("flags", ["--dp 2 --tp 1 --pp 2 --micro-batch 1 --zero 3",
                                   pytest.param("--dp 2 --tp 1 --pp 2 --micro-batch 1 --zero 3 --schedule gpipe",
                                                marks=pytest.mark.slow)])
def test_a_pipelines_last_rank_peaks_at_its_loss_or_its_layers_backward(tmp_path, flags):
    """A pipeline's last rank under 1F1B or GPipe holds the loss's stage alone: its peak is the loss's backward (no
    unit gathered, no layer's gradient; the root unit's reduce buffer of the micro-batch before, where one came
    before; under GPipe, the first backward, no gradient at all) or a layer's backward (the unit gathered, its reduce
    buffer and 16-bit gradients; the head's activations freed), priced apart as without a pipeline
    (costmodel._loss_moments). llama-small dp2 pp2 ZeRO-3: priced with every transient beside the loss, 11.9% (1F1B)
    and 9.4% (GPipe) over the last rank's traced tensors; now within 0.5% of its peak."""
    job = Job.load(_plan(tmp_path, bench.MODEL, 16, flags))
    last = dry_run(job, "cuda").to_dict()["ranks"][-1]
    assert last["pp_rank"] == 1
    assert last["predicted_memory_gib"] == pytest.approx(last["peak_memory_gib"], rel=0.005)


def test_the_breakdown_counts_fsdp_buffers_as_weights_and_gradients(tmp_path, monkeypatch):
    """FSDP2 holds a prefetched unit as its all-gather's output until the unit's compute copies it out, and a unit's
    gradients as its reduce-scatter's input: the trace's breakdown counts them as weights and gradients (until this
    stop as activations, one unit short in the weights). llama-tiny dp2 pp2 1F1B ZeRO-3: at the last rank's peak the
    traced weights are the priced ones exactly — the fp32 shards, the root unit kept gathered, the unit that runs and
    the one prefetched (memory.StateBytes.unit_weights: two units)."""
    flags = "--dp 2 --tp 1 --pp 2 --micro-batch 1 --schedule 1f1b --zero 3"
    job = Job.load(_local_plan(tmp_path, monkeypatch, "llama-tiny", flags))
    last = dry_run(job, "cpu").to_dict()["ranks"][-1]
    traced, priced = last["memory_gib"]["params"], last["predicted_memory_breakdown_gib"]["params"]
    assert traced * 2**30 == pytest.approx(priced * 2**30, abs=1)


@pytest.mark.slow
@pytest.mark.parametrize("case", bench.INTERLEAVED_ZERO3, ids=lambda c: c[2].split("--virtual-stages ")[1][:1])
def test_interleaved_zero3_gathers_whole_chunks_ahead(tmp_path, case):
    """llama2-70b dp16 tp2 pp2 interleaved ZeRO-3 with full recomputation, v = 2, 4 and 6: torch's multi-stage runtime
    all-gathers whole chunks ahead of their ops (memory._state_bytes). With two chunks a rank the peak is the step's
    first op, every layer of the rank gathered (34 GB) and no activation yet; with more, a moment whose pending
    gathers and activations together are the most (schedules.peak_holdings' gathers: v = 4's rank 0 in the
    cool-down, three chunks gathered beside 6 chunk micro-batches of its most 9, and three reduce buffers: a chunk
    keeps one from its first backward to its last). Each traced rank's peak from 3% under to 4% over its prediction
    (its tensors measured: -1.8% and -1.9%; +0.9% and -0.9%; -1.2% and +1.4%). Priced before as ZeRO-2's copy kept all
    step: 9-13 GiB over these traces; then with the chunks pending near the most micro-batches: v = 4's rank 0 5.6%
    under; then with a reduce buffer for every chunk all step: v = 4's rank 0 6.3% over."""
    model, batch, flags = case
    result = dry_run(Job.load(_plan(tmp_path, model, batch, flags)), "cuda").to_dict()
    for rank in result["ranks"]:
        assert -0.03 <= bench.errors(rank)[0] <= 0.04, (rank["rank"], rank["peak_memory_gib"],
                                                         rank["predicted_memory_gib"])


@pytest.mark.parametrize("flags", ["--dp 8 --tp 1 --pp 1 --ep 4 --micro-batch 1 --zero 3",  # 1 expert over 2 ranks
                                   "--dp 8 --tp 1 --pp 1 --ep 1 --micro-batch 1 --zero 2"])  # 4 over 8 (ep 1: dense)
def test_experts_fewer_than_their_data_parallel_ranks_are_not_padded(tmp_path, flags):
    """FSDP2 pads the dimension it shards to a multiple of the ranks: a rank's experts sharded on dim 0 over more
    expert-data-parallel ranks than it has experts were padded to whole experts (the README's Mixtral plan traced
    147 GiB per GPU for 68 predicted). They shard on a dimension that divides (data_parallel.expert_shard_dim):
    the ZeRO collectives' bytes are the cost model's, to 1%."""
    job = Job.load(_plan(tmp_path, "mixtral-tiny", 16, flags))
    rank = dry_run(job, "cuda").to_dict()["ranks"][0]
    for kind in ("all_gather", "reduce_scatter"):
        assert rank["comm_bytes"][kind] == pytest.approx(rank["predicted_comm_bytes"][kind], rel=0.01), kind
    assert rank["peak_memory_gib"] == pytest.approx(rank["predicted_memory_gib"], rel=0.10)


def test_expert_shard_dim_is_the_first_that_divides():
    from paraplan.executor.data_parallel import expert_shard_dim

    assert expert_shard_dim((8, 4096, 14336), 8) == 0  # 8 experts over 8 ranks: one each
    assert expert_shard_dim((1, 4096, 14336), 8) == 1  # Mixtral ep8 over 8 ranks: the hidden dimension
    assert expert_shard_dim((6, 4096, 14336), 4) == 1
    assert expert_shard_dim((3, 5, 7), 2) == 0  # none divides: dim 0, padded


@pytest.mark.parametrize("model,flags", [
    ("mixtral-tiny", "--dp 2 --tp 1 --pp 1 --ep 2 --micro-batch 4"),  # experts replicated over a one-rank edp too
    ("llama-tiny", "--dp 2 --tp 2 --pp 1 --micro-batch 4 --sequence-parallel"),
    ("llama-tiny", "--dp 2 --tp 1 --pp 2 --micro-batch 2"),
])
def test_fp32_replicated_weights_are_held_twice(tmp_path, monkeypatch, model, flags):
    """fp32 ZeRO 0/1 under FSDP2's replicate (data parallelism beside tensor, pipeline or expert parallelism)
    all-gathers the weights into buffers of their own: the trace holds two fp32 copies, and so does the prediction
    (memory.state_bytes; it held one, 0.00187 GiB against 0.00373 traced on llama-tiny dp2 tp2)."""
    path = _local_plan(tmp_path, monkeypatch, model, flags)
    for rank in dry_run(Job.load(path), "cpu").to_dict()["ranks"]:
        traced, predicted = rank["memory_gib"]["params"], rank["predicted_memory_breakdown_gib"]["params"]
        assert predicted == pytest.approx(traced, rel=0.02), rank["rank"]


@pytest.mark.parametrize("zero", ["0", "1"])
def test_the_embedding_gradient_is_sharded_like_its_weight(tmp_path, monkeypatch, zero):
    """Tensor parallelism with ZeRO 0/1 accumulates the gradients whole on each rank: the vocabulary-sharded
    embedding's is its (V/t, h) shard, as the cost model counts it (executor/tensor_parallel.VocabParallelEmbedding).
    Through torch's RowwiseParallel the embedding's gradient came out replicated, (V, h) on every rank: llama-tiny's
    1024 x 128 fp32 embedding at tp2 held 262,144 B of gradient more than the prediction (2,265,600 against
    2,003,456 B at the peak). Gradients at the peak: every weight's shard on the rank, 4 B each (fp32)."""
    job = Job.load(_local_plan(tmp_path, monkeypatch, "llama-tiny",
                               f"--dp 2 --tp 2 --pp 1 --micro-batch 2 --zero {zero}"))
    s = job.spec  # llama-tiny: 4 layers, h 128, 4 heads of 32 (2 key/value heads), FFN 352, vocabulary 1024
    h, layers, t = s.hidden_size, s.num_layers, 2
    head_dim = h // s.num_attention_heads
    layer = (2 * h * h + 2 * h * s.kv_heads * head_dim + 3 * h * s.ffn_size) // t + 2 * h  # sharded + two norms
    shard = layers * layer + 2 * s.vocab_size * h // t + h  # + embedding and head shards, final norm
    rank = dry_run(job, "cpu").to_dict()["ranks"][0]
    assert rank["memory_gib"]["grads"] * 2**30 == 4 * shard == 2_003_456
    assert rank["predicted_memory_breakdown_gib"]["grads"] * 2**30 == pytest.approx(4 * shard, rel=1e-9)


@pytest.mark.parametrize("schedule,counts", [("1f1b", (4, 8)), ("interleaved-1f1b", (6, 10))])
def test_pipeline_memory_does_not_grow_with_the_micro_batches(tmp_path, monkeypatch, schedule, counts):
    """A pipeline rank's peak depends on the micro-batches in flight, not on how many the step runs (the dry run
    traces the fewest that reach the plan's in-flight peak, executor/dry_run.traced_micro_batches). Two things
    made it grow by a boundary per micro-batch: torch's PipelineStage allocated a receive buffer per micro-batch
    and direction for the whole run (pytorch/pytorch#136380; 8 GiB on the README's llama2-70b plan's middle
    stages), and on the last stage each micro-batch's loss, kept by the schedule until the step ends, held the
    stage input through its autograd graph. executor/pipeline.JustInTimeStage mends both. Traced here with two
    counts past the in-flight peak (llama-tiny, pp2, 2 ranks; torch's interleaved schedule holds one micro-batch
    less at 4 than at 6 or more): the peaks differ by less than one boundary (what grows is the batch's token ids,
    129 x 8 B per micro-batch, and a transient of the data reader's)."""
    from paraplan.executor.dry_run import _compute_dtype
    from paraplan.executor.pipeline import stage_io

    flags = "--dp 1 --tp 1 --pp 2 --micro-batch 1 --schedule " + schedule
    job = Job.load(_local_plan(tmp_path, monkeypatch, "llama-tiny",
                               flags + (" --virtual-stages 2" if schedule == "interleaved-1f1b" else "")))
    boundary, _ = stage_io(job, 1, _compute_dtype(job, "cpu"))
    boundary_bytes = boundary.numel() * boundary.element_size()  # (1, 128, 128) fp32 on this machine
    # each trace in a fresh interpreter, as dry_run runs them: a trace leaves torch state (fake tensors) behind
    with ProcessPoolExecutor(max_workers=2, mp_context=multiprocessing.get_context("spawn"),
                             max_tasks_per_child=1) as pool:
        traces = {(rank, traced): pool.submit(trace_rank, job, rank, "cpu", (2, traced))
                  for rank in (0, 1) for traced in counts}
        for rank in (0, 1):
            peaks = [traces[rank, traced].result().tensor_peak_bytes for traced in counts]
            assert abs(peaks[1] - peaks[0]) < boundary_bytes, (rank, peaks, boundary_bytes)


def test_zero1_shares_the_optimizer_states_evenly(tmp_path, monkeypatch):
    """ZeRO-1 keeps on each data-parallel rank the AdamW moments of an even cut of the parameters laid end to end
    (executor/optim.flat_shares), the cost model's moments / dp. Shared out as whole tensors (greedy, largest
    first), gpt-tiny's dp2 rank 0 kept 475,136 of the 940,800 parameters' moments, 4,736 over its share; a
    tensor larger than the share landed whole on one rank (benchmarks' gpt-small at dp2 pp2: 412 MB of states
    against 361 MB predicted). Moments: 2 x 4 B per parameter (fp32), plus AdamW's 4 B step per piece."""
    job = Job.load(_local_plan(tmp_path, monkeypatch, "gpt-tiny", "--dp 2 --tp 1 --pp 1 --micro-batch 2 --zero 1"))
    params = list({id(p): p for p in build_model(job.spec).parameters()}.values())
    share = -(-sum(p.numel() for p in params) // 2)
    for rank in dry_run(job, "cpu").to_dict()["ranks"]:
        traced = rank["memory_gib"]["optimizer"] * 2**30
        assert 8 * share <= traced <= 8 * share + 4 * len(params), rank["rank"]
        assert rank["predicted_memory_breakdown_gib"]["optimizer"] * 2**30 == pytest.approx(8 * share, rel=1e-9)


def test_interleaved_zero2_counts_every_chunks_reduce_buffer(tmp_path, monkeypatch):
    """Under interleaved ZeRO-2 each chunk keeps its last reduce-scatter input between backwards (memory.
    staged_unit_params): llama-tiny dp2 pp2 x2 traced 15,470,332 and 14,139,668 B of tensors on its two ranks, where
    one layer unit's buffer a rank was priced 7.7% and 5.9% below; one per chunk (the embedding's and the head's the
    larger on their chunks) within 4%. At scale: llama2-70b dp2 tp2 pp8 cp2 x4, four 1.7 GB buffers a rank.
    Since the flash kernel's output is no longer priced twice (memory.layer_activation_bytes), 5.3% and 2.2% below:
    rank 0's peak also holds four embedding-sized fp32 tensors that no term prices (2 MB of its 14.5 MB on this model,
    a vocabulary of 1,024 beside hidden 128), which the double count had offset; within 6%."""
    flags = "--dp 2 --tp 1 --pp 2 --micro-batch 1 --schedule interleaved-1f1b --virtual-stages 2 --zero 2"
    job = Job.load(_local_plan(tmp_path, monkeypatch, "llama-tiny", flags))
    for rank in dry_run(job, "cpu").to_dict()["ranks"]:
        predicted = rank["predicted_memory_gib"] - rank["predicted_memory_breakdown_gib"]["other"]
        assert predicted / rank["tensor_peak_gib"] - 1 == pytest.approx(0, abs=0.06), rank["rank"]


@pytest.mark.parametrize("recompute,within", [("none", 0.05), ("selective", 0.05)])
def test_zero_bubble_counts_the_gradients_kept_for_the_weight_backward(tmp_path, monkeypatch, recompute, within):
    """Under ZB-V torch's input backward keeps each weight-carrying op's output gradient until the deferred weight
    backward (StageCost.dw_pending): llama-tiny dp2 pp2 x2 ZeRO-2 traced 17,779,736 and 12,337,912 B of tensors on
    its two ranks, priced 4.9% and 9.2% below without them, within 4% with them. At scale (llama2-70b dp2 tp4 pp8
    x2 ZeRO-2 SP) the last three ranks traced 7-19% above the price without them; with them and the 16-bit weight
    gradients held only from a stage's W to its next B (StateBytes.unfolded, none on the first stage), every rank
    within 0.8%. With selective recomputation, the one zb-v runs on this model (layout.zero_bubble_recompute_refusal:
    full recomputation traced 43% and 47% above), 4.7% and 3.0% below.
    Since the flash kernel's output is no longer priced twice (memory.layer_activation_bytes: it is the output
    projection's input), without recomputation 4.6% and 3.2% below (16,862,744 and 11,745,528 B traced): on llama-tiny
    rank 0, which holds the V's last stage, three fp32 logit-sized loss tensors sit at the peak where the loss is
    priced as 16-bit logits kept and its 8·T·V working set; at scale -1.6% to +2.1% (+0.4% to +3.6% before)."""
    flags = f"--dp 2 --tp 1 --pp 2 --micro-batch 1 --schedule zb-v --virtual-stages 2 --zero 2 --recompute {recompute}"
    job = Job.load(_local_plan(tmp_path, monkeypatch, "llama-tiny", flags))
    for rank in dry_run(job, "cpu").to_dict()["ranks"]:
        predicted = rank["predicted_memory_gib"] - rank["predicted_memory_breakdown_gib"]["other"]
        assert predicted / rank["tensor_peak_gib"] - 1 == pytest.approx(0, abs=within), rank["rank"]


@pytest.mark.parametrize("sp", ["", "--sequence-parallel"])
def test_mla_tensor_parallel_traffic_by_kind(tmp_path, monkeypatch, sp):
    """MLA under tensor parallelism on this executor: its replicated down-projections take the gathered hidden
    and its head-sharded up-projections' input gradients (the latents: compressed query and key-value, the shared
    rotary key) are all-reduced (Framework.mla_tp_input "mixed"). Priced as a plain region, the sequence-parallel
    plan's reduce-scatter was predicted +50% and its all-reduce -18%; then its all-reduce +8.6%, the down-projections'
    and latent norms' gradients synced as sequence parallelism's replicated weights though every rank computes them
    from the whole sequence (costmodel._whole_latent_params). Each kind now equals the trace."""
    path = _local_plan(tmp_path, monkeypatch, "deepseek-tiny", f"--dp 2 --tp 2 --pp 1 --micro-batch 2 {sp}")
    rank = dry_run(Job.load(path), "cpu").to_dict()["ranks"][0]
    for kind in ("all_reduce", "all_gather", "reduce_scatter"):
        assert rank["predicted_comm_bytes"][kind] == pytest.approx(rank["comm_bytes"][kind], rel=1e-9), kind


def test_sequence_parallelism_saves_the_activations_the_trace_saves_with_mla(tmp_path, monkeypatch):
    """Sequence parallelism on a deepseek-tiny dp2 tp2 plan: what it saves of the activations, traced, is what the
    cost model says. This executor runs MLA's replicated down-projections and latent norms on the gathered sequence,
    so their outputs stay whole on every rank (memory.layer_activation_bytes' whole_latents); priced as split over
    the sequence like the rest, the saving was predicted 51% too large (1,393,152 against 921,088 bytes)."""
    acts = {}
    for sp in ("", "--sequence-parallel"):
        path = _local_plan(tmp_path, monkeypatch, "deepseek-tiny", f"--dp 2 --tp 2 --pp 1 --micro-batch 2 {sp}",
                           f"plan{sp}.json")
        rank = dry_run(Job.load(path), "cpu").to_dict()["ranks"][0]
        acts[sp] = (rank["predicted_memory_breakdown_gib"]["activations"], rank["memory_gib"]["activations"])
    predicted, traced = (acts[""][i] - acts["--sequence-parallel"][i] for i in (0, 1))
    assert traced > 0 and predicted == pytest.approx(traced, rel=0.01)


def test_ddp_gradient_buckets_count_from_the_first_forward(tmp_path, monkeypatch):
    """fp32 data parallelism alone runs DistributedDataParallel (executor/data_parallel.py uses_ddp), whose
    gradient buckets are allocated with the wrapper: with one micro-batch the activation peak holds them already
    (one fp32 copy of the weights), where plain autograd would not have made the gradients yet."""
    monkeypatch.setenv("PARAPLAN_MEASUREMENTS", str(tmp_path / "meas"))
    monkeypatch.setenv("PARAPLAN_NO_CALIBRATE", "1")
    base = [*CLI, "simulate", "--model", "llama-tiny", "--cluster", "local", "--tp", "1", "--pp", "1", "--json"]
    one = json.loads(subprocess.run([*base, "--global-batch", "8", "--dp", "2", "--micro-batch", "4"],
                                    capture_output=True, text=True, check=True).stdout)["memory_gib"]
    assert one["grads"] == pytest.approx(one["params"], rel=1e-9) and one["grads"] > 0
    alone = json.loads(subprocess.run([*base, "--global-batch", "4", "--dp", "1", "--micro-batch", "4"],
                                      capture_output=True, text=True, check=True).stdout)["memory_gib"]
    assert alone["grads"] == 0.0  # one rank, no wrapper: the first backward makes them


def test_the_optimizer_steps_temporaries_are_a_ranks_peak(tmp_path):
    """gpt-small (h 1024, vocabulary 50,304, tied) over tp2 pp2 with full recomputation, bf16: the first rank keeps
    few activations, and its traced peak is in AdamW's step, one tensor at a time over DTensors: exp_avg_sq.sqrt()
    and its quotient by the bias correction, two fp32 temporaries the size of the vocab-sharded embedding
    (V/2 x h, 98 MiB each) beside the fp32 weights, gradients and moments (memory.step_bytes). Priced 5.1% under
    the trace before the step's moment was; now its breakdown is those states plus the two temporaries, and within
    1% of the trace."""
    model = str(ROOT / "benchmarks" / "data" / "gpt-small.yaml")
    spec = load_model_spec(model)
    path = _plan(tmp_path, model, 16, "--dp 1 --tp 2 --pp 2 --micro-batch 2 --recompute full")
    rank = next(r for r in dry_run(Job.load(path), "cpu").to_dict()["ranks"] if r["rank"] == 0)
    predicted = rank["predicted_memory_breakdown_gib"]
    assert predicted["activations"] == 0.0
    temporaries = 2 * 4 * spec.vocab_size // 2 * spec.hidden_size
    states = predicted["params"] + predicted["grads"] + predicted["optimizer"]
    assert predicted["optimizer"] * 2**30 == pytest.approx(2 * predicted["params"] * 2**30 + temporaries, rel=1e-9)
    assert states == pytest.approx(rank["tensor_peak_gib"], rel=0.01)
