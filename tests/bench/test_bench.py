"""Benchmark harness (mindspore_eagle.bench): end-to-end CLI run on the real teacher with an untrained drafter,
statistics against hand computation, resume, acceptance by position from synthetic traces, mismatch detection,
sweep summaries, and the F32 GGUF writer round-trip through our own loader."""
import json
import os

import numpy as np
import pytest

from mindspore_eagle.bench import cli_main
from mindspore_eagle.bench import report as report_mod
from mindspore_eagle.bench.sweeps import (
    budget_points,
    dedupe,
    main_setting,
    parse_int_list,
    summarize_points,
    window_points,
)
from mindspore_eagle.bench.throughput import (
    OutputMismatchError,
    Setting,
    TurnSpec,
    accept_by_depth,
    attention_buckets,
    read_records,
    run_turns,
    stats,
)
from mindspore_eagle.config import GenerationConfig, SpeculativeConfig
from mindspore_eagle.core.trace import StepTrace, TurnTrace
from mindspore_eagle.serving.engine import Generation

STAT_KEYS = ("mean", "p50", "p90", "p99")


# ----------------------------------------------------------------------------------------- end to end (real) --
@pytest.mark.slow
def test_cli_end_to_end_random_drafter(tmp_path):
    """--turns 2 (MT-Bench writing/81, both turns) --max-new-tokens 8 with an untrained drafter: lossless, report
    keys, markdown and figures; a second call with the same --out resumes with nothing left to run."""
    out = tmp_path / "run"
    argv = ["--turns", "2", "--max-new-tokens", "8", "--set", "model.drafter=random", "--set",
            "speculative.policy=fixed", "--warmup", "short",
            "--attn-samples", "2", "--no-progress", "--out", str(out)]
    assert cli_main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    for key in ("turns", "M", "D_max", "top_k", "identical_outputs", "baseline_tok_s", "ea_tok_s", "speedup",
                "accept_len"):
        assert key in rep, key
    for key in ("baseline_tok_s", "ea_tok_s", "speedup", "accept_len"):
        assert all(isinstance(rep[key][s], float) for s in STAT_KEYS), key
    assert rep["turns"] == 2 and rep["identical_outputs"] is True
    assert (rep["M"], rep["D_max"], rep["top_k"]) == (16, 5, 4)
    assert rep["accept_len"]["mean"] >= 1.0 and rep["figures"]["fig7_attention"]["n"] >= 1
    md = (out / "report.md").read_text()
    assert "Table 1" in md and "1.27x" in md and "3.17" in md
    for n in (1, 2, 3, 5, 7):
        assert (out / report_mod.FIGURES[n]).stat().st_size > 1000
    recs = read_records(out / "turns.jsonl")
    assert list(recs) == ["mtbench/81#0", "mtbench/81#1"]
    assert recs["mtbench/81#1"]["prompt_tokens"] > recs["mtbench/81#0"]["prompt_tokens"]  # history included
    top = recs["mtbench/81#0"]["attn_top"]
    assert 1 <= len(top) <= 2 and all(0 <= c <= p for p, c in top)
    assert recs["mtbench/81#0"]["attn_dist"] == [p - c for p, c in top]
    lines = (out / "turns.jsonl").read_text().splitlines()
    assert cli_main(argv) == 0                                                            # resume: nothing to do
    assert (out / "turns.jsonl").read_text().splitlines() == lines
    assert cli_main(argv[:-1] + [str(out)] + ["--max-new-tokens", "9"]) == 2              # different params refused


