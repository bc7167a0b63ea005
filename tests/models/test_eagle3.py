"""models/eagle3.py: drafter checkpoints (round trip, the EAGLE-3 reference layout and its d2t map, refused files),
and float16 weights on the CPU backend (bit for bit the float32 drafter on the rounded matrices)."""
import json

import mindspore as ms
import numpy as np
import pytest
from tiny_engines import round_matrices as _round_matrices
from tiny_engines import tiny_drafter_dir

from mindspore_eagle.kernels import cpu
from mindspore_eagle.models.eagle3 import (
    DrafterConfig,
    load_drafter,
    save_drafter,
    vocab_maps,
)


def test_drafter_checkpoint_roundtrip_and_reference_layout(ms_runtime, tmp_path, tiny):
    tcfg = tiny[0]
    d = tiny_drafter_dir(tmp_path, tcfg, seed=3, vd=50)
    cfg, t = load_drafter(str(d))
    assert cfg.draft_vocab_size == 50 and cfg.aux_layers == tuple(tcfg.aux_layers)
    cfg2, t2 = load_drafter(str(d))
    save_drafter(str(tmp_path / "again"), cfg2, t2)
    _, t3 = load_drafter(str(tmp_path / "again"))
    for k in t:
        assert np.array_equal(t[k], t3[k]), k
    # a checkpoint written with the EAGLE-3 reference names (vLLM-style "layers.0." too) and a non-trivial d2t
    import mindspore as ms
    from safetensors.numpy import save_file

    from mindspore_eagle.models.eagle3 import Eagle3Drafter

    used = np.array([3, 17, 40, 41, 99, 120, 250, 300])
    ref = {k.replace("midlayer.", "layers.0."): v.astype(np.float16) for k, v in t.items() if k not in ("d2t", "t2d")}
    ref["lm_head.weight"] = np.zeros((8, tcfg.hidden_size), np.float16)
    ref.update({k: v for k, v in vocab_maps(used, tcfg.vocab_size).items()})
    cfg_json = json.loads((d / "config.json").read_text())
    cfg_json["draft_vocab_size"] = 8
    ref_dir = tmp_path / "reference"
    ref_dir.mkdir()
    (ref_dir / "config.json").write_text(json.dumps(cfg_json))
    save_file(ref, str(ref_dir / "model.safetensors"))
    rcfg, rt = load_drafter(str(ref_dir))
    assert np.array_equal(rt["d2t"] + np.arange(8), used)
    rt["norm.weight"] = np.ones_like(rt["norm.weight"])
    for j in range(8):                                   # make draft id j the argmax: must map to used[j]
        rt["lm_head.weight"] = np.zeros_like(rt["lm_head.weight"])
        rt["lm_head.weight"][j] = 1.0
        embed = ms.Parameter(ms.Tensor(np.ones((tcfg.vocab_size, tcfg.hidden_size), np.float32)), name="e")
        cell = Eagle3Drafter(rcfg, embed, 2, 4, 8, 32)
        cell.load_tensors(rt)
        h = ms.Tensor(np.ones((1, tcfg.hidden_size), np.float32))
        mask = np.full((1, 32), -1e9, np.float32)
        mask[0, 0] = 0
        _, ids, _ = cell(h, ms.Tensor(np.array([5], np.int32)), ms.Tensor(np.array([0], np.int32)),
                         ms.Tensor(np.array([0], np.int32)), ms.Tensor(np.arange(4, dtype=np.int32)),
                         ms.Tensor(mask))
        assert int(ids.asnumpy()[0, 0]) == used[j]


