"""Loss aggregation normalised by mini-batch-global quantities.

A mini-batch is spread over DP ranks and, on each rank, over micro-batches. `agg_loss` turns a
per-token loss matrix of ONE micro-batch into that micro-batch's exact additive share of the
mini-batch loss: summing the shares of every micro-batch on every DP rank gives the loss computed on
the whole mini-batch at once. That is what makes the gradient independent of how the mini-batch was
cut, provided the engine sums (not averages) gradients across ranks; see `ballast.engine.engine`.

Notation for the whole mini-batch (all DP ranks): loss l[b, t], mask m[b, t] in {0, 1},
N_tok = sum_{b,t} m[b, t] (global token count), N_seq = number of sequences (global),
H = `loss_scale_factor` (defaults to the response width R).

A loss that needs another mini-batch-global quantity (e.g. the mean of importance weights under the
policy being trained) declares it as a `MiniBatchStatistic`: sums over rows, which the engine adds up
over every micro-batch and DP rank before the first backward and hands to the loss in `norm.stats`.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Dict, Optional, Protocol, Sequence, runtime_checkable

import torch

LOSS_AGG_MODES = ("token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm")


@dataclass(frozen=True)
class GlobalNorm:
    """Mini-batch-global normalisers, identical on every rank of the mini-batch.

    `num_tokens`: real (mask = 1) loss tokens summed over the DP group. `num_sequences`: sequences
    summed over the DP group. `response_len`: the widest response width R over the DP group, the default
    horizon of `seq-mean-token-sum-norm`. SP peers hold the same data, so they are not summed over.
    """

    num_tokens: int
    num_sequences: int
    response_len: int
    # Sums a loss asked for (`MiniBatchStatistic`), over the whole mini-batch; empty otherwise.
    stats: Dict[str, float] = field(default_factory=dict, hash=False)

    def with_stats(self, stats: Dict[str, float]) -> "GlobalNorm":
        return dataclasses.replace(self, stats={k: float(v) for k, v in stats.items()})

    def __post_init__(self) -> None:
        if self.num_tokens < 0 or self.num_sequences < 0 or self.response_len < 0:
            raise ValueError(f"GlobalNorm counts must be >= 0, got {self}")

    @classmethod
    def local(cls, mask: torch.Tensor) -> "GlobalNorm":
        """The normaliser of a single (B, R) mask seen as the whole mini-batch (single process)."""
        return cls(num_tokens=int(mask.sum()), num_sequences=int(mask.shape[0]), response_len=int(mask.shape[-1]))


@runtime_checkable
class MiniBatchStatistic(Protocol):
    """Sums over rows that a loss needs over its whole mini-batch (every micro-batch, every DP rank).

    `__call__(outputs, micro)` returns one 0-dim tensor per name in `keys`: this micro-batch's part,
    additive over any split of the rows. With `needs_outputs` the engine runs a forward-only pass over
    the mini-batch's micro-batches first (the policy being trained: its outputs are the ones the
    training forward will produce) and passes each micro-batch's `outputs`; otherwise `outputs` is
    None and `micro` may hold all of this rank's rows at once.
    """

    keys: Sequence[str]
    needs_outputs: bool

    def __call__(self, outputs: Optional[dict], micro) -> Sequence[torch.Tensor]: ...


def add_statistic(total: torch.Tensor, statistic: MiniBatchStatistic, outputs: Optional[dict], micro) -> None:
    """Add one micro-batch's part of `statistic` to `total` (float64, one entry per key, on its device)."""
    parts = statistic(outputs, micro)
    total.add_(torch.stack([torch.as_tensor(p, device=total.device).to(torch.float64).reshape(()) for p in parts]))


def mini_batch_statistic(loss_fn) -> Optional[MiniBatchStatistic]:
    """The statistic a loss callable declares in its `mini_batch_statistic` attribute, or None."""
    return getattr(loss_fn, "mini_batch_statistic", None)


def agg_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    norm: GlobalNorm,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """This micro-batch's share of the mini-batch loss, aggregated as `mode`.

    Modes (sums over this micro-batch's rows b and tokens t; N_tok, N_seq, H as in the module doc):

    * ``token-mean``:              sum_{b,t} l*m / N_tok
      (every token of the mini-batch weighs the same).
    * ``seq-mean-token-sum``:      sum_b (sum_t l*m) / N_seq
      (per-sequence token sums, averaged over sequences).
    * ``seq-mean-token-mean``:     sum_b (sum_t l*m / max(sum_t m, 1)) / N_seq
      (per-sequence token means, averaged over sequences; an all-masked row contributes 0).
    * ``seq-mean-token-sum-norm``: sum_{b,t} l*m / (N_seq * H)
      (Dr. GRPO: a constant horizon H instead of the sequence length; H = `loss_scale_factor` or
      `norm.response_len`).

    A zero global count gives a zero share (there is nothing to average), never a NaN.
    """
    if loss_mat.shape != mask.shape:
        raise ValueError(f"loss_mat shape {tuple(loss_mat.shape)} != mask shape {tuple(mask.shape)}")
    mask = mask.to(loss_mat.dtype)
    masked = loss_mat * mask
    if mode == "token-mean":
        return masked.sum() / max(norm.num_tokens, 1)
    if mode == "seq-mean-token-sum":
        return masked.sum() / max(norm.num_sequences, 1)
    if mode == "seq-mean-token-mean":
        per_seq = masked.sum(dim=-1) / mask.sum(dim=-1).clamp(min=1.0)
        return per_seq.sum() / max(norm.num_sequences, 1)
    if mode == "seq-mean-token-sum-norm":
        horizon = float(loss_scale_factor) if loss_scale_factor is not None else float(norm.response_len)
        if horizon <= 0:
            raise ValueError(f"seq-mean-token-sum-norm needs a positive horizon, got {horizon}")
        return masked.sum() / (max(norm.num_sequences, 1) * horizon)
    raise ValueError(f"unknown loss aggregation mode {mode!r}; expected one of {LOSS_AGG_MODES}")
