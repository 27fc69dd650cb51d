"""Text continuation in one process: sampling, and a key/value cache for the reference GPT.

Autoregressive decoding picks token t+1 from the logits at position t, appends it, and repeats. Recomputing the
whole prefix each time costs O(T^2) token forwards for T tokens; a *KV cache* keeps every block's keys and
values of the tokens seen so far, so each new token runs one position through the model and attends to the
cached keys/values: O(T) token forwards (the attention itself still reads the whole prefix). With causal
attention the logits at position t depend only on tokens <= t, so cached decoding computes the same logits as
full recomputation (up to float summation order), which ``tests/test_generate.py`` checks.

- ``next_token``: greedy (temperature 0) or sampling from softmax(logits / temperature), optionally restricted to
  the ``top_k`` most likely tokens (Fan et al. 2018), drawn from a seeded ``torch.Generator``: the same seed gives
  the same text.
- ``generate``: plait's GPT with ``GPTCache``; a Hugging Face causal LM through its own forward and its own cache
  (``past_key_values``); any other model by full recomputation. When the sequence outgrows the model's context,
  the oldest tokens are dropped and the cache is rebuilt from the kept window (as nanoGPT's sampler crops).
"""

from __future__ import annotations

import inspect
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from plait.models.gpt import GPT
from plait.models.hf import is_hf_model
from plait.models.layers import Block


def next_token(
    logits: Tensor, temperature: float, top_k: int, generator: torch.Generator | None, vocab: int | None = None
) -> Tensor:
    """Token ids [B] from last-position logits [B, V]: argmax when ``temperature`` is 0, else a draw from
    softmax(logits / temperature) over the ``top_k`` largest (all when 0). ``vocab`` restricts the choice to ids
    below it (the tokenizer's ids, when the model's table is larger or padded)."""
    if temperature < 0 or top_k < 0:
        raise ValueError(f"temperature={temperature} and top_k={top_k} must be >= 0.")
    if vocab is not None:
        logits = logits[..., :vocab]
    if temperature == 0:
        return logits.argmax(dim=-1)
    scaled = logits.float() / temperature
    if top_k and top_k < scaled.shape[-1]:
        kth = torch.topk(scaled, top_k, dim=-1).values[:, -1:]
        scaled = scaled.masked_fill(scaled < kth, float("-inf"))
    probs = torch.softmax(scaled, dim=-1)
    return torch.multinomial(probs, 1, generator=generator)[:, 0]


@dataclass
class GPTCache:
    """Per block, the keys and values [B, kv_heads, T, head_dim] of the ``length`` tokens seen so far."""

    keys: dict[str, Tensor] = field(default_factory=dict)
    values: dict[str, Tensor] = field(default_factory=dict)
    length: int = 0

    def extend(self, block: str, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor]:
        """Append this step's keys/values of ``block``; return all of them."""
        if block in self.keys:
            key = torch.cat([self.keys[block], key], dim=2)
            value = torch.cat([self.values[block], value], dim=2)
        self.keys[block], self.values[block] = key, value
        return key, value


@torch.no_grad()
def gpt_forward_cached(model: GPT, tokens: Tensor, cache: GPTCache) -> Tensor:
    """Logits [B, t, V] of ``tokens`` [B, t] that follow the ``cache.length`` cached tokens (eval mode: no
    dropout); the cache grows by t. The same computation as ``GPT.forward``, block by block, with each
    attention reading the cached keys and values too."""
    if model.tok_embed is None or model.lm_head is None or model.norm_f is None:
        raise ValueError("generation needs the whole GPT (embeddings, blocks, final norm and head), not a stage.")
    start, length = cache.length, tokens.shape[1]
    positions = torch.arange(start, start + length, device=tokens.device)
    hidden = model.tok_embed(tokens)
    if model.pos_embed is not None:
        hidden = hidden + model.pos_embed(positions)
    mask = None
    if length > 1 and start > 0:  # query i (absolute start + i) sees keys 0 .. start + i
        mask = torch.arange(start + length, device=tokens.device)[None, :] <= positions[:, None]
    for key in sorted(model.blocks.keys(), key=int):
        block = cast(Block, model.blocks[key])  # the GPT's blocks are Blocks (an nn.ModuleDict types them Module)
        attn = block.attn
        q, k, v = attn.project_qkv(block.norm1(hidden), positions)
        k, v = cache.extend(key, k, v)
        if q.shape[1] != k.shape[1]:
            k = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
            v = v.repeat_interleave(q.shape[1] // v.shape[1], dim=1)
        causal = mask is None and length > 1
        attended = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=causal)
        batch = attended.shape[0]
        hidden = hidden + attn.o(attended.transpose(1, 2).reshape(batch, length, -1))
        hidden = hidden + block.mlp(block.norm2(hidden))
    cache.length += length
    return model.lm_head(model.norm_f(hidden))


