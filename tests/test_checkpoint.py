"""Checkpoints (``--checkpoint-dir/--checkpoint-every``), ``--resume`` under the same or another plan
(resharding), ``--max-restarts`` (a killed rank restarts the job from the latest checkpoint by itself), and
initial weights from a Hugging Face folder (``--init-from``)."""

from __future__ import annotations

import json
import os

import pytest
import torch
from executor_cases import SEQ, Case, assert_losses_match, read_run, reference_losses, reference_model

from conftest import run_cli
from paraplan.executor import checkpoint_io
from paraplan.executor.batches import BatchSource
from paraplan.executor.errors import ExecutionError, JobFailed
from paraplan.executor.launch import LaunchOptions, TrainingOptions, launch
from paraplan.executor.machine import free_port
from paraplan.executor.optim import ADAMW
from paraplan.models import loss_function

REF = Case("dp2", "gpt-tiny", dp=2, micro_batch=2)
STEPS, EVERY = 6, 3


def _launch(case: Case, folder: str, training: TrainingOptions, steps: int = STEPS) -> dict:
    os.makedirs(folder, exist_ok=True)
    out = os.path.join(folder, "run")
    try:
        launch([case.write(folder)], [out], LaunchOptions(nproc_per_node=case.world_size, steps=steps,
                                                          master_port=free_port("127.0.0.1"), timeout_s=120,
                                                          threads_per_rank=1, training=training))
    except JobFailed as e:
        pytest.fail(f"{case.name}: {e}")
    return read_run(out)


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> tuple[str, dict]:
    """(checkpoint folder, run record) of an uninterrupted dp2 run saving after steps 3 and 6."""
    folder = str(tmp_path_factory.mktemp("checkpoint-reference"))
    ck = os.path.join(folder, "ck")
    run = _launch(REF, folder, TrainingOptions(checkpoint_dir=ck, checkpoint_every=EVERY))
    return ck, run


def test_checkpoints_are_complete_step_folders(reference):
    ck, run = reference
    assert sorted(os.listdir(ck)) == ["step-3", "step-6"]  # every 3rd step and the last; no partial folder left
    assert {".metadata", "trainer.json"} <= set(os.listdir(os.path.join(ck, "step-3")))
    state = checkpoint_io.read_state(os.path.join(ck, "step-3"))
    assert state.step == 3 and state.samples == 3 * REF.global_batch and state.losses == run["losses"][:3]
    assert state.plan["dp"] == 2 and state.parameters["embed.tok.weight"] == [1024, 128]
    assert run["restarts"] == 0 and run["resumed_from_step"] is None
    assert_losses_match(REF, run)  # checkpointing does not change training (single-process reference)


@pytest.mark.parametrize("case", [Case("tp2", "gpt-tiny", tp=2, micro_batch=2),
                                  Case("pp2", "gpt-tiny", pp=2, micro_batch=2),
                                  Case("dp2-zero1", "gpt-tiny", dp=2, zero=1, micro_batch=2),  # whole states cut up
                                  # recomputation wraps the layers (torch's checkpoint wrapper): the names stay plain
                                  Case("dp2-full", "gpt-tiny", dp=2, micro_batch=2, recompute="full")],
                         ids=lambda c: c.name)
def test_a_dp2_checkpoint_resumes_under_another_plan(reference, case, tmp_path):
    ck, ref = reference
    run = _launch(case, str(tmp_path), TrainingOptions(resume=os.path.join(ck, "step-3")))
    assert run["resumed_from_step"] == 3 and run["steps"] == STEPS and run["plan"]["dp"] == case.dp
    assert run["losses"][:3] == ref["losses"][:3]  # carried in the checkpoint
    # the summary's step time is this plan's: the steps after the resume, without its first (not the dp2 steps)
    assert run["step_time_s"][:3] == ref["step_time_s"][:3]
    assert run["mean_step_time_s"] == pytest.approx(sum(run["step_time_s"][4:]) / (STEPS - 4))
    for k in range(3, STEPS):
        got, want = run["losses"][k], ref["losses"][k]
        assert abs(got - want) <= 1e-4 * abs(want), f"{case.name} step {k + 1}: {got} vs uninterrupted {want}"


