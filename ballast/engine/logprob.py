"""Token log-probabilities and entropies from logits, chunked over tokens.

With a vocabulary of 150k, one float32 copy of the logits of a 16k-token micro-batch is ~10 GB. The
functions here upcast, scale by the temperature and normalise only `chunk_tokens` rows at a time;
when gradients are needed each chunk is recomputed in backward (activation checkpointing), so the
float32 intermediates of only one chunk exist at any moment, in forward and in backward.
"""

from __future__ import annotations

import torch
from torch.utils.checkpoint import checkpoint


def _chunk_stats(
    logits: torch.Tensor, labels: torch.Tensor, temperature: float, with_entropy: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    z = logits.float()
    if temperature != 1.0:
        z = z / temperature
    lse = torch.logsumexp(z, dim=-1)
    log_probs = z.gather(-1, labels.unsqueeze(-1)).squeeze(-1) - lse
    if with_entropy:
        # H = logsumexp(z) - sum_v softmax(z)_v * z_v
        entropy = lse - (torch.softmax(z, dim=-1) * z).sum(dim=-1)
    else:
        entropy = log_probs.new_zeros(0)
    return log_probs, entropy


def log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[label] and the entropy of that distribution, per token.

    `logits` is (N, V) in any float dtype, `labels` (N,) int64. Returns float32 (N,) log-probs and
    (N,) entropies (None unless `calculate_entropy`).
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"need logits (N, V) and labels (N,), got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    num_tokens = logits.shape[0]
    recompute = torch.is_grad_enabled() and logits.requires_grad and num_tokens > chunk_tokens
    lp_chunks, ent_chunks = [], []
    for start in range(0, num_tokens, chunk_tokens):
        part = logits[start : start + chunk_tokens]
        lab = labels[start : start + chunk_tokens]
        if recompute:
            lp, ent = checkpoint(_chunk_stats, part, lab, temperature, calculate_entropy, use_reentrant=False)
        else:
            lp, ent = _chunk_stats(part, lab, temperature, calculate_entropy)
        lp_chunks.append(lp)
        ent_chunks.append(ent)
    if num_tokens == 0:
        # Still connected to the graph, so backward reaches the model on a rank with no kept token.
        empty = logits.float().sum(dim=-1)
        return empty, (empty.clone() if calculate_entropy else None)
    log_probs = torch.cat(lp_chunks)
    entropy = torch.cat(ent_chunks) if calculate_entropy else None
    return log_probs, entropy
