"""Deterministic, layout-independent training batches.

The global batch of step ``k`` is a function of the run's seed and ``k`` alone: a generator seeded
from (seed, step) draws it, data-parallel rank ``d`` takes rows ``[d*B/dp, (d+1)*B/dp)`` and the
micro-batches are contiguous chunks of that slice. Whatever the layout, the union of the samples a
step trains on is the same global batch, which is what lets runs of different layouts match.

Language models read windows of a small text corpus shipped with the package (``data/corpus.txt``),
tokenised as bytes modulo the vocabulary. Other families (CNNs, MLPs) use the zoo's synthetic
samples (:func:`paraplan.models.sample_batch`), drawn with the same per-step generator.

With the user's tokens (``execute --data``, token_data.py) the file is cut into ``W`` windows of
``s + 1`` tokens (window ``w`` starts at token ``w*s``; consecutive windows share one token, the
next-token target) and the run reads them in epochs: sample ``g`` of the run (counting every sample
of every step, the *data position*) is window ``perm_e(g mod W)`` of epoch ``e = g div W``, where
``perm_e`` is a pseudo-random permutation of ``[0, W)`` keyed by (seed, epoch). Every window is read
once per epoch, nothing is held in memory (the permutation is computed, not stored), and sample
``g`` is the same whatever the layout; step ``k`` reads samples ``[g0 + (k-k0)*B, g0 + (k-k0+1)*B)``
from the position ``g0`` a resumed run starts at (so a resumed run may change its global batch).
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import numpy as np
import torch

from paraplan.models import ModelSpec, TransformerSpec, sample_batch

from .token_data import TokenFile

CORPUS = Path(__file__).with_name("data") / "corpus.txt"
BERT_MASK_EVERY = 7  # masked-LM corruption, as the zoo's transformer_batch does it


@lru_cache(maxsize=4)
def corpus_tokens(vocab_size: int) -> torch.Tensor:
    """The corpus as token ids: its UTF-8 bytes modulo the vocabulary. Shape (n,), int64."""
    raw = torch.frombuffer(bytearray(CORPUS.read_bytes()), dtype=torch.uint8)
    return raw.to(torch.int64) % vocab_size


def step_generator(seed: int, step: int) -> torch.Generator:
    """The generator that draws step ``step``'s global batch: a function of seed and step only."""
    return torch.Generator().manual_seed(zlib.crc32(f"batch:{seed}:{step}".encode()) + (seed << 32))


def _mix(z: np.ndarray) -> np.ndarray:
    """SplitMix64's finaliser: a well-mixed 64-bit hash of each element (uint64 arithmetic wraps)."""
    z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
    z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
    return z ^ (z >> np.uint64(31))


def permute(indices: np.ndarray, n: int, key: bytes) -> np.ndarray:
    """``perm(indices)`` for a pseudo-random permutation ``perm`` of ``[0, n)`` chosen by ``key``.

    A four-round Feistel network permutes the smallest even-bit-width domain ``[0, 4^k)`` holding
    ``n``; values that land outside ``[0, n)`` are permuted again (cycle walking) until they fall
    inside, which keeps it a bijection of ``[0, n)``. Shapes: (m,) int64 in, (m,) int64 out."""
    half = max(1, ((n - 1).bit_length() + 1) // 2)
    mask = np.uint64((1 << half) - 1)
    keys = [np.uint64(int.from_bytes(hashlib.blake2b(key + bytes([r]), digest_size=8).digest(), "little"))
            for r in range(4)]
    x = indices.astype(np.uint64)
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        left, right = x[todo] >> np.uint64(half), x[todo] & mask
        for k in keys:
            left, right = right, left ^ (_mix(right ^ k) & mask)
        x[todo] = (left << np.uint64(half)) | right
        todo = x >= np.uint64(n)
    return x.astype(np.int64)


def window_starts(samples: np.ndarray, num_windows: int, seq_length: int, seed: int) -> np.ndarray:
    """First token of the window each run-wide sample index reads: (m,) int64 -> (m,) int64."""
    epochs, slots = np.divmod(samples, num_windows)
    out = np.empty_like(samples)
    for e in np.unique(epochs):
        here = epochs == e
        out[here] = permute(slots[here], num_windows, f"data:{seed}:{int(e)}".encode()) * seq_length
    return out


@dataclass(frozen=True)
class BatchSource:
    """Where a data-parallel rank's samples of each step come from."""

    spec: ModelSpec
    seed: int
    global_batch: int
    seq_length: int | None  # tokens per sample for language models (None: not a language model)
    dp: int = 1
    dp_rank: int = 0
    tokens: TokenFile | None = None  # the user's tokens (execute --data); None: the bundled corpus
    start_step: int = 0  # a resumed run's first step (0-based) ...
    start_sample: int = 0  # ... and its data position there (samples the run had read before it)

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp

    def rows(self) -> slice:
        """This data-parallel rank's rows of the global batch (contiguous)."""
        return slice(self.dp_rank * self.local_batch, (self.dp_rank + 1) * self.local_batch)

    def position(self, step: int) -> int:
        """The data position before step ``step`` (0-based): samples read by steps before it."""
        return self.start_sample + (step - self.start_step) * self.global_batch

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank's slice of step ``step``'s global batch, on CPU."""
        if self.tokens is not None:
            return self._file_batch(step)
        gen = step_generator(self.seed, step)
        if isinstance(self.spec, TransformerSpec):
            return self._token_batch(gen)
        inputs, targets = sample_batch(self.spec, self.global_batch, gen)  # the whole global batch
        return inputs[self.rows()], targets[self.rows()]

    def _token_batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seq_length or self.spec.seq_length
        tokens = corpus_tokens(self.spec.vocab_size)  # (n,)
        if tokens.numel() < s + 2:  # longer samples than the bundled corpus: read it round and round
            tokens = tokens.repeat(-(-(s + 2) // tokens.numel()))  # (>= s + 2,)
        starts = torch.randint(0, tokens.numel() - s - 1, (self.global_batch,), generator=gen)  # (B,)
        mine = starts[self.rows()]  # (B/dp,)
        windows = tokens[mine[:, None] + torch.arange(s + 1)]  # (B/dp, s+1)
        return self._inputs_targets(windows, s)

    def _file_batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seq_length or self.spec.seq_length
        ids = self.tokens.tokens()  # (n,) memory-mapped
        num_windows = (ids.shape[0] - 1) // s
        first = self.position(step) + self.rows().start
        samples = np.arange(first, first + self.local_batch, dtype=np.int64)  # run-wide sample indices, (B/dp,)
        starts = window_starts(samples, num_windows, s, self.seed)  # (B/dp,)
        windows = np.stack([ids[a:a + s + 1] for a in starts.tolist()]).astype(np.int64)  # (B/dp, s+1)
        return self._inputs_targets(torch.from_numpy(windows), s)

    def _inputs_targets(self, windows: torch.Tensor, s: int) -> tuple[torch.Tensor, torch.Tensor]:
        """Model inputs and targets from token windows (B/dp, s+1)."""
        if self.spec.family == "bert":  # masked LM: corrupt every 7th token, predict the originals
            inputs = windows[:, :s].clone()
            inputs[:, ::BERT_MASK_EVERY] = 0
            return inputs, windows[:, :s]
        return windows[:, :s], windows[:, 1:]  # next-token prediction: (B/dp, s) each