def _saved_tensors(folder: str, path: str) -> dict[str, torch.Tensor]:
    """Every tensor of a DCP checkpoint folder, whole, read in this process (through a torch.save file ``path``)."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(folder, path)
    return torch.load(path, weights_only=True)


def test_a_zero1_checkpoint_saves_whole_states(reference, tmp_path):
    """ZeRO-1 cuts tensors over the data-parallel ranks (even shares: one of layers.1's MLP weights is split
    between the two ranks here); its checkpoint holds each parameter's AdamW state whole, as a dp2 run
    without ZeRO saves it, and another plan (tp2) trains on from it as from the uninterrupted run."""
    ck_ref, ref = reference
    ck = str(tmp_path / "ck")
    run = _launch(Case("dp2-zero1", "gpt-tiny", dp=2, zero=1, micro_batch=2), str(tmp_path / "zero1"),
                  TrainingOptions(checkpoint_dir=ck, checkpoint_every=EVERY))
    assert_losses_match(REF, run)
    want = _saved_tensors(os.path.join(ck_ref, "step-3"), str(tmp_path / "plain.pt"))
    got = _saved_tensors(os.path.join(ck, "step-3"), str(tmp_path / "zero1.pt"))
    states = sorted(k for k in want if k.startswith("optim."))
    assert states and sorted(k for k in got if k.startswith("optim.")) == states
    for key in states:
        assert got[key].shape == want[key].shape, key
        torch.testing.assert_close(got[key], want[key], rtol=1e-4, atol=1e-9, msg=key)
    resumed = _launch(Case("tp2", "gpt-tiny", tp=2, micro_batch=2), str(tmp_path / "tp2"),
                      TrainingOptions(resume=os.path.join(ck, "step-3")))
    for k in range(3, STEPS):
        got_loss, want_loss = resumed["losses"][k], ref["losses"][k]
        assert abs(got_loss - want_loss) <= 1e-4 * abs(want_loss), f"step {k + 1}: {got_loss} vs {want_loss}"


def test_a_killed_rank_restarts_the_job_from_the_latest_checkpoint(reference, tmp_path):
    _, ref = reference
    plan = REF.write(str(tmp_path))
    ck, out = str(tmp_path / "ck"), str(tmp_path / "run")
    p = run_cli("execute", "--plan", plan, "--steps", str(STEPS), "--checkpoint-dir", ck, "--checkpoint-every", "2",
                "--max-restarts", "1", "--timeout", "120", "--out", out,
                env={"PARAPLAN_FAULT": "kill:1:5", "TMPDIR": str(tmp_path)}, timeout=400)  # SIGKILL at step 5
    assert p.returncode == 0, p.stderr
    run = read_run(out)
    assert run["restarts"] == 1 and run["resumed_from_step"] == 4 and run["steps"] == STEPS
    for k, (got, want) in enumerate(zip(run["losses"], ref["losses"], strict=True)):
        assert abs(got - want) <= 1e-5 * abs(want), f"step {k + 1}: {got} vs uninterrupted {want}"
    with open(os.path.join(out, "metrics.jsonl")) as f:
        rows = [json.loads(line) for line in f]
    assert [r["step"] for r in rows] == list(range(1, STEPS + 1))  # one line per step, the replayed ones once
    assert [r["restart"] for r in rows] == [0] * 4 + [1] * 2
    assert all(r["tokens_per_s"] > 0 and r["loss"] == run["losses"][i] for i, r in enumerate(rows))


@pytest.mark.parametrize("name,fragment", [
    ("other-model", "holds model gpt-tiny, the plan trains llama-tiny"),
    ("no-checkpoint", "no complete checkpoint (step-N/ folder) in it"),
    ("missing", "no such folder"),
    ("steps", "--steps is the run's total, so give more than 3"),
    ("every-alone", "--checkpoint-every needs --checkpoint-dir"),
    ("existing", "already holds checkpoints (up to step-6): continue that run with --resume"),
    ("parameter-servers", "the plan uses parameter servers"),
])
def test_bad_resume_and_checkpoint_options_are_one_line(reference, name, fragment, tmp_path, capsys, monkeypatch):
    from paraplan import cli

    def no_launch(*a, **k):
        raise AssertionError("ranks started")

    monkeypatch.setattr("paraplan.commands.execute.launch", no_launch)
    ck, _ = reference
    (tmp_path / "empty").mkdir()
    plan = {"other-model": Case("llama", "llama-tiny", dp=2, micro_batch=2),
            "parameter-servers": Case("ps", "gpt-tiny", dp=2, micro_batch=2, dp_mode="ps")}.get(name, REF)
    args = {"other-model": ["--resume", os.path.join(ck, "step-3")],
            "no-checkpoint": ["--resume", str(tmp_path / "empty")],
            "missing": ["--resume", str(tmp_path / "nowhere")],
            "steps": ["--resume", os.path.join(ck, "step-3"), "--steps", "3"],
            "every-alone": ["--checkpoint-every", "2"],
            "existing": ["--checkpoint-dir", ck],
            "parameter-servers": ["--checkpoint-dir", str(tmp_path / "ck")]}[name]
    code = cli.main(["execute", "--plan", plan.write(str(tmp_path)), *args])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and fragment in err, err


def test_only_complete_checkpoints_are_found(tmp_path):
    for name in ("step-2", "step-5", ".step-7.partial", "step-x"):
        (tmp_path / name).mkdir()
    (tmp_path / "step-2" / "trainer.json").write_text("{}")
    (tmp_path / ".step-7.partial" / "trainer.json").write_text("{}")  # renamed only once complete
    assert checkpoint_io.complete_steps(str(tmp_path)) == [2]
    assert checkpoint_io.resolve(str(tmp_path)) == str(tmp_path / "step-2")
    with pytest.raises(ExecutionError, match="incomplete checkpoint"):
        checkpoint_io.resolve(str(tmp_path / "step-5"))
    # a restarted job resumes from its own latest checkpoint, not from one another run left there
    (tmp_path / "step-4").mkdir()
    (tmp_path / "step-2" / "trainer.json").write_text('{"run_id": "this"}')
    (tmp_path / "step-4" / "trainer.json").write_text('{"run_id": "other"}')
    assert checkpoint_io.latest(str(tmp_path), "this") == str(tmp_path / "step-2")
    assert checkpoint_io.latest(str(tmp_path)) == str(tmp_path / "step-4")


# ---- initial weights from Hugging Face safetensors (execute --init-from) ------------------------------------------

HF_CASE = Case("llama-tp2", "llama-tiny", tp=2, micro_batch=2)


def write_hf_llama(folder, model, spec, **config) -> str:
    """A Hugging Face LLaMA folder (one model.safetensors in F32, config.json) holding ``model``'s weights."""
    import struct

    from paraplan.executor.hf_weights import hf_name

    os.makedirs(folder, exist_ok=True)
    header, blobs, offset = {}, [], 0
    for fqn, p in model.named_parameters():
        raw = p.detach().float().contiguous().numpy().tobytes()
        header[hf_name(fqn)] = {"dtype": "F32", "shape": list(p.shape), "data_offsets": [offset, offset + len(raw)]}
        blobs.append(raw)
        offset += len(raw)
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    with open(os.path.join(folder, "model.safetensors"), "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text + b"".join(blobs))
    cfg = {"model_type": "llama", "hidden_size": spec.hidden_size, "num_hidden_layers": spec.num_layers,
           "num_attention_heads": spec.num_attention_heads, "num_key_value_heads": spec.num_kv_heads,
           "intermediate_size": spec.ffn_hidden_size, "vocab_size": spec.vocab_size,
           "max_position_embeddings": spec.seq_length, "rope_theta": 10000.0, "rms_norm_eps": 1e-5,
           "tie_word_embeddings": False, **config}
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(cfg, f)
    return str(folder)


@pytest.fixture(scope="module")
def hf_folder(tmp_path_factory) -> str:
    """llama-tiny's weights drawn with seed 5, as a Hugging Face folder."""
    spec, model = reference_model(Case("llama", "llama-tiny", seed=5))
    return write_hf_llama(tmp_path_factory.mktemp("hf-llama"), model, spec)


def test_hf_names_map_every_llama_parameter(hf_folder):
    from paraplan.executor.hf_weights import hf_name, open_folder, source_of

    assert hf_name("layers.3.mlp.w1.weight") == "model.layers.3.mlp.gate_proj.weight"
    assert hf_name("layers.0.attn_norm.weight") == "model.layers.0.input_layernorm.weight"
    spec, model = reference_model(Case("llama", "llama-tiny", seed=5))
    tensors = open_folder(hf_folder)
    for fqn, p in model.named_parameters():
        name = source_of(fqn, tensors, spec.tied)
        assert torch.equal(tensors[name].tensor(name), p.detach()), fqn


@pytest.mark.parametrize("what,fragment", [
    ("gpt", "loads dense LLaMA models"),
    ("rope", "RoPE base 500000.0"),
    ("layers", "model.layers.3.input_layernorm.weight has no place in the plan's model llama-3layer"),
    ("shapes", "the plan's model needs"),
])
def test_hf_weights_that_do_not_fit_are_one_line(hf_folder, what, fragment, tmp_path, capsys, monkeypatch):
    from paraplan import cli

    monkeypatch.setattr("paraplan.commands.execute.launch", lambda *a, **k: pytest.fail("ranks started"))
    folder = hf_folder
    plan = HF_CASE.plan().to_dict()
    if what == "gpt":
        plan = Case("gpt", "gpt-tiny", tp=2, micro_batch=2).plan().to_dict()
    elif what == "rope":
        spec, model = reference_model(Case("llama", "llama-tiny"))
        folder = write_hf_llama(tmp_path / "llama3", model, spec, rope_theta=500000.0)
    elif what == "layers":
        plan = Case("llama3", "llama-3layer", tp=2, micro_batch=2).plan().to_dict()
    else:  # llama-tiny's weights for a wider llama
        plan["model_spec"]["ffn_hidden_size"] = 384
    (tmp_path / "plan.json").write_text(json.dumps(plan))
    code = cli.main(["execute", "--plan", str(tmp_path / "plan.json"), "--init-from", folder])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and fragment in err, err


@pytest.mark.slow
def test_a_tp2_plan_trains_on_from_hf_weights(hf_folder, tmp_path):
    """Plan seed 0 (its data order), weights of seed 5 from the HF folder, each tp rank cutting its shard:
    the losses of a single process that starts from the seed-5 weights."""
    run = _launch(HF_CASE, str(tmp_path), TrainingOptions(init_from=hf_folder), steps=3)
    spec, model = reference_model(Case("llama", "llama-tiny", seed=5))
    opt = torch.optim.AdamW(model.parameters(), **ADAMW)
    source = BatchSource(spec=spec, seed=HF_CASE.seed, global_batch=HF_CASE.global_batch, seq_length=SEQ)
    for k in range(3):
        x, y = source.batch(k)  # (B, s) each
        loss = loss_function(spec)(model(x), y)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        assert abs(run["losses"][k] - loss.item()) <= 1e-4 * loss.item(), (k, run["losses"][k], loss.item())
    assert run["losses"] != reference_losses(HF_CASE, 3)  # not the plan's own initialisation
