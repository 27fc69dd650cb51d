"""Samples written at each evaluation of ``plait train``: what the model writes now, in ``<run>/samples.jsonl``.

The model being trained is spread over the ranks (tensor slices, pipeline stages, sequence shards, ZeRO-3
shards), so every rank takes part in each forward, exactly as in evaluation. To keep every layout's shapes the
ones it trains on, each new token runs one forward over a whole window of ``seq_len`` tokens (the prompt and the
tokens so far, then zeros, which causal attention never lets earlier positions see) and reads the logits at the
last filled position: full recomputation, no cache (``plait generate`` has the cached one-process path).
The last pipeline stage picks the token (``plait.models.generate.next_token``, seeded: the same on every rank)
and broadcasts it over "pp", then rank 0 over "world", so all ranks feed the same next window.

Prompts are the first tokens of evaluation samples: the dataset's ``prompt_len`` when it has one (the synthetic
task's "ab+cd="), else a quarter of the window. Text comes from the dataset's ``decode`` (every plait dataset has
``encode`` / ``decode``); without one the token ids are written.
"""

from __future__ import annotations

from typing import Any

import torch

from plait.engine import Engine
from plait.models.generate import next_token
from plait.models.inputs import tokens_of


@torch.no_grad()
def _logits(engine: Engine, window: torch.Tensor) -> torch.Tensor | None:
    """Logits [P, T, V] of ``window`` on the ranks that hold the model's output (None elsewhere)."""
    model = engine.model
    was_training = model.training
    model.eval()
    try:
        with engine.precision.autocast():
            if engine.pipeline is None:
                return model(window)
            return engine.pipeline.forward(window)
    finally:
        model.train(was_training)


def sample_windows(
    engine: Engine,
    prompts: torch.Tensor,
    window: int,
    max_new_tokens: int,
    temperature: float,
    top_k: int,
    seed: int,
    vocab: int | None = None,
) -> torch.Tensor:
    """Continue ``prompts`` [P, T0] by up to ``max_new_tokens`` tokens within windows of ``window`` tokens (the
    training length); a collective: every rank calls it with the same prompts. Returns [P, T0 + n] on every
    rank (n <= window - T0 + 1: the last token is predicted from a full window); ids below ``vocab`` only."""
    count, start = prompts.shape
    if window <= start:
        raise ValueError(f"samples need a window longer than the prompt ({start} tokens), got {window}.")
    tokens = torch.zeros((count, window), dtype=torch.long, device=engine.device)
    tokens[:, :start] = prompts.to(engine.device)
    generator = torch.Generator(device=engine.device).manual_seed(seed)
    produced = []
    for index in range(min(max_new_tokens, window - start + 1)):
        filled = start + index
        logits = _logits(engine, tokens)
        chosen = torch.zeros(count, dtype=torch.long, device=engine.device)
        if logits is not None:  # every rank holding the last stage draws the same token (same seed, same logits)
            chosen = next_token(logits[:, filled - 1].float(), temperature, top_k, generator, vocab)
        if engine.pipeline is not None:
            engine.comm.broadcast(chosen, "pp", src=engine.pipeline.last_rank_index)
        engine.comm.broadcast(chosen, "world", src=0)
        produced.append(chosen)
        if filled < window:
            tokens[:, filled] = chosen
    new = torch.stack(produced, dim=1) if produced else tokens[:, :0]
    return torch.cat([prompts.to(engine.device), new], dim=1).cpu()


def prompts_of(dataset: Any, count: int, offset: int) -> torch.Tensor:
    """The first tokens of ``count`` evaluation samples (from index ``offset``): [count, prompt length]."""
    inputs, _ = dataset.batch(list(range(offset, offset + count)))
    length = int(getattr(dataset, "prompt_len", 0)) or max(1, dataset.seq_len // 4)
    return tokens_of(inputs)[:, :length]  # packed documents' inputs are (tokens, positions)


def decode(dataset: Any, tokens: torch.Tensor) -> str | list[int]:
    """Text of ``tokens`` through the dataset's ``decode``, or the ids when it has none."""
    decoder = getattr(dataset, "decode", None)
    return decoder(tokens) if decoder is not None else [int(t) for t in tokens.tolist()]


def write_samples(
    engine: Engine, dataset: Any, step: int, count: int, max_new_tokens: int, temperature: float, seed: int, offset: int
) -> list[dict[str, Any]]:
    """Sample ``count`` continuations of evaluation prompts (a collective); the records for samples.jsonl."""
    prompts = prompts_of(dataset, count, offset)
    window, vocab = dataset.seq_len, dataset.vocab_size
    tokens = sample_windows(engine, prompts, window, max_new_tokens, temperature, 0, seed + step, vocab)
    start = prompts.shape[1]
    return [
        {
            "step": step,
            "prompt": decode(dataset, row[:start]),
            "completion": decode(dataset, row[start:]),
            "temperature": temperature,
        }
        for row in tokens
    ]


__all__ = ["prompts_of", "sample_windows", "write_samples"]
