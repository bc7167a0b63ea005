"""serving/pipeline.py: config -> weights -> engine on the tiny openPangu teacher; the drafter/teacher fit check;
where the embedded drafter and the cost table live."""
import dataclasses
import json
import os

import pytest
from tiny_engines import tiny_drafter_dir

from mindspore_eagle.config import load_config
from mindspore_eagle.models.eagle3 import DrafterCheckpointError, load_drafter
from mindspore_eagle.serving import pipeline

TINY = ["cache.block_size=8", "cache.max_seq_len=128", "cache.num_blocks=32", "cache.prefill_chunk=16",
        "speculative.mode=eager", "speculative.policy=fixed", "speculative.M=6", "speculative.D_max=3",
        "speculative.top_k=2", "generation.max_new_tokens=8"]


def _cfg(tiny_dir, drafter, extra=()):
    return load_config(None, [f"model.teacher={tiny_dir}", f"model.drafter={drafter}", *TINY, *extra])


def test_embedded_drafter_is_in_the_package():
    """``model.drafter=embedded`` (the default) reads mindspore_eagle/assets/drafter_smollm2_135m."""
    want = os.path.join(os.path.dirname(pipeline.__file__), os.pardir, "assets", "drafter_smollm2_135m")
    assert os.path.isdir(pipeline.EMBEDDED_DRAFTER), pipeline.EMBEDDED_DRAFTER
    assert os.path.samefile(pipeline.EMBEDDED_DRAFTER, want)
    assert {"config.json", "model.safetensors"} <= set(os.listdir(pipeline.EMBEDDED_DRAFTER))


def test_embedded_drafter_is_the_one_trained_for_the_named_teacher(tiny_dir):
    """A named teacher with a shipped drafter gets that drafter (shaped for it: its hidden size and 152k
    vocabulary); the embedded teacher and a path get SmolLM2-135M's."""
    from mindspore_eagle.models.fetch import NAMED_TEACHERS

    assert set(pipeline.SHIPPED_DRAFTERS) <= set(NAMED_TEACHERS)
    qwen = pipeline.embedded_drafter("qwen2.5-coder-0.5b-instruct")
    assert os.path.basename(qwen) == "drafter_qwen2_5_coder_0_5b"
    dcfg, tensors = load_drafter(qwen)
    assert (dcfg.hidden_size, dcfg.vocab_size, dcfg.draft_vocab_size) == (896, 151936, 8192)
    assert tensors["lm_head.weight"].shape == (8192, 896)
    assert pipeline.embedded_drafter("embedded") == pipeline.EMBEDDED_DRAFTER
    assert pipeline.embedded_drafter(str(tiny_dir)) == pipeline.EMBEDDED_DRAFTER


def test_resolve_teacher_passes_a_path_through(tiny_dir):
    assert pipeline.resolve_teacher(str(tiny_dir)) == str(tiny_dir)


def test_check_drafter_fits_names_the_field_and_both_values(tiny, tmp_path):
    tcfg = tiny[0]
    dcfg, _ = load_drafter(str(tiny_drafter_dir(tmp_path, tcfg)))
    pipeline.check_drafter_fits(dcfg, tcfg)                      # made for this teacher: fits
    H, V = tcfg.hidden_size, tcfg.vocab_size
    for field, value, message in (
            ("hidden_size", H + 8, f"drafter hidden_size = {H + 8} does not fit the teacher (needs {H})"),
            ("target_hidden_size", 2 * H, f"drafter target_hidden_size = {2 * H} does not fit the teacher (needs {H})"),
            ("vocab_size", V - 1, f"drafter vocab_size = {V - 1} does not fit the teacher (needs {V})")):
        with pytest.raises(DrafterCheckpointError) as e:
            pipeline.check_drafter_fits(dataclasses.replace(dcfg, **{field: value}), tcfg)
        assert str(e.value) == message
    other = tuple(a + 1 if i == 0 else a for i, a in enumerate(tcfg.aux_layers))
    with pytest.raises(DrafterCheckpointError, match=r"drafter was trained on teacher layers .* teacher captures"):
        pipeline.check_drafter_fits(dataclasses.replace(dcfg, aux_layers=other), tcfg)
    pipeline.check_drafter_fits(dataclasses.replace(dcfg, aux_layers=()), tcfg)   # no layers recorded: any


def test_random_drafter_is_shaped_like_the_teacher(tiny):
    tcfg = tiny[0]
    dcfg, tensors = pipeline.random_drafter(tcfg, draft_vocab_size=64)
    pipeline.check_drafter_fits(dcfg, tcfg)
    assert (dcfg.hidden_size, dcfg.vocab_size, dcfg.draft_vocab_size) == (tcfg.hidden_size, tcfg.vocab_size, 64)
    assert tensors["lm_head.weight"].shape == (64, tcfg.hidden_size)


