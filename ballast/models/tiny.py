"""Build a random-init Qwen2 causal LM plus its tokenizer offline, and cache it for tests and runs.

Nothing can be downloaded here, so tests, benchmarks and the quickstart use a model built on the
spot: a `Qwen2ForCausalLM` with random weights and the byte-level BPE of `ballast.models.tokenizer`,
saved together in ONE Hugging Face directory (so `actor_rollout_ref.model.path` points at it and
`AutoModelForCausalLM`, `AutoTokenizer` and vLLM all load it).

    python -m ballast.models.tiny --out DIR [--preset tiny|small] [--seed N]
    ballast-build-tiny --out DIR          # the same, as a console script

`tiny_model_dir(preset)` builds once per settings into `$BALLAST_CACHE_DIR/models/` and reuses it.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path

from ballast.models.corpus import training_corpus
from ballast.models.tokenizer import pipeline_fingerprint, save_tokenizer, train_tokenizer

# Bump when the builder's output changes for the same settings (corpus, pipeline, config fields):
# it is part of the cache key, so stale cached models are never reused.
BUILDER_VERSION = 1

# head_dim = hidden_size / num_attention_heads is 32 in both presets: vLLM's CPU attention rejects
# 16. "tiny" ties the input and output embeddings like Qwen2.5-0.5B; "small" does not, like the
# larger Qwen2 models, so the tests (tiny) and the benchmarks (small) exercise both layouts.
# use_cache stays at the config default (True). Training code must pass use_cache=False: with a
# cache, transformers silently ignores packed position_ids (docs/engine.md, "transformers and torch on CPU").
PRESETS: dict[str, dict] = {
    "tiny": dict(
        hidden_size=128,
        intermediate_size=384,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        tie_word_embeddings=True,
        tokenizer_vocab_size=512,
    ),
    "small": dict(
        hidden_size=256,
        intermediate_size=1024,
        num_hidden_layers=4,
        num_attention_heads=8,
        num_key_value_heads=2,
        max_position_embeddings=4096,
        tie_word_embeddings=False,
        tokenizer_vocab_size=512,
    ),
}
_MIN_HEAD_DIM = 32
_MARKER_FILE = "ballast_build.json"  # written last; its presence means the build completed


def resolve_settings(preset: str = "tiny", seed: int = 0, **overrides) -> dict:
    """Preset merged with overrides, validated; the exact inputs of a build (and its cache key)."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    settings = dict(PRESETS[preset])
    unknown = sorted(set(overrides) - set(settings))
    if unknown:
        # Imported only here so that finding an already-built model stays free of transformers.
        from transformers import Qwen2Config

        unknown = sorted(set(unknown) - set(Qwen2Config().to_dict()))
    if unknown:
        raise ValueError(f"unknown model overrides {unknown}; allowed: Qwen2Config fields and 'tokenizer_vocab_size'")
    settings.update(overrides)
    hidden, heads, kv_heads = settings["hidden_size"], settings["num_attention_heads"], settings["num_key_value_heads"]
    if hidden % heads:
        raise ValueError(f"hidden_size={hidden} is not divisible by num_attention_heads={heads}")
    if hidden // heads < _MIN_HEAD_DIM:
        raise ValueError(
            f"head_dim = hidden_size/num_attention_heads = {hidden}/{heads} = {hidden // heads} < {_MIN_HEAD_DIM}"
            " (vLLM's CPU attention rejects smaller heads)"
        )
    if heads % kv_heads:
        raise ValueError(f"num_attention_heads={heads} is not divisible by num_key_value_heads={kv_heads}")
    return {"preset": preset, "seed": int(seed), "builder_version": BUILDER_VERSION, **settings}


def settings_hash(settings: dict) -> str:
    """Short stable hash of resolved settings plus the tokenizer's inputs (corpus, split pattern,
    chat template): the cache key, so editing any of them gives a fresh cached build."""
    digest = hashlib.sha256(json.dumps(settings, sort_keys=True, default=str).encode())
    digest.update("\n".join(training_corpus(seed=0)).encode())
    digest.update(pipeline_fingerprint().encode())
    return digest.hexdigest()[:12]


def save_random_qwen2(out_dir: str | os.PathLike, *, seed: int = 0, **config_fields):
    """Save a random-init float32 Qwen2ForCausalLM built from `Qwen2Config(**config_fields)` (weights only).

    The one place Ballast makes random models: the tiny presets below, and the smaller models the
    engine and rollout tests size for themselves. The caller's global RNG stream is not moved.
    Returns the model.
    """
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(**config_fields)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = Qwen2ForCausalLM(config).to(torch.float32)
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    with _quiet_progress_bars():
        model.save_pretrained(out_dir)
    return model


