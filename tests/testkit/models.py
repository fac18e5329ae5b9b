"""A random Qwen2 causal LM saved as a Hugging Face directory, for rollout tests and benchmarks.

No weights can be downloaded here, and vLLM needs a real model directory (config.json +
safetensors; with `skip_tokenizer_init` no tokenizer). head_dim must be >= 32 for vLLM's CPU
attention. The default init std (0.2, vs 0.02 in transformers) makes next-token distributions
peaked, so greedy decoding has clear winners and HF and vLLM can be compared token by token.
The sizes are tuned for the rollout tests (vocab small enough for fast CPU logprobs); the model
itself is made by `ballast.models.save_random_qwen2`, as is the engine tests' `build_tiny_causal_lm`.
"""

from __future__ import annotations


def build_tiny_qwen2(
    path: str,
    *,
    vocab_size: int = 256,
    hidden_size: int = 64,
    num_hidden_layers: int = 2,
    num_attention_heads: int = 2,
    num_key_value_heads: int = 2,
    head_dim: int = 32,
    intermediate_size: int = 128,
    max_position_embeddings: int = 512,
    init_std: float = 0.2,
    tie_word_embeddings: bool = False,
    eos_token_id: int = 1,
    pad_token_id: int = 0,
    seed: int = 0,
) -> str:
    """Write a random float32 Qwen2ForCausalLM to `path` (created if needed) and return `path`."""
    from ballast.models import save_random_qwen2

    if head_dim < 32:
        raise ValueError(f"head_dim={head_dim} must be >= 32 (vLLM's CPU attention rejects smaller heads)")
    save_random_qwen2(
        path, seed=seed, vocab_size=vocab_size, hidden_size=hidden_size, num_hidden_layers=num_hidden_layers,
        num_attention_heads=num_attention_heads, num_key_value_heads=num_key_value_heads, head_dim=head_dim,
        intermediate_size=intermediate_size, max_position_embeddings=max_position_embeddings,
        initializer_range=init_std, tie_word_embeddings=tie_word_embeddings, eos_token_id=eos_token_id,
        bos_token_id=eos_token_id, pad_token_id=pad_token_id,
    )
    return path


def build_tiny_causal_lm(
    path: str,
    seed: int = 0,
    vocab_size: int = 128,
    hidden_size: int = 64,
    num_layers: int = 2,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    intermediate_size: int = 128,
    max_positions: int = 1024,
    tie_word_embeddings: bool = False,
) -> str:
    """Save a random Qwen2ForCausalLM (head_dim = hidden / heads) into `path`; returns `path`."""
    from ballast.models import save_random_qwen2

    save_random_qwen2(
        path, seed=seed, vocab_size=vocab_size, hidden_size=hidden_size, intermediate_size=intermediate_size,
        num_hidden_layers=num_layers, num_attention_heads=num_heads, num_key_value_heads=num_kv_heads,
        head_dim=hidden_size // num_heads, max_position_embeddings=max_positions,
        tie_word_embeddings=tie_word_embeddings, use_cache=False,
    )
    return path