def test_load_models_reads_what_model_names(tiny_dir, tiny, tmp_path):
    none = pipeline.load_models(_cfg(tiny_dir, "none"))
    assert none.drafter_cfg is None and none.drafter_tensors is None
    assert none.teacher_cfg.vocab_size == tiny[0].vocab_size and set(none.teacher_tensors) == set(tiny[1])
    d = tiny_drafter_dir(tmp_path, tiny[0], vd=40)
    loaded = pipeline.load_models(_cfg(tiny_dir, d))
    assert loaded.drafter_cfg.draft_vocab_size == 40 and "fc.weight" in loaded.drafter_tensors
    other = tmp_path / "other_layers"                     # trained on other teacher layers than this one captures
    other.mkdir()
    cfg_json = json.loads((d / "config.json").read_text())
    cfg_json["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [0, 0, 0]
    (other / "config.json").write_text(json.dumps(cfg_json))
    (other / "model.safetensors").write_bytes((d / "model.safetensors").read_bytes())
    assert load_drafter(str(other))[0].aux_layers != tuple(tiny[0].aux_layers)
    with pytest.raises(DrafterCheckpointError, match="drafter was trained on teacher layers"):
        pipeline.load_models(_cfg(tiny_dir, other))


@pytest.mark.parametrize("drafter", ["random", "none"])
def test_build_engine_greedy_equals_teacher_only(ms_runtime, tiny_dir, drafter):
    cfg = _cfg(tiny_dir, drafter)
    eng = pipeline.build_engine(cfg)
    assert (eng.drafter is None) == (drafter == "none")
    base = eng.generate("What is the capital of France?", cfg.generation, speculative=False)
    spec = eng.generate("What is the capital of France?", cfg.generation, speculative=drafter != "none")
    assert len(base.token_ids) > 0 and spec.token_ids == base.token_ids and spec.text == base.text


def test_cost_file_is_keyed_by_what_changes_a_call(tiny_dir, tmp_path, monkeypatch):
    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path))
    a = pipeline.cost_file(_cfg(tiny_dir, "random"))
    assert a == pipeline.cost_file(_cfg(tiny_dir, "random")) and a.startswith(str(tmp_path / "costs") + os.sep)
    assert a.endswith(".json")
    others = {pipeline.cost_file(_cfg(tiny_dir, "random", [x]))
              for x in ("speculative.M=8", "speculative.top_k=3", "cache.max_seq_len=256", "model.dtype=float16")}
    assert len(others) == 4 and a not in others


def test_embedded_drafter_that_does_not_fit_falls_back_to_copies(ms_runtime, tiny_dir, capsys):
    """``model.drafter: embedded`` beside a teacher no shipped drafter fits (the tiny teacher: hidden 64, the
    embedded drafter's 576): a one-line notice naming the mismatch, no error; the engine speculates with copies of
    earlier text alone and answers exactly as teacher-only. ``method: suffix`` never reads a drafter at all."""
    cfg = _cfg(tiny_dir, "embedded", ["speculative.method=hybrid"])
    loaded = pipeline.load_models(cfg)
    assert loaded.drafter_cfg is None and "hidden_size = 576 does not fit the teacher (needs 64)" in loaded.notice
    assert pipeline.embedded_choice(str(tiny_dir), loaded.teacher_cfg) == (
        None, "drafter hidden_size = 576 does not fit the teacher (needs 64)")
    eng = pipeline.build_engine(cfg, loaded)
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("notice: no shipped drafter fits teacher") and \
        "speculative.method=suffix" in err[0]
    assert eng.drafter is None and eng.suffix is not None and eng.speculates and eng.spec.method == "suffix"
    for prompt in ("What is the capital of France?", "Count: one two three one two three one two"):
        base = eng.generate(prompt, cfg.generation, speculative=False)
        spec = eng.generate(prompt, cfg.generation, speculative=True)
        assert len(base.token_ids) > 0 and spec.token_ids == base.token_ids
    suffix = pipeline.load_models(_cfg(tiny_dir, "embedded", ["speculative.method=suffix"]))
    assert suffix.drafter_cfg is None and suffix.notice == ""


def test_chat_template_key_replaces_the_checkpoints(ms_runtime, tiny_dir, tmp_path):
    f = tmp_path / "template.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}|{% endfor %}", encoding="utf-8")
    eng = pipeline.build_engine(_cfg(tiny_dir, "none", [f"model.chat_template={f}"]))
    assert eng.tokenizer.apply_chat_template([{"role": "user", "content": "hi"}]) == "hi|"
