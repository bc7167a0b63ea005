"""serving/round.py without MindSpore: the decode round over numpy stand-ins of the two runners.

The stand-in teacher's next token is a fixed function of (last token, position), so the exact teacher-only output
is known in closed form; the stand-in drafter proposes a chain of those true tokens plus a wrong sibling (an
oracle) or random tokens. Greedy output must equal teacher-only output token for token whatever the drafter does.
"""
from __future__ import annotations

import numpy as np
import pytest

from mindspore_eagle.config import GenerationConfig, SpeculativeConfig
from mindspore_eagle.core.emit import Emitter
from mindspore_eagle.core.policy import FixedPolicy
from mindspore_eagle.core.tree import DraftTree
from mindspore_eagle.serving.round import BatchLayout, DecodeRound, Sequence

V, EOS = 50, 0


def truth(token: int, pos: int) -> int:
    """The stand-in teacher's argmax after ``token`` at position ``pos`` (never EOS)."""
    return 1 + (token * 7 + pos * 3) % (V - 1)


def cyclic(token: int, pos: int) -> int:
    """A teacher that repeats itself: a cycle of six tokens (1 6 3 2 4 7), whose step shifts for 16 positions out
    of every 48, so text copied from earlier is right most of the time, not always."""
    return 1 + (token * 5 + ((pos // 16) % 3 == 2)) % 7


def logits_for(token: int, pos: int, rule=truth) -> np.ndarray:
    z = np.linspace(0.0, 0.1, V).astype(np.float32)          # distinct values: a unique argmax
    z[rule(token, pos)] = 5.0
    return z


class FakeTeacher:
    """TeacherRunnerLike in numpy: a sequence is its committed token list; a tree verified is kept until commit."""

    def __init__(self, S: int = 512, rule=truth, host: bool = False):
        self.S, self.seqs, self.trees, self.n, self.rule, self.host = S, {}, {}, 0, rule, host
        self.rows_seen = []              # (rows, budgets) of each verify_batch

    def new_seq(self):
        self.n += 1
        self.seqs[self.n] = []
        return self.n

    def free(self, sid):
        del self.seqs[sid]

    def length(self, sid):
        return len(self.seqs[sid])

    def prefill(self, sid, ids):
        self.seqs[sid] += [int(i) for i in ids]
        return logits_for(self.seqs[sid][-1], len(self.seqs[sid]) - 1, self.rule), np.zeros((len(ids), 3), np.float32)

    def decode(self, sid, token):
        self.seqs[sid].append(int(token))
        return logits_for(int(token), len(self.seqs[sid]) - 1, self.rule), np.zeros((1, 3), np.float32)

    def decode_batch(self, sids, tokens, rows, width_step=512, with_aux=False, with_hidden=False):
        assert len(sids) <= rows
        out = [self.decode(s, t) for s, t in zip(sids, tokens)]
        logits, aux = np.stack([o[0] for o in out]), np.concatenate([o[1] for o in out])
        return (logits, aux) if with_aux else logits

    def verify_mask(self, sid, tt):
        return None

    def verify(self, sid, tt, mask=None):
        n = len(self.seqs[sid])
        self.trees[sid] = tt
        logits = np.stack([logits_for(int(t), n + int(d), self.rule) for t, d in zip(tt.tokens, tt.depth)])
        return logits, np.arange(tt.budget, dtype=np.float32)[:, None].repeat(3, 1)

    def on_host(self, rows):
        return self.host

    def verify_batch(self, sids, trees, rows, width_step=512):
        assert sum(t.budget for t in trees) <= rows
        self.rows_seen.append((rows, [t.budget for t in trees]))
        outs = [self.verify(s, t) for s, t in zip(sids, trees)]
        return np.concatenate([o[0] for o in outs]), np.concatenate([o[1] for o in outs])

    def commit(self, sid, path, width):
        tt = self.trees.pop(sid)
        self.seqs[sid] += [int(tt.tokens[i]) for i in path]


class FakeDrafter:
    """DrafterRunnerLike in numpy: ``extend`` counts context pairs (= the teacher's committed length), trees are
    the true chain from the root plus one wrong sibling per level (``oracle``) or random tokens."""

    def __init__(self, oracle: bool = True, seed: int = 0, rule=truth):
        self.oracle, self.rng, self.count, self.n, self.rule = oracle, np.random.default_rng(seed), {}, 0, rule

    def new_seq(self):
        self.n += 1
        self.count[self.n] = 0
        return self.n

    def free(self, sid):
        del self.count[sid]

    def extend(self, sid, aux, next_tokens):
        assert len(aux) == len(next_tokens) >= 1
        self.count[sid] += len(next_tokens)
        return self.count[sid]

    def build_tree(self, sid, root, first, M, D, grow=None):
        tokens, parents, scores, node, tok = [root], [0], [0.0], 0, root
        for depth in range(1, D + 1):
            if depth > 1 and grow is not None and not grow(DraftTree(tokens, parents, np.asarray(scores)),
                                                          np.asarray(scores[-2:]), depth - 1):
                break
            nxt = self.rule(tok, first + depth - 1) if self.oracle else int(self.rng.integers(1, V))
            if len(tokens) >= M:
                break
            tokens.append(nxt)                                  # the chain token, then a wrong sibling
            parents.append(node)
            scores.append(-0.1 * depth)
            chain = len(tokens) - 1
            if len(tokens) < M:
                tokens.append(1 + nxt % (V - 1))
                parents.append(node)
                scores.append(-0.1 * depth - 1.0)
            node, tok = chain, nxt
        return DraftTree(np.asarray(tokens), np.asarray(parents), np.asarray(scores, np.float64))

    def draft_batch(self, sids, pending, roots, M, D, groups):
        assert len(sids) <= groups
        return [self.build_tree(s, r, self.extend(s, *p), M, D) for s, p, r in zip(sids, pending, roots)]


class Tok:
    def decode(self, ids):
        return " ".join(map(str, ids))


def reference(prompt: list, n_new: int, rule=truth) -> list:
    """Teacher-only greedy output of the stand-in teacher, in closed form."""
    seq, out = list(prompt), []
    for _ in range(n_new):
        out.append(rule(seq[-1], len(seq) - 1))
        seq.append(out[-1])
    return out


def run(rnd: DecodeRound, teacher: FakeTeacher, prompts: list, gen: GenerationConfig) -> list:
    """Prefill each prompt, then step all sequences together until every Emitter ends (or the round fails a
    sequence: ``s.error``); returns the sequences."""
    seqs = []
    for p in prompts:
        s = Sequence(teacher.new_seq(), -1, gen, Emitter(Tok(), {EOS}, gen))
        logits, aux = teacher.prefill(s.sid, p)
        s.next = int(np.argmax(logits))
        s.emitter.push(s.next)
        rnd.start(s, p, aux)
        seqs.append(s)
    live = list(seqs)
    while live:
        for s, toks in zip(live, rnd.step(live)):
            assert toks == s.emitter.ids[len(s.emitter.ids) - len(toks):]
            assert not s.error or toks == []              # a failed sequence emits nothing more
        live = [s for s in live if not s.emitter.reason and not s.error]
    for s in seqs:
        rnd.finish(s)
    return seqs


PROMPTS = [[3, 9, 4], [7], [11, 12, 13, 14, 15, 16]]


def assert_cache_true(tg: FakeTeacher, s, prompt: list) -> None:
    """Every token in the teacher cache is the prompt or a true output token (commit kept the accepted path only),
    and the cache holds at least every emitted token but the pending last one."""
    cache = tg.seqs[s.sid]
    assert cache == (prompt + reference(prompt, 64))[: len(cache)]
    assert len(cache) >= len(prompt) + len(s.emitter.ids) - 1


def test_teacher_only_round_is_greedy_decoding():
    gen = GenerationConfig(max_new_tokens=20)
    for rows in (1, 3):
        tg = FakeTeacher()
        seqs = run(DecodeRound(tg, rows=rows), tg, PROMPTS if rows > 1 else PROMPTS[:1], gen)
        for s, p in zip(seqs, PROMPTS):
            assert s.emitter.ids == reference(p, 20) and s.emitter.reason == "length"
            assert s.accept_lens == [] and all(st.budget == 1 for st in s.steps)


@pytest.mark.parametrize("oracle", [True, False])
def test_speculative_round_one_sequence_is_lossless(oracle):
    """N = 1: the policy's budget, the single-sequence calls; output identical to teacher-only greedy."""
    gen = GenerationConfig(max_new_tokens=23)
    spec = SpeculativeConfig(M=8, D_max=3, top_k=2, policy="fixed")
    tg, dr = FakeTeacher(), FakeDrafter(oracle)
    (s,) = run(DecodeRound(tg, dr, spec, rows=1, policy=FixedPolicy(8, 3)), tg, PROMPTS[:1], gen)
    assert s.emitter.ids == reference(PROMPTS[0], 23)
    assert_cache_true(tg, s, PROMPTS[0])
    if oracle:                                                     # every draft accepted: L_k = D_max + 1
        assert s.accept_lens[:-1] == [4] * (len(s.accept_lens) - 1) and s.emitter.reason == "length"
    else:
        assert min(s.accept_lens) >= 1 and len(s.steps) >= 20
    assert dr.count == {}                                          # finish() freed the drafter sequence


class Scripted:
    """A rate gate that replays ``kinds`` in turn and records what it is told: ``seen`` (kind, tokens) and
    ``times`` (kind, ms, extra_ms) of every step."""

    def __init__(self, kinds):
        self.kinds, self.i, self.seen, self.times = kinds, 0, [], []

    def choose(self):
        self.i += 1
        return self.kinds[(self.i - 1) % len(self.kinds)]

    def observe(self, kind, tokens, ms, extra_ms=0.0):
        self.seen.append((kind, tokens))
        self.times.append((kind, ms, extra_ms))


def test_speculative_batch_is_lossless_and_the_gate_sees_both_kinds():
    """N = 3: trees of one budget for every row (one verify_batch; M here, as batch_tree_rows allows 3 x M rows), or
    a plain batched step, as the gate says."""

    gen = GenerationConfig(max_new_tokens=17)
    spec = SpeculativeConfig(M=8, D_max=3, top_k=2, policy="fixed", batch_tree_rows=24)   # 3 rows x M = 8 each
    tg, dr = FakeTeacher(), FakeDrafter(True)
    # the default batch_tree_rows 16: a step of 3 (row bucket 4) verifies 4 tokens each and drafts 3 deep
    assert DecodeRound(tg, dr, SpeculativeConfig(M=8, D_max=3, top_k=2), rows=4, gate=Scripted([])).batch_budget(3) \
        == (4, 3)
    gate = Scripted(["tree", "plain"])
    seqs = run(DecodeRound(tg, dr, spec, rows=3, gate=gate), tg, PROMPTS, gen)
    for s, p in zip(seqs, PROMPTS):
        assert s.emitter.ids == reference(p, 17)
        assert_cache_true(tg, s, p)
    assert {k for k, _ in gate.seen} == {"tree", "plain"}
    assert all(n == 3 for k, n in gate.seen if k == "plain")       # a plain step: one token per live sequence
    assert max(n for k, n in gate.seen if k == "tree") == 3 * 4     # a tree step: L_k = 4 for each of 3 rows


def test_a_drafter_backlog_is_fed_apart_from_the_step_the_gate_measures():
    """After plain steps the drafter has pairs of several steps queued: a tree step feeds all but the latest
    step's first (``_catch_up``), outside the time the gate observes, so a rarely probed drafter is judged at its
    every-step cost. Here the backlog pass sleeps 0.2 s: no tree step reported to the gate took that long, the
    pairs the drafter saw equal the teacher's tokens, and the output is teacher-only greedy."""
    import time

    class SlowBacklog(FakeDrafter):
        def extend(self, sid, aux, next_tokens):
            if len(next_tokens) > 1 and self.count[sid] > 0:      # pairs of several steps: the catch-up
                time.sleep(0.2)
                self.slept += 1
            return super().extend(sid, aux, next_tokens)

    gen = GenerationConfig(max_new_tokens=17)
    spec = SpeculativeConfig(M=8, D_max=3, top_k=2, policy="fixed", batch_tree_rows=24)
    tg, dr = FakeTeacher(), SlowBacklog(True)
    dr.slept = 0
    gate = Scripted(["plain", "plain", "tree"])
    rnd = DecodeRound(tg, dr, spec, rows=3, gate=gate)
    seqs = run(rnd, tg, PROMPTS, gen)
    for s, p in zip(seqs, PROMPTS):
        assert s.emitter.ids == reference(p, 17)
        assert_cache_true(tg, s, p)
    trees = [(ms, extra) for k, ms, extra in gate.times if k == "tree"]
    assert trees and max(ms for ms, _ in trees) < 150.0 and dr.slept >= 3
    assert sum(extra for _, extra in trees) >= 200.0 * dr.slept            # the backlog's time paces the probes


def test_a_tree_step_stops_at_the_emitter():
    """max_new_tokens inside an accepted path: the emitted tokens are cut there, and nothing after is pushed."""
    gen = GenerationConfig(max_new_tokens=6)
    spec = SpeculativeConfig(M=8, D_max=3, top_k=2, policy="fixed")
    tg = FakeTeacher()
    (s,) = run(DecodeRound(tg, FakeDrafter(True), spec, rows=1, policy=FixedPolicy(8, 3)), tg, PROMPTS[:1], gen)
    assert s.emitter.ids == reference(PROMPTS[0], 6) and s.emitter.reason == "length"
    assert s.accept_lens == [4, 4]                                  # the second step accepted 4, emitted 1


def test_batch_layout():
    lay = BatchLayout(np.array([1, 4, 2]), 8)
    assert lay.offsets.tolist() == [0, 1, 5, 7]
    assert [lay.rows_of(i) for i in range(3)] == [slice(0, 1), slice(1, 5), slice(5, 7)]
    assert BatchLayout.uniform(3, 8, 32).offsets.tolist() == [0, 8, 16, 24]
    with pytest.raises(ValueError, match="fit 6 rows"):
        BatchLayout(np.array([4, 4]), 6)
    with pytest.raises(ValueError, match=">= 1"):
        BatchLayout(np.array([0, 2]), 6)


def test_round_arguments_are_checked():
    with pytest.raises(ValueError, match="needs a speculation policy"):
        DecodeRound(FakeTeacher(), FakeDrafter(), SpeculativeConfig(), rows=1)
    with pytest.raises(ValueError, match="teacher-only"):
        DecodeRound(FakeTeacher(), FakeDrafter(), SpeculativeConfig(), rows=2, features=True)


def test_a_turn_past_the_drafters_trained_positions_is_noted_once(capsys):
    """Lossless as ever, but said: a note on each such sequence, one stderr line per drafter."""
    import mindspore_eagle.serving.round as round_mod

    gen = GenerationConfig(max_new_tokens=12)
    spec = SpeculativeConfig(M=8, D_max=3, top_k=2, policy="fixed")
    tg, dr = FakeTeacher(), FakeDrafter(True)
    dr.max_positions = 10
    round_mod._POSITION_WARNED.discard(id(dr))
    rnd = DecodeRound(tg, dr, spec, rows=3, gate=None)
    seqs = run(rnd, tg, PROMPTS, gen)
    assert [s.emitter.ids for s in seqs] == [reference(p, 12) for p in PROMPTS]
    for s, p in zip(seqs, PROMPTS):
        last = len(p) + 12
        assert s.notes == [f"prompt of {len(p)} tokens + generation.max_new_tokens=12 reaches position {last}, past "
                           f"the drafter's trained max_position_embeddings=10: output stays lossless, drafts there "
                           f"are accepted less often"]
    assert capsys.readouterr().err.count("warning: prompt of") == 1
    dr.max_positions = 64
    (s,) = run(DecodeRound(tg, dr, spec, rows=1, policy=FixedPolicy(8, 3)), tg, PROMPTS[:1], gen)
    assert s.notes == []


# ---------------------------------------------------------------------------------------------- suffix candidates
class TreesAlways:
    """A rate gate that always picks trees (the numpy stand-ins' step times are noise)."""

    def choose(self):
        return "tree"

    def observe(self, kind, tokens, ms, extra_ms=0.0):
        pass


def _suffix_round(tg, drafter, rows, suffix=None):
    from mindspore_eagle.core.suffix import SuffixIndex

    spec = SpeculativeConfig(M=8, D_max=5, top_k=2, policy="fixed", method="hybrid")
    return DecodeRound(tg, drafter, spec, rows=rows, policy=FixedPolicy(8, 5) if rows == 1 else None,
                       gate=TreesAlways() if rows > 1 else None,
                       suffix=suffix if suffix is not None else SuffixIndex())


@pytest.mark.parametrize("drafter", [None, "oracle", "random"])
def test_suffix_candidates_are_lossless_and_copy_repeated_text(drafter):
    """Suffix candidates alone or merged with either drafter: output identical to teacher-only greedy on a
    teacher that repeats itself, with the copied stretches accepted whole: under 1/2.8 of the teacher forwards of
    teacher-only decoding, even beside a drafter that is always wrong."""
    gen = GenerationConfig(max_new_tokens=90)
    tg = FakeTeacher(rule=cyclic)
    dr = None if drafter is None else FakeDrafter(drafter == "oracle", seed=3, rule=cyclic)
    (s,) = run(_suffix_round(tg, dr, 1), tg, [[3, 9, 4]], gen)
    assert s.emitter.ids == reference([3, 9, 4], 90, cyclic)
    assert_cache_true_rule(tg, s, [3, 9, 4], cyclic)
    assert 90 / len(s.steps) > 2.8                  # tokens per teacher forward (plain steps included; 1 alone)
    copied = sum(st.accepted_suffix + st.accepted_both for st in s.steps)
    assert copied > 40 and all(st.accepted_suffix + st.accepted_both <= st.accept_len - 1 for st in s.steps)
    if drafter is None:
        assert not any(st.drafted for st in s.steps) and all(st.accepted_both == 0 for st in s.steps)


def test_batched_suffix_candidates_are_lossless():
    """N = 3 with suffix candidates merged into the drafter's trees (cut to M by calibrated value) or alone: every
    sequence equals teacher-only greedy."""
    gen = GenerationConfig(max_new_tokens=70)
    prompts = [[3, 9, 4], [7], [11, 12, 13, 14, 15, 16]]
    for dr in (None, FakeDrafter(False, seed=5)):
        tg = FakeTeacher(rule=cyclic)
        seqs = run(_suffix_round(tg, dr, 3), tg, prompts, gen)
        for s, p in zip(seqs, prompts):
            assert s.emitter.ids == reference(p, 70, cyclic)
            assert_cache_true_rule(tg, s, p, cyclic)
        assert sum(st.accepted_suffix for s in seqs for st in s.steps) > 20    # copies accepted in batches too


class LinearRows:
    """RowCosts stand-in: a forward of R rows costs a + b R ms (the numpy teacher's own times are noise)."""

    def __init__(self, a: float, b: float):
        self.a, self.b = a, b

    def ms(self, rows):
        return self.a + self.b * np.asarray(rows, np.float64)

    def observe(self, rows, ms):
        pass


@pytest.mark.parametrize("host", [True, False])
def test_batched_rows_follow_value_and_cost(host):
    """N = 3, suffix candidates alone (no gate: every step allots rows, core.policy.allot_rows): with free rows
    each sequence verifies its candidates, sequences of different budgets in one forward of exactly the rows used
    (on the host) or of the graph's b x m_b rows; with dear rows nothing is verified (plain steps); lossless
    either way."""
    gen = GenerationConfig(max_new_tokens=70)
    prompts = [[3, 9, 4], [7], [11, 12, 13, 14, 15, 16]]
    for costs, trees in ((LinearRows(10.0, 0.0), True), (LinearRows(1.0, 50.0), False)):
        tg = FakeTeacher(rule=cyclic, host=host)
        rnd = _suffix_round(tg, None, 3)
        rnd.gate, rnd.row_costs = None, costs
        seqs = run(rnd, tg, prompts, gen)
        for s, p in zip(seqs, prompts):
            assert s.emitter.ids == reference(p, 70, cyclic)
            assert_cache_true_rule(tg, s, p, cyclic)
        if not trees:
            assert tg.rows_seen == [] and all(st.budget == 1 for s in seqs for st in s.steps)
            continue
        assert any(len(set(b)) > 1 for _, b in tg.rows_seen)            # ragged: budgets differ within a step
        assert max(max(b) for _, b in tg.rows_seen) > rnd.batch_budget(3)[0]    # one sequence past b x m_b / b
        for rows, b in tg.rows_seen:
            assert rows == (sum(b) if host else rnd.tree_rows(len(b))) and sum(b) <= rnd.tree_rows(len(b))


def test_earlier_outputs_are_shared_but_never_a_turns_own():
    """The process index gets a sequence's output when it finishes, keyed by its prompt: a later turn of another
    prompt drafts from it, a later turn of the same prompt does not (a bench's teacher-only run of a turn never
    feeds its speculative run), and a teacher-only round adds nothing."""
    from mindspore_eagle.core.suffix import SuffixIndex

    gen = GenerationConfig(max_new_tokens=40)
    pool = SuffixIndex()
    tg = FakeTeacher(rule=cyclic)
    run(DecodeRound(tg, rows=1), tg, [[3, 9, 4]], gen)                       # teacher-only: not indexed
    assert len(pool) == 0
    (first,) = run(_suffix_round(tg, None, 1, pool), tg, [[3, 9, 4]], gen)
    assert len(pool) == 1 and pool.docs[0] == first.emitter.ids and pool.keys[0] == hash((3, 9, 4))
    rnd = _suffix_round(tg, None, 1, pool)
    for prompt, reads in (([3, 9, 4], False), ([2, 9, 4], True)):
        s = Sequence(tg.new_seq(), -1, gen, Emitter(Tok(), {EOS}, gen))
        logits, aux = tg.prefill(s.sid, prompt)
        s.next = int(np.argmax(logits))
        rnd.start(s, prompt, aux)
        own, _ = s.state.text.match(s.state.text.docs[0])
        k, occ = pool.match(s.state.text.docs[0], s.state.key)
        assert (k > 0) == reads and own == 0
        rnd.finish(s)


def assert_cache_true_rule(tg: FakeTeacher, s, prompt: list, rule) -> None:
    cache = tg.seqs[s.sid]
    assert cache == (prompt + reference(prompt, 200, rule))[: len(cache)]


class PoisonTeacher(FakeTeacher):
    """The stand-in teacher whose logits for sequence ``bad`` become NaN / inf once its cache holds ``after``
    tokens (a numerical fault in one row of a batched forward)."""

    def __init__(self, bad: int, after: int, value=np.nan):
        super().__init__()
        self.bad, self.after, self.value = bad, after, value

    def _poison(self, sid, logits):
        if sid == self.bad and len(self.seqs[sid]) >= self.after:
            logits = logits.copy()
            logits[..., 3] = self.value
        return logits

    def decode(self, sid, token):
        logits, aux = super().decode(sid, token)
        return self._poison(sid, logits), aux

    def verify(self, sid, tt, mask=None):
        logits, aux = super().verify(sid, tt, mask)
        return self._poison(sid, logits), aux


@pytest.mark.parametrize("value", [np.nan, np.inf])
@pytest.mark.parametrize("drafter", [False, True])
@pytest.mark.parametrize("temperature", [0.0, 0.7])
def test_a_sequence_with_non_finite_logits_fails_alone(value, drafter, temperature):
    """Sequence 2 of 3 gets NaN / inf logits part-way: it ends with an error naming the cause and emits nothing
    more; the other two emit exactly what they emit in a run without the fault (plain and tree steps, greedy and
    seeded sampling)."""
    gen = GenerationConfig(max_new_tokens=17, temperature=temperature, seed=4)
    spec = SpeculativeConfig(M=8, D_max=3, top_k=2, policy="fixed")

    def go(tg):
        dr = FakeDrafter(True) if drafter else None
        return run(DecodeRound(tg, dr, spec if drafter else None, rows=3), tg, PROMPTS, gen)

    clean = go(FakeTeacher())
    faulty = go(PoisonTeacher(bad=2, after=len(PROMPTS[1]) + 5, value=value))
    assert all(not s.error for s in clean)
    assert faulty[1].error.startswith("the teacher's logits for this sequence were not finite")
    assert 0 < len(faulty[1].emitter.ids) < len(clean[1].emitter.ids)
    assert faulty[1].emitter.ids == clean[1].emitter.ids[: len(faulty[1].emitter.ids)]
    for i in (0, 2):
        assert not faulty[i].error and faulty[i].emitter.ids == clean[i].emitter.ids


def test_regeneration_shares_the_round_and_stops_on_non_finite_logits():
    """train.regen.generate_stream (the drafter's training data) runs the same prologue and round: greedy replies
    equal the reference decoding; a row whose logits turn NaN raises FloatingPointError naming its item, and every
    row in flight is freed (a broken teacher writes no training data)."""
    from mindspore_eagle.train.regen import generate_stream

    items = [(p, 12) for p in PROMPTS]
    tg = FakeTeacher()
    got = {i: reply for i, reply, _, _ in generate_stream(tg, items, eos=[], batch=2)}
    assert got == {i: reference(p, 12) for i, p in enumerate(PROMPTS)}
    assert tg.seqs == {}
    bad = PoisonTeacher(bad=2, after=len(PROMPTS[1]) + 3)
    with pytest.raises(FloatingPointError, match=r"item 1: the teacher's logits for this sequence were not finite"):
        list(generate_stream(bad, items, eos=[], batch=2))
    assert bad.seqs == {}