# ------------------------------------------------------------------------------------------------ helpers --
@pytest.mark.slow
def test_cli_policy_sweep_random_drafter(tmp_path):
    """--sweep policy: the config's budget under fixed and adaptive beside the fixed presets, on one turn; the
    adaptive engine's measured cost table and calibration land in policy.json / report.json; Figure 8."""
    out = tmp_path / "run"
    argv = ["--turns", "1", "--max-new-tokens", "6", "--set", "model.drafter=random", "--set", "speculative.M=8",
            "--set", "speculative.D_max=3", "--set", "speculative.policy=adaptive", "--warmup", "short",
            "--attn-samples", "0", "--sweep", "policy", "--no-progress", "--out", str(out)]
    assert cli_main(argv) == 0
    rep = json.loads((out / "report.json").read_text())
    rows = rep["sweeps"]["policy"]
    assert [(r["policy"], r["M"], r["D_max"]) for r in rows] == [("fixed", 8, 3), ("adaptive", 8, 3),
                                                                  ("fixed", 8, 2), ("fixed", 8, 3)]
    assert rows[1]["setting"] == "main" and rows[0]["setting"] == rows[3]["setting"] == "fixed"
    assert rep["identical_outputs"] is True and rep["policy"] == "adaptive"
    costs = rep["policy_state"]["costs"]
    assert sorted(costs["verify_ms"]) == ["2", "4", "8"] and costs["decode_ms"] > 0
    v = [costs["verify_ms"][m] for m in ("2", "4", "8")]
    assert v == sorted(v)                      # a smaller verification never costs more than a larger one
    assert 0.0 <= rep["spec_share"]["mean"] <= 1.0 and rep["speedup"]["min"] <= rep["speedup"]["p10"]
    assert "Speculation policy: adaptive" in (out / "report.md").read_text()
    assert (out / report_mod.FIGURES[8]).stat().st_size > 1000


def test_stats_hand_computed():
    s = stats([1, 2, 3, 4])
    assert s["mean"] == 2.5 and s["p50"] == 2.5 and s["n"] == 4
    assert s["p90"] == pytest.approx(3.7) and s["p99"] == pytest.approx(3.97)   # 1 + q * 3 (linear)
    s = stats([5.0])
    assert all(s[k] == 5.0 for k in STAT_KEYS)
    assert np.isnan(stats([])["mean"])


def test_by_category_counts_and_figure_9(tmp_path):
    """Per-category shares of accepted draft tokens against hand counts, and Figure 9 drawn from them."""
    def rec(cat, speedup, lens, fr):
        return {"category": cat, "settings": {"main": {"speedup": speedup, "accept_lens": lens,
                                                       "accepted_from": fr}}}

    recs = [rec("writing", 1.2, [1, 3], {"drafter": 2, "suffix": 0, "both": 0}),
            rec("humaneval", 1.5, [4, 1, 2], {"drafter": 1, "suffix": 3, "both": 0}),
            rec("writing", 0.9, [2], {"drafter": 0, "suffix": 1, "both": 1})]
    cats = report_mod.by_category(recs)
    assert list(cats) == ["writing", "humaneval"]
    w = cats["writing"]
    assert w["turns"] == 2 and w["speedup"]["mean"] == pytest.approx(1.05) and w["accept_len_mean"] == 2.0
    assert (w["accepted_from"]["drafter"], w["accepted_from"]["suffix"], w["accepted_from"]["both"]) == (2, 1, 1)
    assert w["accepted_from"]["drafter_share"] == 0.5 and cats["humaneval"]["accepted_from"]["suffix_share"] == 0.75
    assert report_mod.draw_accepted_by_category(cats, str(tmp_path)) == report_mod.FIGURES[9]
    assert (tmp_path / report_mod.FIGURES[9]).stat().st_size > 1000
    none = {c: {**v, "accepted_from": report_mod.accepted_shares([])} for c, v in cats.items()}
    assert report_mod.draw_accepted_by_category(none, str(tmp_path / "x")) is None    # nothing accepted: no figure


def test_accept_by_depth_hand_count():
    lens = [1, 2, 3, 6, 2]                          # accepted drafts 0, 1, 2, 5, 1
    r = accept_by_depth(lens, 5)
    assert r["depth"] == [1, 2, 3, 4, 5] and r["n_steps"] == 5
    assert r["reach"] == pytest.approx([4 / 5, 2 / 5, 1 / 5, 1 / 5, 1 / 5])
    assert r["conditional"] == pytest.approx([0.8, 0.5, 0.5, 1.0, 1.0])