def model_context(model: nn.Module) -> int | None:
    """The most positions ``model`` takes (GPT: seq_len; HF: its config's limit; None: unknown)."""
    if isinstance(model, GPT):
        return model.config.seq_len
    if is_hf_model(model):
        from plait.models.hf_load import model_context as hf_context

        return hf_context(model.config)
    return None


@torch.no_grad()
def generate(
    model: nn.Module,
    prompt: Tensor,
    max_new_tokens: int,
    temperature: float = 1.0,
    top_k: int = 0,
    seed: int = 0,
    eos_id: int | None = None,
    use_cache: bool = True,
    vocab: int | None = None,
) -> Tensor:
    """``prompt`` [T0] or [B, T0] token ids continued by up to ``max_new_tokens`` tokens (stopping early once every
    row has produced ``eos_id``; only ids below ``vocab`` when given); returns the prompt and its continuation.
    Deterministic in ``seed``."""
    if max_new_tokens < 0:
        raise ValueError(f"max_new_tokens={max_new_tokens} must be >= 0.")
    single = prompt.dim() == 1
    tokens = prompt[None] if single else prompt
    if tokens.shape[1] == 0:
        raise ValueError("the prompt is empty: give at least one token.")
    was_training = model.training
    model.eval()
    device = next(model.parameters()).device
    tokens = tokens.to(device)
    generator = torch.Generator(device=device).manual_seed(seed)
    context = model_context(model)
    step = _stepper(model, use_cache)
    fresh = True
    done = torch.zeros(tokens.shape[0], dtype=torch.bool, device=device)
    for _ in range(max_new_tokens):
        if context is not None and tokens.shape[1] >= context:
            fresh = True  # crop to the last context - 1 tokens, rebuild the cache from them
        feed = tokens[:, -(context - 1) :] if context is not None and tokens.shape[1] >= context else tokens
        logits = step(feed if fresh else tokens[:, -1:], fresh)
        fresh = False
        chosen = next_token(logits[:, -1], temperature, top_k, generator, vocab)
        tokens = torch.cat([tokens, chosen[:, None]], dim=1)
        if eos_id is not None:
            done |= chosen == eos_id
            if bool(done.all()):
                break
    model.train(was_training)
    return tokens[0] if single else tokens


def _stepper(model: nn.Module, use_cache: bool) -> Callable[[Tensor, bool], Tensor]:
    """``step(tokens, fresh) -> logits``: ``fresh`` starts over from ``tokens``, else continues the cache."""
    state: dict[str, Any] = {}

    def step(tokens: Tensor, fresh: bool) -> Tensor:
        if isinstance(model, GPT) and use_cache:
            if fresh:
                state["cache"] = GPTCache()
            return gpt_forward_cached(model, tokens, state["cache"])
        if is_hf_model(model) and use_cache:  # transformers' own cache ("cache", formerly "past_key_values")
            name = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"
            past = None if fresh else state.get("past")
            output = model(input_ids=tokens, use_cache=True, **{name: past})
            state["past"] = getattr(output, name)
            return output.logits
        if not fresh:
            tokens = torch.cat([state["tokens"], tokens], dim=1)
        state["tokens"] = tokens
        output = model(tokens)
        return output.logits if hasattr(output, "logits") else output

    return step


__all__ = ["GPTCache", "generate", "gpt_forward_cached", "model_context", "next_token"]
