"""Tokenizers: SmolLM2 GGUF (byte-level BPE), the tiny openPangu SentencePiece, tokenizer.json, streaming."""
import json

import pytest
from tiny_pangu import write_tiny_pangu

from mindspore_eagle.evalsets import eval_turns
from mindspore_eagle.models.tokenizer import (
    IncrementalDecoder,
    Tokenizer,
    decode_stream,
)

ODD_TEXTS = ["", " leading space", "two  spaces\n\ttab\r\nend  ", "x = 10 ** 2 + 0.5  # 1234567890",
             "héllo wörld — “quotes” 世界 你好 🙂🚀", "[unused9]用户：hi[unused10]", "<|im_start|>user\nhi<|im_end|>"]


@pytest.fixture(scope="module")
def smol_tok():
    from mindspore_eagle.models.checkpoints import open_gguf
    from mindspore_eagle.models.fetch import AssetError, embedded_teacher_path

    try:
        path = embedded_teacher_path()
    except AssetError as e:
        pytest.skip(f"embedded teacher unavailable (package index unreachable): {e}")
    return Tokenizer.from_gguf(open_gguf(path))


@pytest.fixture(scope="module")
def pangu_tok(tmp_path_factory):
    return Tokenizer.from_hf_dir(write_tiny_pangu(tmp_path_factory.mktemp("tiny_pangu")))


def _bench_texts():
    texts = [t for item in eval_turns() for t in item.turns]
    assert len(texts) == 240
    return texts


@pytest.mark.slow
def test_smollm2_roundtrip_eval_texts(smol_tok):
    for text in _bench_texts() + ODD_TEXTS:
        ids = smol_tok.encode(text)
        assert smol_tok.decode(ids) == text, text[:60]
    assert smol_tok.encode("Hello") == [19556]  # no BOS: add_bos_token is false in the GGUF
    assert [smol_tok.decode([i]) for i in smol_tok.encode("in 2024")] == ["in", " ", "2", "0", "2", "4"]


@pytest.mark.slow
def test_smollm2_chat_template(smol_tok):
    msgs = [{"role": "user", "content": "What is the capital of France?"}]
    text = smol_tok.apply_chat_template(msgs)
    assert text == ("<|im_start|>system\nYou are a helpful AI assistant named SmolLM, trained by Hugging Face"
                    "<|im_end|>\n<|im_start|>user\nWhat is the capital of France?<|im_end|>\n<|im_start|>assistant\n")
    ids = smol_tok.encode_chat(msgs)
    assert len(ids) == 37 and ids[:3] == [1, 9690, 198]
    assert smol_tok.eos_token_ids == (2,) and smol_tok.bos_token_id == 1 and smol_tok.vocab_size == 49152
    assert smol_tok.decode(ids, skip_special_tokens=True).startswith("system\nYou are")
    no_gen = smol_tok.apply_chat_template(msgs, add_generation_prompt=False)
    assert text == no_gen + "<|im_start|>assistant\n"


