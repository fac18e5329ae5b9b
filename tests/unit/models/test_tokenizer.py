"""The tiny tokenizer: exact round trips, identical ids whichever class loads it, chat template,
special tokens, symbol runs of K characters = K tokens, and load_tokenizer's errors."""

import json
import shutil
import unicodedata

import pytest
from tokenizers import Tokenizer
from transformers import AutoTokenizer, PreTrainedTokenizerFast

from ballast.models import CHAT_TEMPLATE, load_tokenizer
from ballast.models.corpus import TASK_SYMBOLS, training_corpus

TEXTS = [
    "Repeat the symbol # exactly 37 times.",
    "####****@@@@%%%%",
    " leading space, trailing space ",
    "double  space\ttab\n\nblank line\r\nwindows",
    "digits 1234567890 and 3.14159, -42, $1,000.00",
    "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\n#### 72",
    "héllo wörld — naïve café; 世界 你好; emoji 🙂👍",
    "code: def f(x):\n    return x ** 2  # square",
    "don't can't I'm we'll they've she'd",
    "",
    "<|im_start|>user\nhi<|im_end|>\n",
]


@pytest.fixture(scope="module")
def tok(built_dir):
    return AutoTokenizer.from_pretrained(built_dir)


@pytest.mark.parametrize("text", TEXTS)
def test_autotokenizer_round_trip_is_exact(tok, text):
    ids = tok(text, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == text


def test_non_nfc_text_comes_back_nfc_normalised(tok):
    decomposed = "cafe\u0301"  # e + combining acute
    ids = tok(decomposed, add_special_tokens=False)["input_ids"]
    assert tok.decode(ids) == unicodedata.normalize("NFC", decomposed) == "caf\u00e9"


def test_every_loader_gives_the_same_ids(built_dir, tok, tmp_path):
    """AutoTokenizer rebuilds a Qwen2Tokenizer (normaliser and pre-tokenizer from its own code, not
    from tokenizer.json); its ids must equal the trained file's, with or without config.json."""
    raw = Tokenizer.from_file(str(built_dir / "tokenizer.json"))
    fast = PreTrainedTokenizerFast.from_pretrained(built_dir)
    alone = AutoTokenizer.from_pretrained(_copy_tokenizer(built_dir, tmp_path / "alone", with_config=False))
    assert type(tok).__name__ == type(alone).__name__ == "Qwen2Tokenizer"
    for text in TEXTS + training_corpus()[::50]:
        expected = raw.encode(text, add_special_tokens=False).ids
        assert tok(text, add_special_tokens=False)["input_ids"] == expected, text
        assert fast(text, add_special_tokens=False)["input_ids"] == expected, text
        assert alone(text, add_special_tokens=False)["input_ids"] == expected, text


def test_special_tokens(tok):
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>"
    assert tok.bos_token is None
    ids = tok("<|im_start|>x<|im_end|><|endoftext|>", add_special_tokens=False)["input_ids"]
    assert ids[0] == tok.convert_tokens_to_ids("<|im_start|>")
    assert ids[-2:] == [tok.eos_token_id, tok.pad_token_id]
    assert len({tok.eos_token_id, tok.pad_token_id, ids[0]}) == 3
    assert 512 - 16 <= len(tok) <= 1024


def test_chat_template_output(tok):
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Say hi."}]
    with_prompt = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    assert with_prompt == (
        "<|im_start|>system\nBe brief.<|im_end|>\n"
        "<|im_start|>user\nSay hi.<|im_end|>\n"
        "<|im_start|>assistant\n"
    )
    without = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=False)
    assert with_prompt.startswith(without) and not without.endswith("assistant\n")
    assert tok.chat_template == CHAT_TEMPLATE


@pytest.mark.parametrize("symbol", list(TASK_SYMBOLS))
def test_a_run_of_k_symbols_is_k_tokens(tok, symbol):
    single = tok(symbol, add_special_tokens=False)["input_ids"]
    assert len(single) == 1
    for count in (1, 2, 3, 7, 16, 64, 255):
        assert tok(symbol * count, add_special_tokens=False)["input_ids"] == single * count


def test_corpus_never_puts_two_task_symbols_side_by_side():
    for line in training_corpus():
        for a, b in zip(line, line[1:]):
            assert not (a in TASK_SYMBOLS and b in TASK_SYMBOLS), line


def _copy_tokenizer(src, dst, *, with_config, drop=None):
    dst.mkdir()
    names = ["tokenizer.json", "tokenizer_config.json", "chat_template.jinja"] + (["config.json"] if with_config else [])
    for name in names:
        shutil.copy(src / name, dst / name)
    if drop:
        cfg = json.loads((dst / "tokenizer_config.json").read_text())
        cfg[drop] = None
        (dst / "tokenizer_config.json").write_text(json.dumps(cfg))
    return dst


def test_load_tokenizer_loads_the_built_tokenizer(built_dir, tok):
    loaded = load_tokenizer(built_dir)
    assert loaded("a b 12", add_special_tokens=False)["input_ids"] == tok("a b 12", add_special_tokens=False)["input_ids"]


def test_load_tokenizer_errors_name_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError, match="nope.*does not exist"):
        load_tokenizer(missing)
    empty = tmp_path / "empty_model"
    empty.mkdir()
    (empty / "config.json").write_text("{}")
    with pytest.raises(FileNotFoundError, match="no tokenizer in .*empty_model"):
        load_tokenizer(empty)


@pytest.mark.parametrize("with_config", [True, False])
def test_missing_pad_falls_back_to_eos_with_a_warning(built_dir, tmp_path, with_config):
    path = _copy_tokenizer(built_dir, tmp_path / "nopad", with_config=with_config, drop="pad_token")
    with pytest.warns(UserWarning, match="no pad token"):
        loaded = load_tokenizer(path)
    assert loaded.pad_token_id == loaded.eos_token_id is not None


def test_missing_eos_is_an_error(built_dir, tmp_path):
    path = _copy_tokenizer(built_dir, tmp_path / "noeos", with_config=False, drop="eos_token")
    with pytest.raises(ValueError, match="noeos.*no eos token"):
        load_tokenizer(path)
