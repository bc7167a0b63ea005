"""GGUF metadata access shared by the checkpoint loader and the tokenizer (so neither imports the other's module
for it: ``models.checkpoints`` imports ``tokenizer``, never the reverse)."""
from __future__ import annotations

from mindspore_eagle.models.model_config import CheckpointError


def gguf_value(reader, key: str, default=KeyError):
    """Metadata value `key` of a `gguf.GGUFReader` (str/int/float/bool/list); `default` when absent.

    Raises:
        CheckpointError: the key is absent and no default was given (names the key).
    """
    field = reader.fields.get(key)
    if field is None:
        if default is KeyError:
            raise CheckpointError(f"GGUF metadata: missing required key '{key}'")
        return default
    return field.contents()


__all__ = ["gguf_value"]
