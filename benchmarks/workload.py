"""What both contenders of a pair train: the same model (same seed, so the same initial weights on every rank and
in every process), the same batches, the same optimizer and clipping.

The data is next-byte prediction (``ByteTextDataset``) over a pseudo-English text generated deterministically into
a temporary folder: 128-byte windows give the reference GPT realistic attention lengths and a 256-way softmax,
so a step is dominated by matrix multiplies rather than by per-op overhead (the ``AdditionTask``'s 8-token
samples would mostly measure Python).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
from torch import Tensor, nn

from plait.data import ByteTextDataset, ShardedBatches
from plait.models import GPT, GPTConfig

Batch = tuple[Tensor, Tensor]

WORDS = (
    "the of and to in a is that for it as was with be by on not he this are or his from at which but have an they "
    "you were her she there been one all we their has would when if so no what up out more into them some could "
    "time these two may then do first any my now such like our over man me even most made after also did many "
    "before must through back years where much your way well down should because each just those people how too "
    "little state good very make world still own see men work long get here between both life being under never "
    "day same another know while last might us great old year off come since against go came right used take "
    "three model tensor gradient parallel rank batch layer weight shard pipeline stage memory bandwidth ring"
).split()
"""The vocabulary of the generated text, roughly by frequency (drawn with Zipf weights 1/rank)."""

TEXT_BYTES = 256 * 1024


def write_text(path: Path, size: int = TEXT_BYTES, seed: int = 0) -> Path:
    """Write ``size`` bytes of pseudo-English (Zipf-distributed words, sentences, paragraphs) to ``path``.

    Pure in ``seed``: the same file on every machine and run, so losses are comparable across runs."""
    rng = np.random.Generator(np.random.PCG64(seed))
    weights = 1.0 / np.arange(1, len(WORDS) + 1)
    weights /= weights.sum()
    parts: list[str] = []
    total = 0
    while total < size:
        words = [WORDS[i] for i in rng.choice(len(WORDS), size=int(rng.integers(4, 16)), p=weights)]
        sentence = " ".join(words).capitalize() + rng.choice([".", ".", ".", ",", "?", ";"]) + " "
        if rng.random() < 0.1:
            sentence += "\n\n"
        parts.append(sentence)
        total += len(sentence)
    path.write_bytes("".join(parts).encode("ascii")[:size])
    return path


@dataclass(frozen=True)
class Workload:
    """Model, data and optimizer shared by the contenders of one suite (picklable: it travels to every rank)."""

    model: GPTConfig = field(
        default_factory=lambda: GPTConfig(vocab_size=256, seq_len=128, n_layer=4, n_head=4, d_model=128)
    )
    global_batch: int = 16
    seed: int = 1234
    data_seed: int = 7
    lr: float = 1e-3
    weight_decay: float = 0.1
    max_grad_norm: float | None = 1.0
    microbatches: int = 1
    """Micro-batches per step, for the pipeline contenders (the others train the batch in one piece)."""
    text_path: str = ""

    def with_text(self, path: Path | str) -> Workload:
        """This workload reading its data from ``path``."""
        return dataclasses.replace(self, text_path=str(path))

    def build_model(self) -> nn.Module:
        """The reference GPT, initialised from ``seed``: identical weights in every process that calls this."""
        torch.manual_seed(self.seed)
        return GPT(self.model)

    @property
    def optimizer_kwargs(self) -> dict[str, float]:
        """AdamW's hyper-parameters (for peers that take a class and keywords, e.g. ZeroRedundancyOptimizer)."""
        return {"lr": self.lr, "weight_decay": self.weight_decay}

    def optimizer(self, params: Iterable[nn.Parameter]) -> torch.optim.Optimizer:
        """AdamW with the suite's learning rate and weight decay (the factory plait.parallelize takes)."""
        return torch.optim.AdamW(params, **self.optimizer_kwargs)

    def batches(self, rank: int, world: int, count: int) -> list[Batch]:
        """Data-parallel rank ``rank``'s share (of ``world``) of the first ``count`` global batches (built before
        any timing); ``world=1``: the whole global batches."""
        if not self.text_path:
            raise ValueError("the workload has no text file: call with_text(write_text(path)) first")
        dataset = ByteTextDataset(self.text_path, seq_len=self.model.seq_len, seed=self.data_seed)
        loader = ShardedBatches(dataset, self.global_batch, dp_rank=rank, dp_size=world)
        return [loader.batch_at(step) for step in range(count)]

    @property
    def tokens_per_step(self) -> int:
        """Tokens of one global batch (what one training step consumes over all ranks)."""
        return self.global_batch * self.model.seq_len

    def num_parameters(self) -> int:
        """P, the number of (trainable, fp32) parameters of the model (counted on the meta device: no compute in
        the runner, whose forked workers should inherit no intra-op thread pool)."""
        with torch.device("meta"):
            return sum(p.numel() for p in GPT(self.model).parameters() if p.requires_grad)

    def describe(self) -> str:
        """One line for reports, e.g. ``GPT 4x128 (0.88 M params), seq 128, global batch 16, AdamW, clip 1``."""
        m = self.model
        clip = f", clip {self.max_grad_norm:g}" if self.max_grad_norm else ""
        micro = f", {self.microbatches} micro-batches" if self.microbatches > 1 else ""
        return (
            f"GPT {m.n_layer} layers x d_model {m.d_model}, {m.n_head} heads ({self.num_parameters() / 1e6:.2f} M "
            f"params), vocab {m.vocab_size}, seq {m.seq_len}, global batch {self.global_batch}, "
            f"AdamW lr {self.lr:g}{clip}{micro}"
        )