def test_attention_buckets():
    b = attention_buckets([0, 31, 32, 127, 128, 255, 256, 1000])
    assert (b["0-31"], b["32-127"], b["128-255"], b["256+"], b["n"]) == (0.25, 0.25, 0.25, 0.25, 8)
    assert np.isnan(attention_buckets([])["0-31"])
    b = attention_buckets([5, 200, 300], columns=[0, 3, 100])         # rows at positions 5, 203, 400
    assert b["sink"] == pytest.approx(2 / 3) and b["far_not_sink"] == pytest.approx(1 / 3)


def test_parse_and_sweep_points():
    assert parse_int_list("8, 16,32") == (8, 16, 32)
    assert parse_int_list("none,128", allow_none=True) == (0, 128)
    with pytest.raises(ValueError):
        parse_int_list("8,x")
    sp = SpeculativeConfig(M=16, D_max=5, top_k=4)
    main = main_setting(sp)
    pts = budget_points(sp, (2, 16, 32), (2, 5), (4, 8)) + window_points(sp, (0, 128))
    settings, rows = dedupe(main, pts)
    # M=2 dropped (top_k > M); M=16, D=5, K=4 and W=none are the main setting itself
    assert [s.name for s in settings] == ["main", "M=32", "D=2", "K=8", "W=128"]
    assert [(r[0], r[1]) for r in rows] == [("M", 16), ("M", 32), ("D_max", 2), ("D_max", 5), ("top_k", 4),
                                            ("top_k", 8), ("window", 0), ("window", 128)]
    assert [r[2] for r in rows] == ["main", "M=32", "D=2", "main", "main", "K=8", "main", "W=128"]
    pts = budget_points(sp, (8,), (), ())                       # the config's own value joins each swept axis
    assert [(a, v) for a, v, _ in pts] == [("M", 8), ("M", 16)]


# ---------------------------------------------------------------------------------------- fake engine runs --
class FakeEngine:
    """Deterministic stand-in for Engine: output ids depend on the prompt; speculative steps are scripted."""

    def __init__(self, accept_script=(), calls=None, fail_at=None, corrupt=False):
        self.script, self.calls, self.fail_at, self.corrupt = list(accept_script), calls, fail_at, corrupt
        self.drafter = None

    def encode_chat(self, messages):
        return [len(m["content"]) % 50 + 3 for m in messages for _ in range(3)]

    def generate_ids(self, ids, gen, speculative=True, turn_id=""):
        if self.calls is not None:
            self.calls.append((turn_id, speculative, len(ids)))
            if self.fail_at is not None and len(self.calls) > self.fail_at:
                raise KeyboardInterrupt("simulated kill")
        out = [(sum(ids) + i) % 97 for i in range(gen.max_new_tokens)]
        steps = []
        if speculative:
            lens = self.script.pop(0) if self.script else [1] * len(out)
            steps = [StepTrace(step=k, accept_len=L, accepted=list(range(L)), n_nodes=8, draft_ms=2.0,
                               tensorize_ms=0.5, mask_ms=0.25, verify_ms=4.0, accept_ms=0.125, commit_ms=1.0,
                               total_ms=8.0) for k, L in enumerate(lens)]
            if self.corrupt:
                out = out[:-1] + [out[-1] + 1]
        ms = 10.0 * (len(steps) if speculative else len(out))
        turn = TurnTrace(turn_id, len(ids), len(out), prefill_ms=5.0, decode_ms=ms,
                         tok_per_s=len(out) / ((5.0 + ms) / 1e3),
                         mean_accept_len=float(np.mean([s.accept_len for s in steps])) if steps else 1.0)
        return Generation(out, f"answer to {turn_id}", "length", len(ids), steps, turn)


