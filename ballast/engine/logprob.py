"""Token log-probabilities and entropies from logits, with a hand-written backward, chunked over tokens.

Autograd through `logsumexp`, `gather` and `softmax` would make about ten vocabulary-wide
temporaries per token in the backward (each a fresh allocation, page-faulted in on CPU), and its
`exp(z - lse)` takes a slow scalar path on CPU wherever the result is subnormal, which a real
model's logits often are over a 50k vocabulary. The backward here is the closed form instead:

    d log_softmax(z)[y] / dz = onehot(y) - softmax(z)
    d H(softmax(z)) / dz    = softmax(z) * (E_p[z] - z),   E_p[z] = logsumexp(z) - H

computed a block of token rows at a time (on CPU a block of fp32 temporaries stays in cache) and written
straight into the gradient of the logits. Only the logits (which the forward holds anyway), the
per-token `logsumexp` and entropy are kept for the backward, so no more than a block of float32
vocabulary rows exists at any moment beyond the logits and their gradient, whatever their dtype.
"""

from __future__ import annotations

import torch

# Token rows per block on CPU: 16 fp32 rows of a 50k vocabulary are ~3 MB, about a core's cache
# share. A GPU gets `chunk_tokens` rows per block: there, few large kernels beat many small ones.
CPU_BLOCK_TOKENS = 16


def _scaled(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    z = logits.float()
    return z / temperature if temperature != 1.0 else z


class _TokenLogProbs(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, labels, temperature: float, with_entropy: bool, block: int):
        num_tokens = logits.shape[0]
        log_probs = logits.new_empty(num_tokens, dtype=torch.float32)
        lse = logits.new_empty(num_tokens, dtype=torch.float32)
        entropy = logits.new_empty(num_tokens if with_entropy else 0, dtype=torch.float32)
        for start in range(0, num_tokens, block):
            end = min(start + block, num_tokens)
            z = _scaled(logits[start:end], temperature)
            torch.logsumexp(z, dim=-1, out=lse[start:end])
            log_probs[start:end] = z.gather(-1, labels[start:end, None])[:, 0] - lse[start:end]
            if with_entropy:
                entropy[start:end] = lse[start:end] - (torch.softmax(z, dim=-1) * z).sum(-1)
        ctx.save_for_backward(logits, labels, lse, entropy)
        ctx.temperature, ctx.block = temperature, block
        ctx.set_materialize_grads(False)  # an output the loss does not use costs nothing in backward
        return log_probs, entropy

    @staticmethod
    def backward(ctx, grad_log_probs, grad_entropy):
        logits, labels, lse, entropy = ctx.saved_tensors
        temperature, block = ctx.temperature, ctx.block
        grad = torch.empty_like(logits)
        with_entropy = grad_entropy is not None and entropy.numel() > 0
        for start in range(0, logits.shape[0], block):
            end = min(start + block, logits.shape[0])
            z = _scaled(logits[start:end], temperature)
            # softmax's own kernel, not exp(z - lse): torch.exp is slow where results are subnormal
            p = torch.softmax(z, dim=-1)
            g = grad_log_probs[start:end, None] if grad_log_probs is not None else None
            if with_entropy:
                expected_z = (lse[start:end] - entropy[start:end])[:, None]
                coeff = (expected_z - z).mul_(grad_entropy[start:end, None])
                if g is not None:
                    coeff.sub_(g)
                p.mul_(coeff)
            elif g is not None:
                p.mul_(-g)
            else:
                p.zero_()
            if g is not None:
                p.scatter_add_(1, labels[start:end, None], g)
            if temperature != 1.0:
                p.div_(temperature)
            grad[start:end] = p
        return grad, None, None, None, None


def log_probs_and_entropy(
    logits: torch.Tensor,
    labels: torch.Tensor,
    temperature: float = 1.0,
    calculate_entropy: bool = False,
    chunk_tokens: int = 1024,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """log softmax(logits / temperature)[label] and the entropy of that distribution, per token.

    `logits` is (N, V) in any float dtype, `labels` (N,) int64. Returns float32 (N,) log-probs and
    (N,) entropies (None unless `calculate_entropy`). At most `chunk_tokens` rows of float32
    vocabulary-wide temporaries exist at once (on CPU fewer: blocks of `CPU_BLOCK_TOKENS`).
    """
    if logits.dim() != 2 or labels.shape != logits.shape[:1]:
        raise ValueError(f"need logits (N, V) and labels (N,), got {tuple(logits.shape)} and {tuple(labels.shape)}")
    if temperature <= 0:
        raise ValueError(f"temperature must be > 0, got {temperature}")
    if chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be >= 1, got {chunk_tokens}")
    block = min(chunk_tokens, CPU_BLOCK_TOKENS) if logits.device.type == "cpu" else chunk_tokens
    log_probs, entropy = _TokenLogProbs.apply(logits, labels, float(temperature), calculate_entropy, block)
    return log_probs, (entropy if calculate_entropy else None)
