"""Model weight files are checked before any worker starts: a truncated or garbage safetensors file,
or a shard index naming a missing file, is an error naming the file; the real tiny model passes, and
so does a sharded copy of it."""

import json
import struct

import pytest

from ballast.models.weights_check import ModelFilesError, check_model_files, check_safetensors_file


def test_intact_model_passes(model_copy):
    assert check_model_files(str(model_copy)) == [str(model_copy / "model.safetensors")]


def test_truncated_safetensors_names_the_file_and_both_sizes(model_copy):
    path = model_copy / "model.safetensors"
    full = path.stat().st_size
    with open(path, "r+b") as f:
        f.truncate(full - 1000)
    with pytest.raises(ModelFilesError, match=rf"model file '{path}' has {full - 1000} bytes but its header "
                                              rf"describes {full}: the file is truncated"):
        check_model_files(str(model_copy))


@pytest.mark.parametrize("blob, fragment", [
    (b"abc", r"too short for a safetensors header"),
    (struct.pack("<Q", 1 << 40) + b"{}", r"claims a 1099511627776-byte header: truncated or not a safetensors file"),
    (struct.pack("<Q", 5) + b"{nope", r"unreadable safetensors header"),
    (struct.pack("<Q", 2) + b"[]", r"the safetensors header is not a JSON object"),
    (struct.pack("<Q", 13) + b'{"w": {"x":1}}'[:13], r"unreadable safetensors header|no valid data_offsets"),
], ids=["short", "huge header", "bad json", "not a dict", "no offsets"])
def test_garbage_files_are_named(tmp_path, blob, fragment):
    path = tmp_path / "model.safetensors"
    path.write_bytes(blob)
    with pytest.raises(ModelFilesError, match=fragment):
        check_safetensors_file(str(path))


def test_shard_index_naming_a_missing_file(model_copy):
    index = {"metadata": {}, "weight_map": {"lm_head.weight": "model-00002-of-00002.safetensors",
                                            "model.embed_tokens.weight": "model.safetensors"}}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(ModelFilesError, match=r"names 'model-00002-of-00002\.safetensors', which is not in"):
        check_model_files(str(model_copy))
