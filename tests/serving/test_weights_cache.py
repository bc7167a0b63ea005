"""serving/weights_cache.py: a GGUF teacher read once, then loaded from its .npy + JSON copy with the same config,
tensors and tokenizer; a damaged copy is read again from the GGUF; other checkpoints are not copied."""
import json

import numpy as np
import pytest
from tiny_gguf import write_llama_gguf
from tiny_pangu import random_tensors

from mindspore_eagle.models.checkpoints import load_teacher
from mindspore_eagle.models.model_config import ModelConfig


def test_a_gguf_teacher_is_read_once(tmp_path, monkeypatch):
    from mindspore_eagle.serving import weights_cache as wc

    cfg = ModelConfig(vocab_size=261, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      max_position_embeddings=256, arch="llama")
    path = write_llama_gguf(tmp_path / "t.gguf", cfg, random_tensors(cfg, seed=3))
    ref_cfg, ref_tensors, ref_tok = load_teacher(path)
    root = tmp_path / "weights"
    first = wc.load_teacher_cached(path, root)
    (copy,) = list(root.iterdir())
    assert json.loads((copy / "meta.json").read_text())["tensors"] == list(ref_tensors)
    calls = []
    monkeypatch.setattr("mindspore_eagle.models.checkpoints.load_teacher",
                        lambda p: calls.append(p) or load_teacher(p))
    again_cfg, again_tensors, again_tok = wc.load_teacher_cached(path, root)
    assert calls == [] and again_cfg == ref_cfg == first[0]
    assert list(again_tensors) == list(ref_tensors)
    assert all(np.array_equal(again_tensors[k], v) and again_tensors[k].dtype == np.float32
               for k, v in ref_tensors.items())
    for k, v in ref_tensors.items():                        # read straight into rows of a bigger matrix
        big = np.full((v.shape[0] + 3,) + v.shape[1:], np.nan, np.float32)
        again_tensors.into(k, big[1:1 + v.shape[0]])
        assert np.array_equal(big[1:1 + v.shape[0]], v) and np.isnan(big[0]).all() and np.isnan(big[-2:]).all()
    text = "<|im_start|>the thethe 123 tea<|im_end|>"
    msgs = [{"role": "user", "content": "the <|im_end|> tea"}]
    for a, b in ((again_tok, ref_tok),):
        assert a.encode(text) == b.encode(text) and a.decode(b.encode(text)) == text
        assert a.encode_chat(msgs) == b.encode_chat(msgs)
        assert (a.vocab_size, a.bos_token_id, a.eos_token_ids, a.add_bos, a.chat_template, a.special_tokens,
                a.template_vars) == (b.vocab_size, b.bos_token_id, b.eos_token_ids, b.add_bos, b.chat_template,
                                     b.special_tokens, b.template_vars)
    next((copy / "tensors").iterdir()).write_bytes(b"damaged")          # a damaged copy: read the GGUF again
    again = wc.load_teacher_cached(path, root)
    assert again[0] == ref_cfg and calls == [path] and [p.name for p in root.iterdir()] == [copy.name]
    assert all(np.array_equal(again[1][k], v) for k, v in ref_tensors.items())
    stale = root / (copy.name.split("-")[0] + "-000000000000")            # a copy from older sources
    stale.mkdir()
    monkeypatch.setattr(wc, "_SOURCES", wc._SOURCES[:-1])                  # the loader changed: a new copy
    wc.load_teacher_cached(path, root)
    assert len(calls) == 2 and [p.name for p in root.iterdir()] == [wc.cache_key(path)] != [copy.name]


def test_a_model_reads_each_lazy_tensor_once(ms_runtime, tiny):
    """Loading a teacher from a LazyTensors (the kept copy's reader) reads every tensor exactly once: asking whether
    a name is there reads nothing (Mapping's default ``in`` read each tensor a second time: 1.2 s of a 0.5B load)."""
    import mindspore as ms

    from mindspore_eagle.models.checkpoints import LazyTensors
    from mindspore_eagle.models.llama import LlamaModel

    cfg, tensors, _ = tiny
    reads = []
    lazy = LazyTensors({k: v.shape for k, v in tensors.items()},
                       lambda name: reads.append(name) or np.array(tensors[name], np.float32))
    assert "model.norm.weight" in lazy and "no.such.tensor" not in lazy and reads == []
    LlamaModel(cfg, 32, 8, 128, ms.float32).load_hf_weights(lazy)
    assert sorted(reads) == sorted(set(reads)) and set(reads) <= set(tensors) and len(reads) >= len(tensors) - 1


