"""models/gguf_meta.py: metadata values read back from a GGUF file written here with the gguf package."""
from __future__ import annotations

import gguf
import numpy as np
import pytest

from mindspore_eagle.models.model_config import CheckpointError
from mindspore_eagle.models.gguf_meta import gguf_value


@pytest.fixture(scope="module")
def reader(tmp_path_factory):
    path = tmp_path_factory.mktemp("gguf") / "meta.gguf"
    w = gguf.GGUFWriter(str(path), "llama")
    w.add_string("general.name", "tiny test")
    w.add_uint32("llama.block_count", 3)
    w.add_float32("llama.rope.freq_base", 10000.5)
    w.add_bool("tokenizer.ggml.add_bos_token", True)
    w.add_array("tokenizer.ggml.tokens", ["<s>", "a", "b"])
    w.add_tensor("x", np.zeros((2, 2), np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return gguf.GGUFReader(str(path))


def test_values_of_each_type(reader):
    assert gguf_value(reader, "general.name") == "tiny test"
    assert gguf_value(reader, "general.architecture") == "llama"
    assert gguf_value(reader, "llama.block_count") == 3
    assert gguf_value(reader, "llama.rope.freq_base") == pytest.approx(10000.5)
    assert gguf_value(reader, "tokenizer.ggml.add_bos_token") is True
    assert list(gguf_value(reader, "tokenizer.ggml.tokens")) == ["<s>", "a", "b"]


def test_missing_key(reader):
    assert gguf_value(reader, "llama.attention.layer_norm_rms_epsilon", 1e-5) == 1e-5
    assert gguf_value(reader, "nope", None) is None
    with pytest.raises(CheckpointError, match="GGUF metadata: missing required key 'llama.context_length'"):
        gguf_value(reader, "llama.context_length")
