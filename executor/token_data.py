"""The user's training tokens (``execute --data PATH``), memory-mapped, checked before any rank starts.

Two on-disk formats:

- a flat token file: token ids back to back, little-endian ``uint16`` or ``uint32`` with no header
  (what nanoGPT's ``prepare.py`` writes to ``train.bin``). The id width is ``--data-dtype``, or, when
  omitted, the narrowest that holds the model's vocabulary (uint16 up to 65,536 ids).
- Megatron's indexed dataset: ``PREFIX.bin`` (the tokens of every document, back to back) and
  ``PREFIX.idx`` as Megatron-Core's ``indexed_dataset.py`` writes it, all little-endian::

      9 bytes   b"MMIDIDX\\x00\\x00"
      u64       version (1)
      u8        dtype code (1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16)
      u64       S, the number of sequences
      u64       D, the number of document indices
      i32 x S   tokens per sequence
      i64 x S   byte offset of each sequence in the .bin
      i64 x D   sequence index where each document starts (0 first, S last)
      i8  x S   (multimodal datasets only) each sequence's mode

  The executor trains on the ``.bin``'s tokens as one stream, documents concatenated (their end-of-
  document tokens, written by the tokenizer, stay in the stream), as Megatron's GPT dataset samples
  them; the index is read to check that it describes the ``.bin`` exactly.

Everything wrong with a file (missing, empty, size not a multiple of the id width, a corrupt or
inconsistent index, ids outside the vocabulary, fewer tokens than one sample) is an
:class:`ExecutionError`: one line, exit 2, before torchrun starts. Ranks map the file again and
skip the full scan (the launcher did it).
"""

from __future__ import annotations

import os
import struct
from dataclasses import dataclass
from functools import lru_cache

import numpy as np

from .errors import ExecutionError

FLAT_DTYPES = ("uint16", "uint32")
MEGATRON_MAGIC = b"MMIDIDX\x00\x00"
MEGATRON_DTYPES = {1: "uint8", 2: "int8", 3: "int16", 4: "int32", 5: "int64", 6: "float64", 7: "float32",
                   8: "uint16"}
MEGATRON_HEADER_BYTES = 9 + 8 + 1 + 8 + 8
SCAN_CHUNK = 1 << 24  # ids per chunk of the vocabulary scan (64 MiB of uint32)


@dataclass(frozen=True)
class TokenFile:
    """A checked token file: ``num_tokens`` ids of ``dtype`` at byte 0 of ``path``."""

    path: str  # the file holding the ids (the flat file, or the indexed dataset's .bin)
    kind: str  # "flat" or "megatron"
    dtype: str  # numpy dtype name of one id
    num_tokens: int
    index: str | None = None  # the .idx of a Megatron dataset

    def tokens(self) -> np.ndarray:
        """The ids, memory-mapped read-only (one mapping per process). Shape (num_tokens,)."""
        return _memmap(self.path, self.dtype, self.num_tokens)

    def describe(self) -> dict:
        """What the run record and checkpoints say about the data."""
        out = {"path": os.path.abspath(self.path), "format": self.kind, "dtype": self.dtype,
               "num_tokens": self.num_tokens}
        if self.index:
            out["index"] = os.path.abspath(self.index)
        return out


@lru_cache(maxsize=4)
def _memmap(path: str, dtype: str, count: int) -> np.ndarray:
    return np.memmap(path, dtype=np.dtype(dtype).newbyteorder("<"), mode="r", shape=(count,))


def default_dtype(vocab_size: int) -> str:
    """The narrowest flat id width that holds ids 0 .. vocab_size-1."""
    return "uint16" if vocab_size <= 1 << 16 else "uint32"


def resolve(path: str) -> tuple[str, str | None]:
    """(data file, index file or None) for ``--data PATH``.

    ``PREFIX`` with ``PREFIX.bin`` and ``PREFIX.idx`` beside it, or ``PREFIX.bin``/``PREFIX.idx``
    themselves, name a Megatron dataset; any other existing file is a flat token file (nanoGPT's
    ``train.bin`` has no ``.idx`` beside it)."""
    stem, ext = os.path.splitext(path)
    if ext in (".bin", ".idx") and os.path.exists(stem + ".idx"):
        return stem + ".bin", stem + ".idx"
    if os.path.isfile(path):
        return path, None
    if os.path.exists(path + ".bin") or os.path.exists(path + ".idx"):
        return path + ".bin", path + ".idx"
    if os.path.isdir(path):
        raise ExecutionError(f"--data {path}: is a folder, not a token file (or the prefix of PREFIX.bin/.idx)")
    raise ExecutionError(f"--data {path}: no such file (nor {path}.bin + {path}.idx)")


def open_tokens(path: str, dtype: str | None, vocab_size: int) -> TokenFile:
    """Map ``--data PATH`` and check its structure (cheap: no pass over the ids)."""
    data, index = resolve(path)
    if index is None:
        return _open_flat(path, dtype or default_dtype(vocab_size))
    return _open_megatron(path, data, index, dtype)


