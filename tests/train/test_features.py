"""train/features.py: resumable feature shards, memory-mapped shard members, a mapped feature set equal to a
loaded one."""
from __future__ import annotations

import numpy as np
import pytest


def test_features_resume_skips_finished_shards(tiny, tiny_features):
    from mindspore_eagle.train.features import FeatureSet, extract_features, head_weight

    cfg, tensors, _ = tiny
    fs = FeatureSet(tiny_features)
    assert len(fs) == 48
    d = fs[0]
    assert d["aux"].dtype == np.float16 and d["aux"].shape == (len(d["input_ids"]), 3 * cfg.hidden_size)

    class NoRunner:  # every shard is listed: the teacher must not run again
        def new_seq(self):
            raise AssertionError("teacher ran for a finished shard")
    man = extract_features(NoRunner(), head_weight(cfg, tensors), [(d["input_ids"], d["loss_mask"])] * 48,
                           tiny_features, shard_size=16)
    assert len(man["shards"]) == 3


def test_load_shard_maps_each_savez_member_to_its_exact_array(tmp_path):
    """load_shard memory-maps the members of an np.savez file (read-only np.memmap) and returns exactly what
    np.load reads, for C / Fortran order, 0-d, empty and wide-dtype members; an np.savez_compressed file falls
    back to arrays in memory; a member that is not a .npy array is a one-line error."""
    import zipfile

    from mindspore_eagle.train.features import load_shard

    rng = np.random.default_rng(0)
    cols = {"aux": rng.standard_normal((37, 11)).astype(np.float16), "ids": np.arange(37, dtype=np.int32),
            "fort": np.asfortranarray(rng.standard_normal((5, 3))), "scalar": np.array(7, np.int64),
            "empty": np.zeros((0, 4), np.float32), "u8": (rng.random(9) > 0.5).astype(np.uint8)}
    for save, mapped in ((np.savez, True), (np.savez_compressed, False)):
        path = str(tmp_path / f"{save.__name__}.npz")
        save(path, **cols)
        got = load_shard(path)
        assert set(got) == set(cols)
        for k, v in cols.items():
            assert got[k].dtype == v.dtype and got[k].shape == v.shape
            np.testing.assert_array_equal(got[k], v)
        assert isinstance(got["aux"], np.memmap) is mapped
        if mapped:
            assert not got["aux"].flags.writeable and got["fort"].flags.f_contiguous
    bad = str(tmp_path / "bad.npz")
    with zipfile.ZipFile(bad, "w") as zf:
        zf.writestr("notes.txt", "x")
    with pytest.raises(ValueError, match="notes.txt.*not a .npy array"):
        load_shard(bad)


def test_feature_set_mapped_equals_loaded(tiny_features):
    """FeatureSet over memory-mapped shards (the default) gives every column of every sample exactly as with the
    shards loaded into memory."""
    from mindspore_eagle.train.features import COLUMNS, FeatureSet

    mapped, loaded = FeatureSet(tiny_features), FeatureSet(tiny_features, mmap=False)
    assert len(mapped) == len(loaded) == 48 and mapped.tokens == loaded.tokens
    assert isinstance(mapped[0]["aux"], np.memmap) and not isinstance(loaded[0]["aux"], np.memmap)
    for i in range(48):
        for c in COLUMNS:
            np.testing.assert_array_equal(mapped[i][c], loaded[i][c])