def test_reading_into_the_fused_matrices_gives_the_same_parameters(ms_runtime, tiny):
    """A LazyTensors with ``read_into`` (the kept copy's reader) fills q/k/v and gate/up straight into their fused
    matrices: every Parameter is bit-identical to a load from a plain dict (which reads, scales, concatenates and
    multiplies through temporaries)."""
    import mindspore as ms

    from mindspore_eagle.models.checkpoints import LazyTensors
    from mindspore_eagle.models.llama import LlamaModel

    cfg, tensors, _ = tiny
    into = []

    def read_into(name, out):
        into.append(name)
        out[...] = tensors[name]

    lazy = LazyTensors({k: v.shape for k, v in tensors.items()}, lambda n: np.array(tensors[n], np.float32),
                       read_into)
    a, b = LlamaModel(cfg, 32, 8, 128, ms.float32), LlamaModel(cfg, 32, 8, 128, ms.float32)
    a.load_hf_weights(dict(tensors))
    b.load_hf_weights(lazy)
    fused = {f"model.layers.{i}.{n}.weight" for i in range(cfg.num_layers)
             for n in ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj", "mlp.up_proj")}
    assert set(into) == fused
    pa, pb = dict(a.parameters_and_names()), dict(b.parameters_and_names())
    assert pa.keys() == pb.keys()
    assert all(np.array_equal(pa[k].asnumpy(), pb[k].asnumpy()) for k in pa)


@pytest.mark.parametrize("weight_dtype", ["float32", "float16"])
def test_a_kept_teacher_maps_its_prepared_weights(ms_runtime, tmp_path, monkeypatch, weight_dtype):
    """A model built from a kept copy keeps its load's arrays (folded, packed, rounded): a second model of the same
    kind maps them without reading a tensor, every weight Parameter bit-identical to a fresh load and its logits
    equal; a write into a mapped weight leaves the file as it was (copy-on-write); a damaged file, or another
    model (other sources), loads from the tensors again; at most PREPARED_KEEP keys stay; a plain dict keeps none."""
    import mindspore as ms

    from mindspore_eagle.models.llama import LlamaModel
    from mindspore_eagle.serving import weights_cache as wc

    cfg = ModelConfig(vocab_size=261, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
                      max_position_embeddings=256, arch="llama")
    path = write_llama_gguf(tmp_path / "t.gguf", cfg, random_tensors(cfg, seed=4))
    root = tmp_path / "weights"
    wdt = getattr(ms, weight_dtype)

    def build(loader=wc.load_model_weights):
        tcfg, tensors, _ = wc.load_teacher_cached(path, root)
        net = LlamaModel(tcfg, 32, 8, 128, ms.float32, attention="cpu", weight_dtype=wdt)
        return net, loader(net, tensors)

    def weights(net):
        return {n: p.asnumpy().copy() for n, p in wc._weight_params(net)}

    fresh, mapped = build(lambda net, t: net.load_hf_weights(t)), build()
    assert mapped[1] is False                                   # the first keeps its arrays
    (copy,) = list(root.iterdir())
    (key,) = list((copy / "prepared").iterdir())
    assert key.name == wc.prepared_key(fresh[0])
    monkeypatch.setattr(LlamaModel, "load_hf_weights", lambda *a: pytest.fail("read the tensors again"))
    net, from_prepared = build()
    assert from_prepared is True
    want, got = weights(fresh[0]), weights(net)
    assert want.keys() == got.keys() and all(np.array_equal(want[n], got[n]) and want[n].dtype == got[n].dtype
                                             for n in want)
    assert net.layers[0].wqkv.dtype == wdt and len(net.layers[0].wqkv.shape) == 3     # packed, as loaded

    def logits(m):
        from mindspore_eagle.runners.teacher import TeacherRunner

        r = TeacherRunner(m, 32, 8, 128, "fused", 32)
        return r.prefill(r.new_seq(), [5, 9, 3, 7, 11])[0]

    assert np.array_equal(logits(fresh[0]), logits(net))
    first = wc._weight_params(net)[0]
    on_disk = (key / "0.npy").read_bytes()
    view = first[1].asnumpy()
    view[...] = 0                                                # writes the process's private pages only
    assert not first[1].asnumpy().any() and (key / "0.npy").read_bytes() == on_disk
    monkeypatch.undo()
    del net, view, first
    (key / "1.npy").unlink()                                     # a damaged file: loaded again, kept again
    (key / "1.npy").write_bytes(b"damaged")
    assert build()[1] is False and build()[1] is True
    for i in range(wc.PREPARED_KEEP + 1):                         # other sources: other keys, the oldest dropped
        monkeypatch.setattr(wc, "_PREPARED_SOURCES", wc._PREPARED_SOURCES[:3 - i])
        assert build()[1] is False
    assert len(list((copy / "prepared").iterdir())) == wc.PREPARED_KEEP and not key.exists()
    plain = LlamaModel(cfg, 32, 8, 128, ms.float32, attention="cpu", weight_dtype=wdt)
    _, tensors, _ = load_teacher(path)
    assert wc.load_model_weights(plain, dict(tensors)) is False


def test_other_checkpoints_are_not_copied(tmp_path, tiny_dir):
    from mindspore_eagle.serving import weights_cache as wc

    wc.load_teacher_cached(tiny_dir, tmp_path / "weights")              # safetensors: memory-mapped already
    assert not (tmp_path / "weights").exists()


_MEASURE = r"""
import json, sys

def rss(key):
    return next(int(l.split()[1]) * 1024 for l in open("/proc/self/status") if l.startswith(key + ":"))

from mindspore_eagle.config import load_config
from mindspore_eagle.kernels import runtime
from mindspore_eagle.serving import pipeline

cfg = load_config("configs/default.yaml", ["model.teacher=" + sys.argv[1], "model.drafter=none",
                                           "speculative.method=suffix"])
runtime.configure(None, "CPU", 0)
base = rss("VmRSS")
engine = pipeline.build_engine(cfg, log=lambda *a: None)
weights = sum(p.nbytes for p in engine.teacher.model.get_parameters() if "cache" not in p.name)
print(json.dumps({"base": base, "peak": rss("VmHWM"), "after": rss("VmRSS"), "weights": weights}))
"""


def test_building_an_engine_holds_the_weights_once(tmp_path):
    """A GGUF teacher of ~290 MB float32, built into an engine twice (the first run writes the kept copy, the
    second reads it): the process's peak memory grows by at most 1.3x the weights over what it held before, plus,
    on the first run, twice the largest tensor (docs/models.md, "Memory": neither a second full copy in numpy nor
    zero-filled Parameters)."""
    import subprocess
    import sys
    from pathlib import Path

    cfg = ModelConfig(vocab_size=65536, hidden_size=512, intermediate_size=1024, num_layers=3, num_heads=8,
                      num_kv_heads=2, head_dim=64, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=False,
                      max_position_embeddings=2048, arch="llama")
    path = write_llama_gguf(tmp_path / "big.gguf", cfg, random_tensors(cfg, seed=1))
    env = dict(__import__("os").environ, MSEAGLE_CACHE=str(tmp_path / "cache"))
    root = Path(__file__).resolve().parents[2]
    for run in ("first", "second"):
        out = subprocess.run([sys.executable, "-c", _MEASURE, str(path)], cwd=root, env=env, capture_output=True,
                             text=True, timeout=600)
        assert out.returncode == 0, out.stderr[-2000:]
        m = json.loads(out.stdout.strip().splitlines()[-1])
        assert m["weights"] > 280e6, m
        # the first run also parses the GGUF (its 65k-token vocabulary) and dequantises one tensor at a time
        slack = 2 * 65536 * 512 * 4 if run == "first" else 0
        assert m["peak"] - m["base"] <= 1.3 * m["weights"] + slack, (run, m)
    assert any((tmp_path / "cache" / "weights").iterdir())