def check_tokens(tf: TokenFile, vocab_size: int, sample_tokens: int, where: str) -> None:
    """Full check for the launcher: enough tokens for one sample, every id in ``[0, vocab_size)``."""
    if tf.num_tokens < sample_tokens:
        raise ExecutionError(f"{where}: {tf.num_tokens} tokens, fewer than one sample needs ({sample_tokens}: "
                             "the sequence length plus the next-token target)")
    ids = tf.tokens()
    for start in range(0, tf.num_tokens, SCAN_CHUNK):
        chunk = ids[start:start + SCAN_CHUNK]
        lo, hi = int(chunk.min()), int(chunk.max())
        if lo < 0 or hi >= vocab_size:
            bad = int(np.flatnonzero((chunk < 0) | (chunk >= vocab_size))[0])
            raise ExecutionError(f"{where}: token {start + bad} is id {int(chunk[bad])}, outside the model's "
                                 f"vocabulary of {vocab_size} (wrong --data-dtype, or data for another tokenizer?)")


def _size(path: str, what: str) -> int:
    try:
        return os.path.getsize(path)
    except OSError as e:
        raise ExecutionError(f"{what}: {e.strerror}") from None


def _open_flat(path: str, dtype: str) -> TokenFile:
    if dtype not in FLAT_DTYPES:
        raise ExecutionError(f"--data-dtype {dtype}: flat token files hold uint16 or uint32 ids")
    where = f"--data {path}"
    if not os.access(path, os.R_OK):
        raise ExecutionError(f"{where}: not readable")
    size, width = _size(path, where), np.dtype(dtype).itemsize
    if size == 0:
        raise ExecutionError(f"{where}: the file is empty")
    if size % width:
        raise ExecutionError(f"{where}: {size} bytes is not a whole number of {dtype} ids ({width} bytes each); "
                             "is it a token file, and is --data-dtype right?")
    return TokenFile(path=path, kind="flat", dtype=dtype, num_tokens=size // width)


def _open_megatron(path: str, data: str, index: str, dtype: str | None) -> TokenFile:
    where = f"--data {path}"
    for f in (index, data):
        if not os.path.isfile(f):
            raise ExecutionError(f"{where}: the indexed dataset lacks {f}")
    idx_size = _size(index, f"{where}: {index}")
    try:
        with open(index, "rb") as f:
            head = f.read(MEGATRON_HEADER_BYTES)
    except OSError as e:
        raise ExecutionError(f"{where}: {index}: {e.strerror}") from None
    if len(head) < MEGATRON_HEADER_BYTES or head[:9] != MEGATRON_MAGIC:
        raise ExecutionError(f"{where}: {index} is not a Megatron index (no MMIDIDX header)")
    version, code, seqs, docs = struct.unpack("<QBQQ", head[9:])
    if version != 1:
        raise ExecutionError(f"{where}: {index} is index version {version}; version 1 is read")
    if code not in MEGATRON_DTYPES:
        raise ExecutionError(f"{where}: {index} names an unknown dtype code {code}")
    kind = MEGATRON_DTYPES[code]
    if kind.startswith("float"):
        raise ExecutionError(f"{where}: {index} says the tokens are {kind}; token ids are integers")
    if dtype is not None and dtype != kind:
        raise ExecutionError(f"--data-dtype {dtype}: {index} says its ids are {kind} (leave --data-dtype out)")
    body = 4 * seqs + 8 * seqs + 8 * docs
    if idx_size not in (MEGATRON_HEADER_BYTES + body, MEGATRON_HEADER_BYTES + body + seqs):
        raise ExecutionError(f"{where}: {index} is {idx_size} bytes, but its header ({seqs} sequences, {docs} document "
                             f"indices) needs {MEGATRON_HEADER_BYTES + body}: truncated or corrupt")
    raw = np.memmap(index, dtype=np.uint8, mode="r")
    lengths = np.frombuffer(raw, dtype="<i4", count=seqs, offset=MEGATRON_HEADER_BYTES)  # (S,)
    pointers = np.frombuffer(raw, dtype="<i8", count=seqs, offset=MEGATRON_HEADER_BYTES + 4 * seqs)  # (S,)
    doc_idx = np.frombuffer(raw, dtype="<i8", count=docs, offset=MEGATRON_HEADER_BYTES + 12 * seqs)  # (D,)
    width = np.dtype(kind).itemsize
    if seqs and (lengths.min() < 0 or pointers[0] != 0
                 or np.any(pointers[1:] != pointers[:-1] + lengths[:-1].astype(np.int64) * width)):
        raise ExecutionError(f"{where}: {index} is corrupt: its sequence offsets do not follow its lengths")
    if docs and (doc_idx[0] != 0 or doc_idx[-1] != seqs or np.any(np.diff(doc_idx) < 0)):
        raise ExecutionError(f"{where}: {index} is corrupt: its document indices do not run from 0 to {seqs}")
    num_tokens = int(lengths.astype(np.int64).sum()) if seqs else 0
    bin_size = _size(data, f"{where}: {data}")
    if bin_size != num_tokens * width:
        raise ExecutionError(f"{where}: {data} is {bin_size} bytes, but {index} describes {num_tokens} {kind} ids "
                             f"({num_tokens * width} bytes)")
    if num_tokens == 0:
        raise ExecutionError(f"{where}: the dataset holds no tokens")
    return TokenFile(path=data, kind="megatron", dtype=kind, num_tokens=num_tokens, index=index)