class FakePool:
    def __init__(self, engine):
        self.baseline = engine

    def engine(self, name):
        return self.baseline


TURNS = [TurnSpec("mtbench/81#0", "mtbench/81", "mtbench", "writing", 0, "Write a blog post."),
         TurnSpec("mtbench/81#1", "mtbench/81", "mtbench", "writing", 1, "Rewrite it.", "mtbench/81#0"),
         TurnSpec("HumanEval/0#0", "HumanEval/0", "humaneval", "humaneval", 0, "def f():")]
GEN = GenerationConfig(max_new_tokens=6)
MAIN = [Setting("main", 16, 5, 4)]


def test_resume_skips_finished_turns(tmp_path):
    path = str(tmp_path / "turns.jsonl")
    calls = []
    with pytest.raises(KeyboardInterrupt):   # killed during the third turn's baseline (5th generate call)
        run_turns(FakePool(FakeEngine(calls=calls, fail_at=4)), TURNS, GEN, MAIN, path, progress=False)
    assert list(read_records(path)) == ["mtbench/81#0", "mtbench/81#1"]
    with open(path, "a") as f:
        f.write('{"turn_id": "HumanEval/0#0", "trunc')             # torn line from the kill: ignored
    calls2 = []
    recs = run_turns(FakePool(FakeEngine(calls=calls2)), TURNS, GEN, MAIN, path, progress=False)
    assert [c[0] for c in calls2] == ["HumanEval/0#0", "HumanEval/0#0"]    # only the unfinished turn ran
    assert [r["turn_id"] for r in recs] == [t.turn_id for t in TURNS]
    # the second MT-Bench turn was asked after the first turn's baseline answer (3 messages -> 9 fake ids)
    assert calls[2] == ("mtbench/81#1", False, 9) and recs[1]["prompt_tokens"] == 9


def test_acceptance_by_position_from_synthetic_traces(tmp_path):
    script = [[1, 3, 2], [6, 1], [4]]          # L_k per step of the three speculative turns
    recs = run_turns(FakePool(FakeEngine(accept_script=script)), TURNS, GEN, MAIN, str(tmp_path / "t.jsonl"),
                     progress=False)
    rep = report_mod.build_report(recs, {"main": MAIN[0].to_dict(), "sweeps": {}})
    flat = [1, 3, 2, 6, 1, 4]
    hand = [sum(1 for L in flat if L - 1 >= d) / 6 for d in range(1, 6)]   # 4/6, 3/6, 2/6, 1/6, 1/6
    assert rep["figures"]["fig3_accept_by_depth"]["reach"] == pytest.approx(hand)
    assert hand == pytest.approx([4 / 6, 3 / 6, 2 / 6, 1 / 6, 1 / 6])
    assert rep["accept_len"]["mean"] == pytest.approx(np.mean(flat)) and rep["identical_outputs"] is True
    assert rep["turns"] == 3 and rep["by_source"]["mtbench"]["turns"] == 2
    # speedup per turn = (6 / (5 + 10 * steps) ms) / (6 / (5 + 60) ms)
    want = [65 / (5 + 10 * len(s)) for s in script]
    assert rep["speedup"]["mean"] == pytest.approx(np.mean(want))
    ov = rep["figures"]["fig5_overheads"]
    assert ov["steps"] == 6 and ov["total_ms"]["verify"] == pytest.approx(24.0)
    assert ov["total_ms"]["prefill"] == pytest.approx(15.0) and ov["total_ms"]["other"] == pytest.approx(60 - 6 * 7.875)
    assert sum(ov["share"].values()) == pytest.approx(1.0)
    report_mod.write_all(rep, str(tmp_path))
    assert "| reach | 0.667 | 0.500 | 0.333 | 0.167 | 0.167 |" in (tmp_path / "report.md").read_text()