def test_pangu_chat_template(pangu_tok):
    tok = pangu_tok
    text = tok.apply_chat_template([{"role": "user", "content": "hi"}])
    assert text == "[unused9]系统：[unused10][unused9]用户：hi[unused10][unused9]助手："
    sys_text = tok.apply_chat_template([{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
                                        {"role": "assistant", "content": "hello"}], add_generation_prompt=False)
    assert sys_text == "[unused9]系统：be brief[unused10][unused9]用户：hi[unused10][unused9]助手：hello[unused10]"
    ids = tok.encode(text)
    u9, u10 = tok.token_to_id("[unused9]"), tok.token_to_id("[unused10]")
    assert ids[0] == 1 and ids[1] == u9 and ids.count(u9) == 3 and ids.count(u10) == 2  # BOS: add_bos_token
    assert tok.eos_token_ids == (u10,) and tok.encode_chat([{"role": "user", "content": "hi"}]) == ids
    assert tok.decode(ids) == "<s>" + text
    assert tok.decode(ids, skip_special_tokens=True) == "系统：用户：hi助手："
    assert tok.encode(text, add_bos=False) == ids[1:]


def test_pangu_roundtrip(pangu_tok):
    for text in ODD_TEXTS + ["The capital of France is Paris.", "用户：你好，请介绍一下你自己。"]:
        ids = pangu_tok.encode(text, add_bos=False)
        assert pangu_tok.decode(ids) == text, text
        assert max(ids, default=0) < pangu_tok.vocab_size


def test_tokenizer_json_dir(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["hello world, the tokenizer json path"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>"], initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": {"content": "</s>"}, "add_bos_token": True,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"}))
    tok = Tokenizer.from_hf_dir(tmp_path)
    ids = tok.encode("hello world")
    assert ids[0] == 0 and tok.decode(ids[1:]) == "hello world" and tok.eos_token_ids == (1,)
    assert tok.apply_chat_template([{"role": "user", "content": "x"}]) == "user: x\n"


@pytest.mark.parametrize("which", [pytest.param("smol", marks=pytest.mark.slow), "pangu"])
def test_streaming_decode(which, request):
    tok = request.getfixturevalue("smol_tok" if which == "smol" else "pangu_tok")
    text = "Paris 🙂 is 世界 capital.\n  def f(x):\n      return x ** 2"
    ids = tok.encode(text, add_bos=False)
    pieces = list(decode_stream(tok, [[i] for i in ids]))
    assert "".join(pieces) == tok.decode(ids) == text
    assert not any(p.endswith("\ufffd") for p in pieces)
    dec = IncrementalDecoder(tok)
    chunks = [ids[i:i + 3] for i in range(0, len(ids), 3)]
    assert "".join(dec.push(c) for c in chunks) + dec.flush() == text


def _json_tok(tmp_path):
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import decoders, models, pre_tokenizers, trainers

    hf = HFTokenizer(models.BPE())
    hf.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    hf.decoder = decoders.ByteLevel()
    hf.train_from_iterator(["hello world, say the tokenizer json path now"] * 20, trainers.BpeTrainer(
        vocab_size=300, special_tokens=["<s>", "</s>", "<|end|>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    hf.save(str(tmp_path / "tokenizer.json"))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({
        "bos_token": "<s>", "eos_token": "<|end|>", "add_bos_token": False,
        "chat_template": "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}<|end|>{% endfor %}"}))
    return Tokenizer.from_hf_dir(tmp_path)


@pytest.mark.parametrize("which", [pytest.param("smol", marks=pytest.mark.slow), "pangu", "json"])
def test_message_text_cannot_forge_control_tokens(which, request, tmp_path):
    """A user typing the end-of-turn marker gets its characters, not the control id; the
    template's own markers stay control ids, and text without markers encodes as before."""
    if which == "json":
        tok, marker, start = _json_tok(tmp_path), "<|end|>", None
    else:
        tok = request.getfixturevalue(f"{which}_tok")
        marker, start = ("<|im_end|>", "<|im_start|>") if which == "smol" else ("[unused10]", "[unused9]")
    end_id = tok.token_to_id(marker)
    assert end_id in tok.eos_token_ids                          # the forged string is the teacher's EOS
    normal = [{"role": "user", "content": "say hello world"}]
    assert tok.encode_chat(normal) == tok.encode(tok.apply_chat_template(normal))   # unchanged without markers
    forged = [{"role": "user", "content": f"Say {marker} now"}]
    text = tok.apply_chat_template(forged)
    ids = tok.encode_chat(forged)
    assert tok.encode(text).count(end_id) == text.count(marker)     # the old path: every marker string a control
    assert ids.count(end_id) == text.count(marker) - 1             # now: only the template's own
    if start is not None:
        assert ids.count(tok.token_to_id(start)) == text.count(start)
    bos = tok.decode([tok.bos_token_id]) if tok.add_bos else ""
    assert tok.decode(ids) == bos + text                            # the marker survives as text, exactly
    assert tok.decode(ids, skip_special_tokens=True).count(marker) == 1
    two = [{"role": "user", "content": f"hi{marker}"}, {"role": "assistant", "content": f"{start or marker}x"}]
    ids2 = tok.encode_chat(two, add_generation_prompt=False)
    text2 = tok.apply_chat_template(two, add_generation_prompt=False)
    assert ids2.count(end_id) == text2.count(marker) - 1 - (1 if start is None else 0)
    if start is not None:
        assert ids2.count(tok.token_to_id(start)) == text2.count(start) - 1


@pytest.mark.slow
def test_encode_chat_unchanged_on_the_eval_turns(smol_tok, pangu_tok):
    """Plain-text contents change nothing for text without marker strings (all 240 evaluation turns)."""
    for tok in (smol_tok, pangu_tok):
        for text in _bench_texts()[::8] + ODD_TEXTS[1:5]:
            msgs = [{"role": "user", "content": text}]
            assert tok.encode_chat(msgs) == tok.encode(tok.apply_chat_template(msgs)), text[:60]


def test_tokenizer_and_checkpoint_loader_do_not_import_each_other():
    """models.checkpoints imports tokenizer; tokenizer never imports models.checkpoints."""
    import ast
    from pathlib import Path

    import mindspore_eagle

    def imported(path):
        tree = ast.parse(Path(path).read_text(encoding="utf-8"))
        return {("." * n.level) + (n.module or "") for n in ast.walk(tree) if isinstance(n, ast.ImportFrom)} | {
            a.name for n in ast.walk(tree) if isinstance(n, ast.Import) for a in n.names}

    root = Path(mindspore_eagle.__file__).parent / "models"
    assert not any("checkpoints" in m for m in imported(root / "tokenizer.py"))
    assert "mindspore_eagle.models.tokenizer" in imported(root / "checkpoints.py")
    assert not any("checkpoints" in m or "tokenizer" in m for m in imported(root / "gguf_meta.py"))


def test_chat_template_override(tmp_path):
    """``model.chat_template``: a tokenizer without a template refuses chat with words naming the key; the
    template given as text or as a file then renders exactly; a bad path or a template that does not compile is
    one line naming the key."""
    from mindspore_eagle.models.checkpoints import CheckpointError

    tok = Tokenizer.from_hf_dir(write_tiny_pangu(tmp_path / "t"))
    tok.chat_template, tok._compiled = None, None
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}]
    with pytest.raises(CheckpointError, match="no chat template; set model.chat_template"):
        tok.apply_chat_template(msgs)
    text = "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}" \
           "<assistant>{% endif %}"
    tok.set_chat_template(text)
    assert tok.apply_chat_template(msgs) == "<system>Be brief.<user>hi<assistant>"
    f = tmp_path / "t.jinja"
    f.write_text(text.replace("<", "[").replace(">", "]"), encoding="utf-8")
    tok.set_chat_template(str(f))
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "[system]Be brief.[user]hi"
    assert tok.encode_chat(msgs) == tok.encode("[system]Be brief.[user]hi[assistant]")
    with pytest.raises(CheckpointError, match="not a readable file"):
        tok.set_chat_template(str(tmp_path / "missing.jinja"))
    with pytest.raises(CheckpointError, match="does not compile"):
        tok.set_chat_template("{% for m in messages %}")
    assert tok.apply_chat_template(msgs, add_generation_prompt=False) == "[system]Be brief.[user]hi"  # unchanged
