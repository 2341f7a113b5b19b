"""``execute --data``: the user's tokens (flat nanoGPT-style files, Megatron indexed datasets), refused in one
line when bad, sampled the same whatever the layout."""

from __future__ import annotations

import os
import struct

import numpy as np
import pytest
from executor_cases import SEQ, Case, read_run

from conftest import assert_one_line_error, run_cli
from paraplan.executor.batches import BatchSource, permute
from paraplan.executor.errors import JobFailed
from paraplan.executor.launch import LaunchOptions, TrainingOptions, launch
from paraplan.executor.machine import free_port
from paraplan.executor.token_data import default_dtype, open_tokens
from paraplan.models import load_model_spec

VOCAB = 1024  # gpt-tiny's and llama-tiny's


def tokens(seed: int, n: int = 4000) -> np.ndarray:
    """Ids with some structure to learn (a noisy counter), (n,) int64."""
    rng = np.random.default_rng(seed)
    return (np.arange(n) * 7 + rng.integers(0, 5, n)) % VOCAB


def write_flat(path, ids: np.ndarray, dtype: str = "uint16") -> str:
    ids.astype(dtype).tofile(path)
    return str(path)


def write_megatron(prefix, docs: list[np.ndarray], code: int = 8, dtype: str = "<u2") -> str:
    """An indexed dataset as Megatron-Core's writer lays it out: one sequence per document."""
    lengths = np.array([len(d) for d in docs], dtype="<i4")
    width = np.dtype(dtype).itemsize
    pointers = np.concatenate([[0], np.cumsum(lengths[:-1].astype(np.int64) * width)]).astype("<i8")
    doc_idx = np.arange(len(docs) + 1, dtype="<i8")
    with open(f"{prefix}.idx", "wb") as f:
        f.write(b"MMIDIDX\x00\x00" + struct.pack("<QBQQ", 1, code, len(docs), len(doc_idx)))
        f.write(lengths.tobytes() + pointers.tobytes() + doc_idx.tobytes())
    np.concatenate(docs).astype(dtype).tofile(f"{prefix}.bin")
    return str(prefix)


# ---- files -------------------------------------------------------------------------------------------------------

def test_flat_and_indexed_files_hold_the_same_tokens(tmp_path):
    ids = tokens(0)
    flat = open_tokens(write_flat(tmp_path / "train.bin", ids), None, VOCAB)
    mega = open_tokens(write_megatron(tmp_path / "corpus", np.split(ids, [100, 1500, 3000])), None, VOCAB)
    assert (flat.kind, flat.dtype, mega.kind, mega.dtype) == ("flat", "uint16", "megatron", "uint16")
    assert np.array_equal(flat.tokens(), ids) and np.array_equal(mega.tokens(), ids)
    for name in ("corpus.bin", "corpus.idx"):  # either file of the pair names the dataset
        assert open_tokens(str(tmp_path / name), None, VOCAB).kind == "megatron"


def test_id_width_follows_the_vocabulary(tmp_path):
    assert default_dtype(1024) == "uint16" and default_dtype(65536) == "uint16" and default_dtype(128256) == "uint32"
    ids = np.array([0, 70000, 128000, 5], dtype=np.int64)
    tf = open_tokens(write_flat(tmp_path / "big.bin", ids, "uint32"), None, 128256)
    assert tf.dtype == "uint32" and tf.tokens().tolist() == ids.tolist()


def test_samples_do_not_depend_on_the_layout(tmp_path):
    tf = open_tokens(write_flat(tmp_path / "x.bin", tokens(1)), None, VOCAB)
    spec = load_model_spec("gpt-tiny")
    whole = BatchSource(spec=spec, seed=3, global_batch=8, seq_length=SEQ, tokens=tf)
    for step in (0, 5):
        x, y = whole.batch(step)  # (8, SEQ) each
        parts = [BatchSource(spec=spec, seed=3, global_batch=8, seq_length=SEQ, dp=4, dp_rank=d, tokens=tf).batch(step)
                 for d in range(4)]
        assert np.array_equal(np.concatenate([p[0] for p in parts]), x)
        assert np.array_equal(x[:, 1:], y[:, :-1])  # next-token targets
    # resumed at step 2 from its data position: the same samples as the run that never stopped
    resumed = BatchSource(spec=spec, seed=3, global_batch=8, seq_length=SEQ, tokens=tf, start_step=2,
                          start_sample=whole.position(2))
    assert np.array_equal(resumed.batch(4)[0], whole.batch(4)[0])


def test_every_window_is_read_once_per_epoch():
    for n in (1, 7, 64, 1000):
        assert sorted(permute(np.arange(n), n, b"k").tolist()) == list(range(n))
    assert not np.array_equal(permute(np.arange(50), 50, b"a"), permute(np.arange(50), 50, b"b"))


