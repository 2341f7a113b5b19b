"""Deterministic, layout-independent training batches.

The global batch of step ``k`` is a function of the run's seed and ``k`` alone: a generator seeded
from (seed, step) draws it, data-parallel rank ``d`` takes rows ``[d*B/dp, (d+1)*B/dp)`` and the
micro-batches are contiguous chunks of that slice. Whatever the layout, the union of the samples a
step trains on is the same global batch, which is what lets runs of different layouts match.

Language models read windows of a small text corpus shipped with the package (``data/corpus.txt``),
tokenised as bytes modulo the vocabulary. Other families (CNNs, MLPs) use the zoo's synthetic
samples (:func:`paraplan.models.sample_batch`), drawn with the same per-step generator.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path

import torch

from paraplan.models import ModelSpec, TransformerSpec, sample_batch

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


@dataclass(frozen=True)
class BatchSource:
    """Where a data-parallel rank's samples of each step come from."""

    spec: ModelSpec
    seed: int
    global_batch: int
    seq_length: int | None  # tokens per sample for language models (None: not a language model)
    dp: int = 1
    dp_rank: int = 0

    @property
    def local_batch(self) -> int:
        return self.global_batch // self.dp

    def rows(self) -> slice:
        """This data-parallel rank's rows of the global batch (contiguous)."""
        return slice(self.dp_rank * self.local_batch, (self.dp_rank + 1) * self.local_batch)

    def batch(self, step: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(inputs, targets) of this rank's slice of step ``step``'s global batch, on CPU."""
        gen = step_generator(self.seed, step)
        if isinstance(self.spec, TransformerSpec):
            return self._token_batch(gen)
        inputs, targets = sample_batch(self.spec, self.global_batch, gen)  # the whole global batch
        return inputs[self.rows()], targets[self.rows()]

    def _token_batch(self, gen: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
        s = self.seq_length or self.spec.seq_length
        tokens = corpus_tokens(self.spec.vocab_size)  # (n,)
        if tokens.numel() < s + 2:
            raise ValueError(f"the corpus holds {tokens.numel()} tokens, fewer than a sample of {s + 1}")
        starts = torch.randint(0, tokens.numel() - s - 1, (self.global_batch,), generator=gen)  # (B,)
        mine = starts[self.rows()]  # (B/dp,)
        windows = tokens[mine[:, None] + torch.arange(s + 1)]  # (B/dp, s+1)
        if self.spec.family == "bert":  # masked LM: corrupt every 7th token, predict the originals
            inputs = windows[:, :s].clone()
            inputs[:, ::BERT_MASK_EVERY] = 0
            return inputs, windows[:, :s]
        return windows[:, :s], windows[:, 1:]  # next-token prediction: (B/dp, s) each