def build_tiny_model(out_dir: str | os.PathLike, *, preset: str = "tiny", seed: int = 0, **overrides) -> Path:
    """Write a random-init Qwen2ForCausalLM and its tokenizer into `out_dir`; return the path.

    `overrides` replace Qwen2Config fields of the preset (e.g. `num_hidden_layers=3`) or the
    tokenizer size (`tokenizer_vocab_size`). Same settings and seed give identical weights.
    """
    from transformers import GenerationConfig

    settings = resolve_settings(preset, seed, **overrides)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    model_fields = {k: v for k, v in settings.items() if k not in ("preset", "seed", "builder_version", "tokenizer_vocab_size")}
    tokenizer = train_tokenizer(training_corpus(seed=0), settings["tokenizer_vocab_size"])
    tokenizer.model_max_length = model_fields["max_position_embeddings"]
    model = save_random_qwen2(
        out, seed=seed,
        vocab_size=len(tokenizer),  # exact: ids the tokenizer cannot decode must never be sampled
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        # Qwen convention: no bos token in the tokenizer, <|endoftext|> as the config's bos id.
        bos_token_id=tokenizer.pad_token_id,
        architectures=["Qwen2ForCausalLM"],
        **model_fields,
    )
    config = model.config
    save_tokenizer(tokenizer, out)
    # Only token ids: vLLM takes sampling defaults (temperature, top_k, ...) from this file, and RL
    # rollouts must sample from the unmodified policy.
    GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id, pad_token_id=config.pad_token_id
    ).save_pretrained(out)
    num_params = sum(p.numel() for p in model.parameters())
    info = {**settings, "num_params": num_params, "vocab_size": len(tokenizer), "hash": settings_hash(settings)}
    (out / _MARKER_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    return out


class _quiet_progress_bars:
    """Silence transformers' shard-writing progress bar for one save, then restore the setting."""

    def __enter__(self):
        from transformers.utils import logging as hf_logging

        self._was_enabled = hf_logging.is_progress_bar_enabled()
        hf_logging.disable_progress_bar()

    def __exit__(self, *exc):
        from transformers.utils import logging as hf_logging

        if self._was_enabled:
            hf_logging.enable_progress_bar()


def build_info(model_dir: str | os.PathLike) -> dict:
    """What `build_tiny_model` recorded about a directory it built (settings, params, vocab)."""
    marker = Path(model_dir) / _MARKER_FILE
    if not marker.is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} was not built by build_tiny_model (no {_MARKER_FILE})")
    return json.loads(marker.read_text())


def default_cache_dir() -> Path:
    """$BALLAST_CACHE_DIR, else <repo>/.cache in a source checkout, else ~/.cache/ballast."""
    env = os.environ.get("BALLAST_CACHE_DIR")
    if env:
        return Path(env)
    repo = Path(__file__).resolve().parents[2]
    if (repo / "pyproject.toml").is_file():
        return repo / ".cache"
    return Path.home() / ".cache" / "ballast"


def tiny_model_dir(preset: str = "tiny", *, seed: int = 0, **overrides) -> Path:
    """Path of a cached built model for these settings, building it first if needed (`build_once`)."""
    settings = resolve_settings(preset, seed, **overrides)
    final = default_cache_dir() / "models" / f"{preset}-{settings_hash(settings)}"
    return build_once(final, _MARKER_FILE, lambda out: build_tiny_model(out, preset=preset, seed=seed, **overrides))


def build_once(final: Path, marker_file: str, build) -> Path:
    """`final`, calling `build(tmp_dir)` first unless `final/marker_file` (written last by the build)
    already exists.

    The build goes into a fresh temporary directory next to the target and is renamed into place:
    rename is atomic, so readers see either nothing or a complete directory, and when two processes
    race the loser discards its copy and uses the winner's (same inputs give the same files).
    """
    if (final / marker_file).is_file():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.tmp-", dir=final.parent))
    try:
        build(tmp)
        os.chmod(tmp, 0o755)  # mkdtemp makes it 0700; the cache is shared with other processes
        try:
            os.rename(tmp, final)
        except OSError:
            # Lost the race (the target exists and is not empty). The winner's copy is complete
            # because it, too, appeared by rename.
            if not (final / marker_file).is_file():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return final


def main(argv: list[str] | None = None) -> int:
    """CLI: build a model directory and print what was built."""
    parser = argparse.ArgumentParser(prog="ballast-build-tiny", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write the model and tokenizer into")
    parser.add_argument("--preset", default="tiny", choices=sorted(PRESETS))
    parser.add_argument("--seed", type=int, default=0, help="weight initialisation seed")
    args = parser.parse_args(argv)
    path = build_tiny_model(args.out, preset=args.preset, seed=args.seed)
    info = build_info(path)
    print(
        f"built preset={info['preset']} seed={info['seed']} params={info['num_params']:,} "
        f"vocab={info['vocab_size']} layers={info['num_hidden_layers']} hidden={info['hidden_size']} "
        f"heads={info['num_attention_heads']}/{info['num_key_value_heads']} "
        f"tied_embeddings={info['tie_word_embeddings']} path={path.resolve()}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