def test_mismatch_fails_loudly_and_is_recorded(tmp_path):
    path = str(tmp_path / "t.jsonl")
    with pytest.raises(OutputMismatchError, match="differs from teacher-only greedy at generated token 5"):
        run_turns(FakePool(FakeEngine(corrupt=True)), TURNS, GEN, MAIN, path, progress=False)
    rec = read_records(path)["mtbench/81#0"]
    assert rec["settings"]["main"]["identical"] is False and rec["mismatch"]
    recs = run_turns(FakePool(FakeEngine(corrupt=True)), TURNS, GEN, MAIN, str(tmp_path / "u.jsonl"),
                     progress=False, allow_mismatch=True)
    assert report_mod.build_report(recs, {"main": MAIN[0].to_dict(), "sweeps": {}})["identical_outputs"] is False


def test_sweep_summary_marks_fastest(tmp_path):
    settings = [Setting("main", 16, 5, 4), Setting("M=8", 8, 5, 4)]
    recs = run_turns(FakePool(FakeEngine(accept_script=[[2, 2, 2], [1] * 6, [6], [3, 3]])), TURNS[:2], GEN,
                     settings, str(tmp_path / "t.jsonl"), progress=False)
    rows = summarize_points(recs, [("M", 16, "main"), ("M", 8, "M=8")], settings)
    assert [r["fastest"] for r in rows] == [True, False]       # main: 3 + 1 steps; M=8: 6 + 2 steps
    assert rows[0]["accept_len_mean"] == pytest.approx(12 / 4) and rows[1]["turns"] == 2


# ------------------------------------------------------------------------------------------------ GGUF peer --
def _bytes_to_unicode():
    bs = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), 256))
    cs, n = bs[:], 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return [chr(c) for _, c in sorted(zip(bs, cs))]


