"""Fixtures of the training tests: feature shards of the tiny openPangu teacher."""
import pytest
from tiny_corpus import conversations


@pytest.fixture(scope="module")
def tiny_features(ms_runtime, tiny, tmp_path_factory):
    """Feature shards of 48 tiny-teacher samples (max_len 64)."""
    from mindspore_eagle.train.data import build_samples
    from mindspore_eagle.train.features import (
        build_runner,
        extract_features,
        head_weight,
    )

    cfg, tensors, tok = tiny
    samples, stats = build_samples(tok, conversations(60), 48, 64, min_assistant=4, eval_keys=set())
    assert stats.kept == 48 and stats.template_mismatch == 0
    d = tmp_path_factory.mktemp("features")
    runner, _ = build_runner(cfg, tensors, 64)
    man = extract_features(runner, head_weight(cfg, tensors), samples, str(d), shard_size=16)
    assert [s["n"] for s in man["shards"]] == [16, 16, 16]
    return str(d)