def test_bad_drafter_checkpoints(tmp_path, tiny):
    from mindspore_eagle.models.eagle3 import DrafterCheckpointError
    from mindspore_eagle.serving.pipeline import check_drafter_fits

    tcfg = tiny[0]
    with pytest.raises(DrafterCheckpointError, match="no config.json"):
        load_drafter(str(tmp_path / "missing"))
    d = tiny_drafter_dir(tmp_path, tcfg, seed=5, vd=20)
    (d / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes()[:100])
    with pytest.raises(DrafterCheckpointError, match="unreadable"):
        load_drafter(str(d))
    (d / "model.safetensors").unlink()
    (d / "pytorch_model.bin").write_bytes(b"x")
    with pytest.raises(DrafterCheckpointError, match="pickle"):
        load_drafter(str(d))
    cfg_json = json.loads((tiny_drafter_dir(tmp_path, tcfg, seed=6).joinpath("config.json")).read_text())
    for name, layers in (("zero_layers", 0), ("two_layers", 2)):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg_json | {"num_hidden_layers": layers}))
        (tmp_path / name / "model.safetensors").write_bytes((tmp_path / "drafter6" / "model.safetensors").read_bytes())
    with pytest.raises(DrafterCheckpointError, match="num_hidden_layers must be >= 1, got 0"):
        load_drafter(str(tmp_path / "zero_layers"))
    with pytest.raises(DrafterCheckpointError, match="missing tensor layers.1."):   # config 2 layers, tensors 1
        load_drafter(str(tmp_path / "two_layers"))
    # fields that change the function, which the drafter does not compute: refused, never loaded as another one
    for field, value in (("rope_scaling", {"rope_type": "llama3", "factor": 8.0}), ("norm_output", False),
                         ("norm_before_residual", True), ("bias", True)):
        (tmp_path / field).mkdir()
        (tmp_path / field / "config.json").write_text(json.dumps(cfg_json | {field: value}))
        (tmp_path / field / "model.safetensors").write_bytes((tmp_path / "drafter6" / "model.safetensors").read_bytes())
        with pytest.raises(DrafterCheckpointError, match=f"sets {field} = .*does not support it"):
            load_drafter(str(tmp_path / field))
    for field, value in (("rope_scaling", None), ("norm_output", True), ("norm_before_residual", False)):
        (tmp_path / field / "config.json").write_text(json.dumps(cfg_json | {field: value}))
        assert load_drafter(str(tmp_path / field))[0].hidden_size == tcfg.hidden_size
    # tensors the config does not use: fc_norm weights without "fc_norm", a bias
    from safetensors.numpy import load_file, save_file

    raw = load_file(str(tmp_path / "drafter6" / "model.safetensors"))
    for name, extra in (("stray_fc_norm", "fc_norm.0.weight"), ("stray_bias", "midlayer.self_attn.q_proj.bias")):
        (tmp_path / name).mkdir()
        (tmp_path / name / "config.json").write_text(json.dumps(cfg_json))
        save_file(raw | {extra: np.ones(tcfg.hidden_size, raw["fc.weight"].dtype)},
                  str(tmp_path / name / "model.safetensors"))
        with pytest.raises(DrafterCheckpointError, match=f"has tensor {extra}, which its config.json does not use"):
            load_drafter(str(tmp_path / name))
    (tmp_path / "stray_fc_norm" / "config.json").write_text(json.dumps(cfg_json | {"fc_norm": True}))
    with pytest.raises(DrafterCheckpointError, match="missing tensor fc_norm.1.weight"):
        load_drafter(str(tmp_path / "stray_fc_norm"))
    bad = DrafterConfig(hidden_size=32, intermediate_size=8, num_attention_heads=2, num_key_value_heads=1,
                        vocab_size=tcfg.vocab_size, draft_vocab_size=8, target_hidden_size=32)
    with pytest.raises(DrafterCheckpointError, match="hidden_size = 32 does not fit the teacher"):
        check_drafter_fits(bad, tcfg)


@pytest.mark.skipif(cpu.compiler() is None, reason="no C++ compiler here: the CPU kernels cannot build")
def test_half_weight_drafter_equals_float32_on_the_rounded_matrices(ms_runtime, tiny, tmp_path):
    """Eagle3Drafter(weight_dtype=float16): the context pass and an expansion step give, bit for bit, the top-K
    log-probs, ids and hidden rows of the float32 drafter whose folded matrices are rounded to float16; a backend
    without half weights refuses it with the key's name."""
    from tiny_engines import tiny_drafter_dir

    from mindspore_eagle.models.eagle3 import Eagle3Drafter, load_drafter

    tcfg = tiny[0]
    dcfg, t = load_drafter(str(tiny_drafter_dir(tmp_path, tcfg, seed=4)))
    embed = ms.Parameter(ms.Tensor(np.random.default_rng(0).normal(size=(tcfg.vocab_size, tcfg.hidden_size))
                                   .astype(np.float32)), name="e")
    half = Eagle3Drafter(dcfg, embed, 3, 4, 8, 32, attention="cpu", weight_dtype=ms.float16)
    ref = Eagle3Drafter(dcfg, embed, 3, 4, 8, 32, attention="cpu")
    for net in (half, ref):
        net.load_tensors(t)
    _round_matrices(ref, {"fc", "wqkv", "wo", "w_gate_up", "w_down", "lm_head"})
    assert half.lm_head.dtype == ms.float16 and half.fc.dtype == ms.float16
    rng = np.random.default_rng(2)
    aux = ms.Tensor(rng.normal(size=(4, 3 * tcfg.hidden_size)).astype(np.float32))
    tokens, positions = ms.Tensor(np.array([5, 9, 2, 7], np.int32)), ms.Tensor(np.arange(4, dtype=np.int32))
    table = ms.Tensor(np.arange(4, dtype=np.int32))
    mask = np.where(np.arange(32)[None] <= np.arange(4)[:, None], 0.0, -1e9).astype(np.float32)
    outs = [net.context(aux, tokens, positions, positions, table, ms.Tensor(mask), ms.Tensor(np.array([3], np.int32)))
            for net in (half, ref)]
    assert all(np.array_equal(x.asnumpy(), y.asnumpy()) for x, y in zip(*outs))
    h = ms.Tensor(np.repeat(outs[0][2].asnumpy(), 3, 0))
    step_mask = np.where(np.arange(32)[None] <= 4, 0.0, -1e9).astype(np.float32).repeat(3, 0)
    slots = ms.Tensor(np.array([4, 5, 6], np.int32))
    outs = [net(h, tokens[:3], ms.Tensor(np.full(3, 4, np.int32)), slots, table, ms.Tensor(step_mask))
            for net in (half, ref)]
    assert all(np.array_equal(x.asnumpy(), y.asnumpy()) for x, y in zip(*outs))
    with pytest.raises(ValueError, match="model.weight_dtype .* needs the cpu backend"):
        Eagle3Drafter(dcfg, embed, 3, 4, 8, 32, attention="portable", weight_dtype=ms.float16)
