"""Offline byte-level BPE tokenizer for the tiny model, and the one way Ballast loads tokenizers.

Why the pipeline looks exactly like Qwen2's: with a `model_type: qwen2` config.json in the same
folder, transformers 5.x `AutoTokenizer` (and therefore vLLM) ignores `tokenizer_class` in
tokenizer_config.json and instantiates `Qwen2Tokenizer`, which rebuilds the normalizer and
pre-tokenizer from scratch (NFC + Qwen's split regex + byte-level) and keeps only the vocab and
merges from tokenizer.json. Training with that same pipeline makes every loader (AutoTokenizer,
vLLM, `tokenizers.Tokenizer.from_file`, `PreTrainedTokenizerFast`) produce identical ids. A
consequence shared with real Qwen models: text is NFC-normalised, so decode(encode(s)) == s exactly
for NFC text (all ASCII and the usual precomposed Unicode), and == NFC(s) otherwise.

Special tokens follow Qwen's chat models: `<|endoftext|>` pads, `<|im_end|>` ends a turn and is the
eos token, `<|im_start|>` opens a turn. There is no bos token (the template does not need one).
"""

from __future__ import annotations

import os
import warnings
from pathlib import Path

PAD_TOKEN = "<|endoftext|>"
IM_START_TOKEN = "<|im_start|>"
IM_END_TOKEN = "<|im_end|>"
EOS_TOKEN = IM_END_TOKEN
SPECIAL_TOKENS = (PAD_TOKEN, IM_START_TOKEN, IM_END_TOKEN)

# Qwen2's pre-tokenizer split (see module docstring for why it must be the same): contractions,
# words with one optional leading non-letter, single digits, punctuation runs, newlines, spaces.
QWEN2_SPLIT_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# ChatML, as Qwen's chat models use it, without a default system message (keeps prompts short).
CHAT_TEMPLATE = (
    "{%- for message in messages -%}"
    "{{- '<|im_start|>' + message['role'] + '\\n' + message['content'] + '<|im_end|>\\n' -}}"
    "{%- endfor -%}"
    "{%- if add_generation_prompt -%}"
    "{{- '<|im_start|>assistant\\n' -}}"
    "{%- endif -%}"
)

# Files whose presence means "a tokenizer was saved here" (fast, or slow vocab formats).
_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "vocab.json", "tokenizer.model")


def _backend_pipeline():
    """A `tokenizers.Tokenizer` with an empty BPE model and the Qwen2-identical pipeline."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers

    tok = Tokenizer(models.BPE(unk_token=None, fuse_unk=False, byte_fallback=False))
    tok.normalizer = normalizers.NFC()
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(QWEN2_SPLIT_PATTERN), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def train_tokenizer(corpus: list[str], vocab_size: int):
    """Train the byte-level BPE on `corpus`; returns a `transformers` fast tokenizer (unsaved).

    Special tokens take ids 0..2, then the 256 byte symbols, then merges up to `vocab_size`
    (fewer if the corpus runs out of pairs).
    """
    from tokenizers import pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    min_vocab = len(SPECIAL_TOKENS) + 256
    if vocab_size <= min_vocab:
        raise ValueError(f"vocab_size={vocab_size} must exceed {min_vocab} (special tokens + 256 bytes)")
    tok = _backend_pipeline()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(corpus, trainer=trainer)
    return PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=None,
        eos_token=EOS_TOKEN,
        pad_token=PAD_TOKEN,
        unk_token=None,
        additional_special_tokens=[IM_START_TOKEN],
        chat_template=CHAT_TEMPLATE,
        # Without this, decode() rewrites " ." to "." and the round trip is no longer exact.
        clean_up_tokenization_spaces=False,
        model_input_names=["input_ids", "attention_mask"],
    )


def save_tokenizer(tokenizer, out_dir: str | os.PathLike) -> None:
    """save_pretrained, then name the class that will really load it.

    `Qwen2Tokenizer` is what AutoTokenizer picks next to a qwen2 config.json anyway; naming it in
    tokenizer_config.json makes a tokenizer-only copy of the folder load the same class too.
    """
    import json

    tokenizer.save_pretrained(out_dir)
    config_path = Path(out_dir) / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["tokenizer_class"] = "Qwen2Tokenizer"
    config_path.write_text(json.dumps(config, indent=2, ensure_ascii=False) + "\n")


def pipeline_fingerprint() -> str:
    """Text that changes whenever the trained tokenizer would (part of the model cache key)."""
    return "\n".join([QWEN2_SPLIT_PATTERN, CHAT_TEMPLATE, *SPECIAL_TOKENS])


def load_tokenizer(path: str | os.PathLike):
    """Load the tokenizer saved in the model directory `path` the same way everywhere.

    Uses `AutoTokenizer` (what vLLM uses too) with local files only. A tokenizer without a pad token
    gets its eos token as pad (with a warning); one without an eos token is an error, because
    rollouts could never end and response masks could not be built.
    """
    from transformers import AutoTokenizer

    directory = Path(path)
    if not directory.exists():
        raise FileNotFoundError(f"tokenizer path {str(directory)!r} does not exist")
    if not directory.is_dir():
        raise FileNotFoundError(f"tokenizer path {str(directory)!r} is not a directory")
    if not any((directory / name).is_file() for name in _TOKENIZER_FILES):
        raise FileNotFoundError(
            f"no tokenizer in {str(directory)!r}: expected one of {list(_TOKENIZER_FILES)}"
        )
    try:
        tokenizer = AutoTokenizer.from_pretrained(str(directory), local_files_only=True)
    except Exception as err:  # transformers raises many types; keep the path in the message
        raise ValueError(f"could not load the tokenizer in {str(directory)!r}: {err}") from err
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {str(directory)!r} has no eos token; set eos_token in tokenizer_config.json")
    if tokenizer.pad_token_id is None:
        warnings.warn(
            f"the tokenizer in {str(directory)!r} has no pad token; using its eos token "
            f"{tokenizer.eos_token!r} (id {tokenizer.eos_token_id}) as pad",
            UserWarning,
            stacklevel=2,
        )
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