def _tokenizer_gguf(path):
    """A GGUF holding only tokenizer metadata (gpt2 byte-level BPE, 261 tokens) and a dummy tensor."""
    import gguf

    w = gguf.GGUFWriter(str(path), "llama")
    tokens = ["<|im_start|>", "<|im_end|>"] + _bytes_to_unicode() + ["Ġt", "he", "Ġthe"]
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("smollm")
    w.add_token_list(tokens)
    w.add_token_types([3, 3] + [1] * (len(tokens) - 2))
    w.add_token_merges(["Ġ t", "h e", "Ġt he"])
    w.add_bos_token_id(0)
    w.add_eos_token_id(1)
    w.add_chat_template("{% for m in messages %}<|im_start|>{{ m['content'] }}<|im_end|>{% endfor %}")
    w.add_tensor("dummy", np.zeros(4, np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return path


@pytest.mark.parametrize("tied", [True, False])
def test_gguf_f32_writer_roundtrip(tmp_path, tied):
    from tiny_pangu import random_tensors

    from mindspore_eagle.bench.peer import permute_qk, write_gguf_f32
    from mindspore_eagle.models.checkpoints import load_teacher, unpermute_qk
    from mindspore_eagle.models.model_config import ModelConfig

    cfg = ModelConfig(vocab_size=261, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                      num_kv_heads=2, head_dim=8, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=tied,
                      max_position_embeddings=256, arch="llama")
    tensors = random_tensors(cfg, seed=5)
    w = tensors["model.layers.0.self_attn.q_proj.weight"]
    assert np.array_equal(unpermute_qk(permute_qk(w, 4), 4), w) and not np.array_equal(permute_qk(w, 4), w)
    path = write_gguf_f32(tmp_path / "t.gguf", cfg, tensors, _tokenizer_gguf(tmp_path / "tok.gguf"))
    cfg2, loaded, tok = load_teacher(path)
    assert cfg2 == cfg.replace(bos_token_id=0, eos_token_ids=(1,))
    assert list(loaded) == list(tensors)
    for name, arr in tensors.items():
        assert loaded[name].dtype == np.float32 and np.array_equal(loaded[name], arr), name
    assert tok.decode(tok.encode("the thethe")) == "the thethe" and tok.eos_token_ids == (1,)
    from gguf import GGUFReader

    r = GGUFReader(str(path))
    assert {int(t.tensor_type) for t in r.tensors} == {0}            # GGML F32 only


FAKE_LLAMA_CPP = """
import os

class Llama:
    def __init__(self, model_path, n_threads, n_threads_batch, n_ctx, n_batch, verbose, seed, draft_model=None,
                 logits_all=False):
        assert os.path.exists(model_path) and n_threads == 2
        # as the real one (0.3.36): with a draft model every evaluated row's logits are kept, in a buffer of n_ctx
        # rows when logits_all is passed, else of n_batch rows
        self.draft, self.rows = draft_model, n_ctx if logits_all else n_batch

    def token_eos(self):
        return 1

    def generate(self, tokens, top_k, top_p, temp, repeat_penalty, reset):   # an old release: no min_p
        assert (top_k, temp, repeat_penalty) == (1, 0.0, 1.0)
        for i, tok in enumerate([7, 8, 9, 1, 5] if self.draft is None else [7, 8, 4, 1]):
            # a lookup step evaluates 1 + n tokens past the last kept one
            if self.draft and len(tokens) + i + self.draft.n + 1 > self.rows:
                raise ValueError("could not broadcast input array")
            yield tok
"""

FAKE_LOOKUP = """
class LlamaPromptLookupDecoding:
    def __init__(self, num_pred_tokens=10):
        self.n = num_pred_tokens
"""


def fake_llama_cpp(tmp_path, monkeypatch):
    """A stand-in ``llama_cpp`` package importable here and in the peer process (PYTHONPATH): greedy yields
    7, 8, 9, 1, 5; with a prompt-lookup draft model 7, 8, 4, 1."""
    pkg = tmp_path / "fake" / "llama_cpp"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(FAKE_LLAMA_CPP)
    (pkg / "llama_speculative.py").write_text(FAKE_LOOKUP)
    monkeypatch.syspath_prepend(str(tmp_path / "fake"))
    monkeypatch.setenv("PYTHONPATH", str(tmp_path / "fake"))


def test_peer_env_drops_ours_and_openmp():
    env = {"PATH": "/bin", "OMP_WAIT_POLICY": "PASSIVE", "OMP_NUM_THREADS": "1", "GOMP_SPINCOUNT": "0",
           "KMP_BLOCKTIME": "0", "MSEAGLE_THREADS": "2", "MS_DEV_X": "1", "HOME": "/root", "OPENBLAS_CORETYPE": "x"}
    from mindspore_eagle.bench.peer import peer_env

    assert peer_env(env) == {"PATH": "/bin", "HOME": "/root", "OPENBLAS_CORETYPE": "x"}


def test_llamacpp_peer_runs_in_a_clean_process(tmp_path, monkeypatch):
    """The peer code path with a stand-in ``llama_cpp``: the peer process sees none of our OpenMP / thread
    variables although this process has them, greedy and prompt-lookup variants stop on EOS / max_new_tokens,
    match_prefix against our ids, and the report's peer rows."""
    fake_llama_cpp(tmp_path, monkeypatch)
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("MSEAGLE_THREADS", "2")
    from tiny_pangu import random_tensors

    from mindspore_eagle.bench import peer
    from mindspore_eagle.config import load_config
    from mindspore_eagle.models.model_config import ModelConfig
    from mindspore_eagle.serving.pipeline import Loaded

    assert peer.available()
    cfg_t = ModelConfig(vocab_size=261, hidden_size=32, intermediate_size=48, num_layers=3, num_heads=4,
                        num_kv_heads=2, head_dim=8, rope_theta=1e5, rms_norm_eps=1e-5, tie_word_embeddings=True,
                        max_position_embeddings=256, arch="llama", eos_token_ids=(1,))
    src = _tokenizer_gguf(tmp_path / "tok.gguf")
    cfg = load_config(None, [f"model.teacher={src}"])
    p = peer.make_peer(cfg, Loaded(cfg_t, random_tensors(cfg_t, 1), None, None, None), str(tmp_path), 2)
    try:
        written = list(tmp_path.glob("teacher_f32-*.gguf"))
        assert len(written) == 1 and p.variants == ["greedy", "lookup2", "lookup10"]
        other = tmp_path / "other.gguf"                     # another teacher, same folder: a file of its own
        other.write_bytes(src.read_bytes() + b"\0")
        cfg2 = load_config(None, [f"model.teacher={other}"])
        assert peer.write_peer_gguf(cfg2, Loaded(cfg_t, random_tensors(cfg_t, 1), None, None, None),
                                    str(tmp_path)) not in map(str, written)
        seen = p.proc.call(cmd="env")
        assert seen["env"] == {} and seen["pid"] != os.getpid()              # no OMP_* / MSEAGLE_* over there
        r = p.run([0, 5, 6], 128, [7, 8, 4, 1])
        assert r["new_tokens"] == 4 and r["match_prefix"] == 0.5 and r["tok_s"] > 0        # stopped at EOS 1
        assert set(r["lookup"]) == {"2", "10"} and r["lookup"]["10"]["match_prefix"] == 1.0
        assert p.run([0], 2, [7, 8])["new_tokens"] == 2                                    # max_new_tokens
        assert cfg.cache.max_seq_len > 512                      # past n_batch, and lookup 10 drafts past the end
        near_end = [0] * (cfg.cache.max_seq_len - 4)
        assert p.run(near_end, 4, [7, 8, 4, 1])["lookup"]["10"]["new_tokens"] == 4
        with pytest.raises(peer.PeerError, match="unknown cmd"):
            p.proc.call(cmd="nope")
    finally:
        p.close()
    assert p.proc.proc.poll() == 0



def test_report_reads_llama_cpp_python_rows_of_older_runs(tmp_path):
    """Records of runs made before the llama-server peer keep their rows (``peer_llamacpp``, greedy + lookup)."""
    recs = run_turns(FakePool(FakeEngine()), TURNS[:1], GEN, MAIN, str(tmp_path / "t.jsonl"), progress=False)
    recs[0]["peer_llamacpp"] = {"tok_s": 20.0, "new_tokens": 6, "seconds": 0.3, "match_prefix": 1.0,
                                "lookup": {"2": {"tok_s": 25.0, "new_tokens": 6, "seconds": 0.24, "match_prefix": 1.0}}}
    rep = report_mod.build_report(recs, {"main": MAIN[0].to_dict(), "sweeps": {}})
    assert rep["peer_llamacpp_tok_s"]["mean"] == 20.0
    rows = rep["peers"]["rows"]
    main = recs[0]["settings"]["main"]
    ours = main["new_tokens"] / ((main["prefill_ms"] + main["decode_ms"]) / 1e3)
    assert rows["llama-cpp-python greedy"]["tok_s"] == pytest.approx(20.0)
    assert rows["llama-cpp-python prompt lookup 2"]["ea_over"] == pytest.approx(ours / 25.0)
    assert rows["llama-cpp-python greedy"]["same_turns"] is None
    assert "llama-cpp-python prompt lookup 2" in report_mod.markdown(rep)


def test_a_resumed_run_keeps_its_fixed_parameters_peers_included(tmp_path, capsys):
    """run.json pins what a run's turns were timed with; a restart with other peers (or settings) is refused with
    the differing keys named, the same ones resume under the stored name."""
    from mindspore_eagle.bench import _open_run
    from mindspore_eagle.config import load_config

    cfg = load_config(None, [])
    fixed = {"turn_ids": ["a", "b"], "peers": "greedy,ngram-mod"}
    assert _open_run(str(tmp_path), "first", fixed, cfg) == "first"
    assert _open_run(str(tmp_path), "second", dict(fixed), cfg) == "first"
    assert _open_run(str(tmp_path), "third", dict(fixed, peers="eagle3:2"), cfg) is None
    assert "different parameters (peers)" in capsys.readouterr().err