def _megatron_variants(tmp_path) -> dict:
    ids = tokens(2, 200)
    good = write_megatron(tmp_path / "good", [ids[:120], ids[120:]])
    out = {}
    for name, edit in {
        "magic": lambda b: b"NOTANIDX\x00" + b[9:],
        "version": lambda b: b[:9] + struct.pack("<Q", 2) + b[17:],
        "truncated": lambda b: b[:-8],
        "offsets": lambda b: b[:34 + 8] + struct.pack("<q", 999) + b[34 + 8 + 8:],  # the first pointer
        "float": lambda b: b[:17] + struct.pack("<B", 7) + b[18:],
    }.items():
        prefix = tmp_path / name
        (tmp_path / f"{name}.idx").write_bytes(edit((tmp_path / "good.idx").read_bytes()))
        (tmp_path / f"{name}.bin").write_bytes((tmp_path / "good.bin").read_bytes())
        out[name] = str(prefix)
    (tmp_path / "short.idx").write_bytes((tmp_path / "good.idx").read_bytes())
    (tmp_path / "short.bin").write_bytes((tmp_path / "good.bin").read_bytes()[:-2])
    out["short"] = str(tmp_path / "short")
    (tmp_path / "noidx.bin").write_bytes((tmp_path / "good.bin").read_bytes())
    out["noidx"] = str(tmp_path / "noidx")
    out["good"] = good
    return out


BAD = [
    ("odd", "not a whole number of uint16 ids"),
    ("vocab", "token 3 is id 5000, outside the model's vocabulary of 1024"),
    ("few", "fewer than one sample needs (33"),
    ("empty", "the file is empty"),
    ("missing", "no such file"),
    ("noidx", "lacks"),
    ("magic", "not a Megatron index"),
    ("version", "index version 2"),
    ("truncated", "truncated or corrupt"),
    ("offsets", "sequence offsets do not follow its lengths"),
    ("float", "float32"),
    ("short", "describes 200 uint16 ids"),
    ("dtype", "says its ids are uint16"),
]


@pytest.fixture
def bad_files(tmp_path):
    files = _megatron_variants(tmp_path)
    (tmp_path / "odd.bin").write_bytes(b"\x01\x00\x02\x00\x03")
    write_flat(tmp_path / "vocab.bin", np.array([1, 2, 3, 5000, 7] * 20))
    write_flat(tmp_path / "few.bin", np.arange(20))
    (tmp_path / "empty.bin").write_bytes(b"")
    files.update(odd=str(tmp_path / "odd.bin"), vocab=str(tmp_path / "vocab.bin"), few=str(tmp_path / "few.bin"),
                 empty=str(tmp_path / "empty.bin"), missing=str(tmp_path / "nothing.bin"))
    return files


@pytest.mark.parametrize("name,fragment", BAD, ids=[b[0] for b in BAD])
def test_a_bad_data_file_is_one_line_before_any_rank_starts(name, fragment, bad_files, tmp_path, capsys,
                                                              monkeypatch):
    from paraplan import cli

    def no_launch(*a, **k):
        raise AssertionError("ranks started")

    monkeypatch.setattr("paraplan.commands.execute.launch", no_launch)
    plan = Case("one", "gpt-tiny", micro_batch=4).write(str(tmp_path))
    extra = ["--data-dtype", "uint32"] if name == "dtype" else []
    path = bad_files["good" if name == "dtype" else name]
    code = cli.main(["execute", "--plan", plan, "--data", path, *extra])
    err = capsys.readouterr().err.strip()
    assert code == 2 and len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert fragment in err, err


def test_the_cli_refuses_a_bad_file_in_one_line(bad_files, tmp_path):
    plan = Case("one", "gpt-tiny", micro_batch=4).write(str(tmp_path))
    p = run_cli("execute", "--plan", plan, "--data", bad_files["vocab"])
    assert_one_line_error(p, "outside the model's vocabulary")
    assert p.returncode == 2


# ---- runs --------------------------------------------------------------------------------------------------------

def _train(case: Case, folder, data: str, steps: int = 3) -> list[float]:
    folder = str(folder)
    os.makedirs(folder, exist_ok=True)
    plan, out = case.write(folder), os.path.join(folder, "run")
    try:
        launch([plan], [out], LaunchOptions(nproc_per_node=case.world_size, master_port=free_port("127.0.0.1"),
                                            steps=steps, timeout_s=120, threads_per_rank=1,
                                            training=TrainingOptions(data=data)))
    except JobFailed as e:
        pytest.fail(f"{case.name} on {data}: {e}")
    run = read_run(out)
    assert run["data"]["path"] == os.path.abspath(data if os.path.isfile(data) else data + ".bin")
    return run["losses"]


def test_same_file_same_losses_other_file_other_losses_any_layout(tmp_path):
    x = write_flat(tmp_path / "x.bin", tokens(5))
    y = write_megatron(tmp_path / "y", np.split(tokens(6), [1000, 2500]))  # another corpus, as an indexed dataset
    first = _train(Case("one", "gpt-tiny", micro_batch=4), tmp_path / "a", x)
    # the same file again, on two data-parallel ranks: the same losses
    again = _train(Case("dp2", "gpt-tiny", dp=2, micro_batch=2), tmp_path / "b", x)
    for got, want in zip(again, first, strict=True):
        assert abs(got - want) <= 1e-4 * abs(want)
    other = _train(Case("one", "gpt-tiny", micro_batch=4), tmp_path / "c", y)
    assert other[0] != first[0] and all(abs(a - b) > 1e-3 for a, b in zip(first[1:], other[1:], strict=True))
