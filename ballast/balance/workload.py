"""Workload models: turn per-sample token counts into per-sample costs for the balancers.

Three models are offered:

* ``"tokens"``: the sequence length itself (what a token budget limits: memory).
* ``"verl"``: ``24576 * L + L**2``, the fixed formula verl uses (a 7B-shaped estimate), kept for
  parity and for side-by-side comparison.
* :class:`FlopsModel`: forward FLOPs of a decoder-only transformer built from its config numbers,
  linear terms per token plus the causal attention term per (query, key) pair. Training cost is a
  constant multiple of it (backward ~ 2x forward for both terms), so it balances training too.

Every model is evaluated in int64/float64: ``L**2`` for a 1M-token sequence is 1e12, far past int32
(verl computed it in the lengths tensor's dtype and overflowed).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Sequence, Union, get_args

import numpy as np

# verl's calibration: 12 * hidden**2 with hidden = 4096 folded into one constant (divided by 2*hidden).
VERL_LINEAR_COEFF = 24576


@dataclasses.dataclass(frozen=True)
class FlopsModel:
    """Forward FLOPs of one packed sequence of length ``L`` through a decoder-only transformer.

    ``cost(L) = L * linear_flops_per_token + attention_flops_per_pair * L * (L + 1) / 2``

    where the linear part counts every matmul (Q, K, V, O projections with grouped KV heads, the MLP,
    and the LM head) at 2 FLOPs per multiply-add, and the causal attention part counts ``QK^T`` and
    ``softmax(QK^T) V`` over the ``L (L + 1) / 2`` visible pairs. Element-wise ops are ignored.
    """

    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    intermediate_size: int
    vocab_size: int
    head_dim: int | None = None
    # SwiGLU-style MLPs (Llama, Qwen, Mistral) have three matrices; GPT-2 style MLPs have two.
    num_mlp_matrices: int = 3

    def __post_init__(self) -> None:
        for name in ("hidden_size", "num_layers", "num_heads", "num_kv_heads", "intermediate_size", "vocab_size"):
            value = getattr(self, name)
            if not isinstance(value, (int, np.integer)) or isinstance(value, bool) or value <= 0:
                raise ValueError(f"FlopsModel.{name} must be a positive integer, got {value!r}")
        if self.num_heads % self.num_kv_heads != 0:
            raise ValueError(
                f"FlopsModel.num_heads ({self.num_heads}) must be a multiple of num_kv_heads ({self.num_kv_heads})"
            )
        if self.head_dim is not None and (not isinstance(self.head_dim, (int, np.integer)) or self.head_dim <= 0):
            raise ValueError(f"FlopsModel.head_dim must be a positive integer or None, got {self.head_dim!r}")
        if self.head_dim is None and self.hidden_size % self.num_heads != 0:
            raise ValueError(
                f"FlopsModel: hidden_size ({self.hidden_size}) is not divisible by num_heads ({self.num_heads}); "
                "pass head_dim explicitly"
            )
        if self.num_mlp_matrices not in (2, 3):
            raise ValueError(f"FlopsModel.num_mlp_matrices must be 2 or 3, got {self.num_mlp_matrices!r}")

    @property
    def resolved_head_dim(self) -> int:
        return int(self.head_dim) if self.head_dim is not None else self.hidden_size // self.num_heads

    @property
    def linear_flops_per_token(self) -> float:
        h, d = float(self.hidden_size), float(self.resolved_head_dim)
        q_width, kv_width = self.num_heads * d, self.num_kv_heads * d
        attn_proj = 2.0 * h * (q_width + 2.0 * kv_width) + 2.0 * q_width * h
        mlp = 2.0 * self.num_mlp_matrices * h * self.intermediate_size
        lm_head = 2.0 * h * self.vocab_size
        return self.num_layers * (attn_proj + mlp) + lm_head

    @property
    def attention_flops_per_pair(self) -> float:
        # QK^T and PV: 2 FLOPs per multiply-add each, over every query head.
        return 4.0 * self.num_layers * self.num_heads * self.resolved_head_dim

    def __call__(self, lengths: Any) -> np.ndarray:
        tokens = _as_lengths(lengths).astype(np.float64)
        return tokens * self.linear_flops_per_token + self.attention_flops_per_pair * tokens * (tokens + 1.0) / 2.0

    @classmethod
    def from_hf_config(cls, cfg: Any) -> "FlopsModel":
        """Build from a transformers ``PretrainedConfig`` or a plain dict (``config.json`` contents).

        Multimodal configs that nest the language model under ``text_config`` use that sub-config.
        """
        text_cfg = _get(cfg, "text_config", None)
        if text_cfg is not None and _get(cfg, "hidden_size", None) is None:
            cfg = text_cfg

        def required(key: str) -> int:
            value = _get(cfg, key, None)
            if value is None:
                raise ValueError(f"FlopsModel.from_hf_config: the config has no '{key}'")
            return int(value)

        num_heads = required("num_attention_heads")
        num_kv_heads = _get(cfg, "num_key_value_heads", None)
        head_dim = _get(cfg, "head_dim", None)
        return cls(
            hidden_size=required("hidden_size"),
            num_layers=required("num_hidden_layers"),
            num_heads=num_heads,
            num_kv_heads=int(num_kv_heads) if num_kv_heads is not None else num_heads,
            intermediate_size=required("intermediate_size"),
            vocab_size=required("vocab_size"),
            head_dim=int(head_dim) if head_dim is not None else None,
        )


# The named workloads; a FlopsModel instance is the third kind (built from a model config by the caller).
WorkloadName = Literal["tokens", "verl"]
WORKLOAD_NAMES: tuple[str, ...] = get_args(WorkloadName)
Workload = Union[WorkloadName, FlopsModel]


def _get(cfg: Any, key: str, default: Any) -> Any:
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def _as_lengths(lengths: Any) -> np.ndarray:
    """Lengths as a 1-D int64 array; rejects negative, fractional or multi-dimensional input."""
    if hasattr(lengths, "detach"):  # a torch tensor, without importing torch
        lengths = lengths.detach().cpu().numpy()
    arr = np.asarray(lengths)
    if arr.ndim != 1:
        raise ValueError(f"lengths must be 1-D, got shape {arr.shape}")
    if arr.size and not np.issubdtype(arr.dtype, np.integer):
        if not np.issubdtype(arr.dtype, np.floating) or not np.all(np.mod(arr, 1) == 0):
            raise ValueError(f"lengths must be whole numbers, got dtype {arr.dtype}")
    arr = arr.astype(np.int64)
    if arr.size and arr.min() < 0:
        bad = int(np.argmin(arr))
        raise ValueError(f"lengths must be >= 0, got {int(arr[bad])} at index {bad}")
    return arr


def workload_costs(lengths: Sequence[int] | np.ndarray, model: Workload = "tokens") -> np.ndarray:
    """Per-sample cost under ``model`` ("tokens", "verl" or a :class:`FlopsModel`), as float64."""
    tokens = _as_lengths(lengths)
    if isinstance(model, FlopsModel):
        return model(tokens)
    if model == "tokens":
        return tokens.astype(np.float64)
    if model == "verl":
        # int64 before squaring: (1M)**2 = 1e12 overflows int32 but not int64.
        return (VERL_LINEAR_COEFF * tokens + tokens * tokens).astype(np.float64)
    raise ValueError(f"unknown workload model {model!r}: expected one of {WORKLOAD_NAMES} or a FlopsModel")
