"""Drafter training loop: feature shards -> draft vocab -> TTT steps -> SpecForge export, with exact resume.

Legend: T = max_len, S = ttt_length, N = training samples, Vd = draft vocab, V = teacher vocab, H = hidden.

Layout of ``<out>`` (the drafter directory):
    config.json, model.safetensors   SpecForge / EAGLE-3 drafter (fp16 weights, d2t int64, t2d bool, no
                                     embedding; ``models.eagle3.save_drafter``), rewritten at every checkpoint
    train_log.jsonl                  one line per step: step, lr, loss, step losses [S], correct [S], masked [S],
                                     samples and real tokens of the step, stream cursor after it, elapsed_s /
                                     cpu_s (wall / this process's CPU seconds since the loop began)
    eval_log.jsonl                   one line per checkpoint (and one at step 0, the initial weights, when a run
                                     starts): held-out loss, top-1 accuracy, top-k coverage per TTT step, the
                                     implied L_k (coverage.py) and tokens_seen (real training tokens so far,
                                     over resumes: the x axis of an L_k-against-tokens curve)
    summary.json                     final numbers (accuracies, coverage, throughput, wall time, data counts,
                                     vocab mass, command)
    resume/state.npz                 float32 weights, optimiser moments, step, stream cursor, batch layout, vocab
                                     ids, sample count

The training stream is a pure function of (seed, epoch) (a permutation per epoch, batching.stream_sample); a
step takes the next samples of the stream (``batch_size`` rows of one sample each, or first-fit packed rows of
``pack_len`` tokens, batching.plan_rows) and the stream cursor is saved with the weights; the learning rate is
a pure function of the step (``ttt.lr_at``). So a resumed run repeats the uninterrupted loss curve. Shapes are
fixed (B x T), the step compiles once. The last ``n_eval`` samples are held out and scored when a run starts
(step 0), at every checkpoint and at the end (per-step top-1 accuracy, docs/design.md, "Drafter training", and top-k
coverage, coverage.py).

Data parallelism (msrun, W ranks; distributed.py): ``batch_size`` G is the global batch; each rank trains on its
B = G / W rows of every step's G stream positions with a gradient all-reduce (mean) inside the jitted step,
logs / checkpoints / the resume state (global cursor) are rank 0's and equal the single-process ones; the
held-out evaluation is split over the ranks. No packing with W > 1.
"""
from __future__ import annotations

import json
import os
import signal
import time
from dataclasses import asdict, dataclass

import numpy as np

from mindspore_eagle.models.eagle3 import (
    DrafterConfig,
    init_drafter_tensors,
    save_drafter,
)
from mindspore_eagle.train.batching import (
    assemble,
    plan_rows,
    sample_arrays,
    stream_sample,
)
from mindspore_eagle.train.coverage import KS, coverage_counts, coverage_report
from mindspore_eagle.train.distributed import (
    DistContext,
    check_batch,
    local_positions,
    reduce_step_stats,
)
from mindspore_eagle.train.features import FeatureSet, head_weight
from mindspore_eagle.train.ttt import TrainStep, TTTDrafter, lr_at
from mindspore_eagle.train.vocab import build_vocab

INITS = ("random", "teacher")


@dataclass
class TrainConfig:
    """Options of :func:`train` (CLI names in ``__main__``). ``warmup`` None = 3 % of steps; ``intermediate``
    None = the teacher's FFN width; ``n_eval`` held-out samples; ``max_samples`` caps the samples used;
    ``stop_at`` ends the loop early (as if killed there; the schedule still spans ``steps``; SIGTERM does the same
    at the next step boundary: state saved, summary ``stopped_by`` "SIGTERM", no held-out pass); ``init_from`` a
    SpecForge drafter directory to fine-tune (its weights and its draft vocabulary; ``vd`` must match);
    ``batch_size`` rows per optimiser step (over all msrun ranks: the global batch G, a multiple of the ranks);
    ``pack_len`` 0 = one sample per row of ``max_len`` tokens, else the row length (>= max_len) into which whole
    samples are packed (one process only); ``init`` "random" | "teacher" (see
    :func:`initial_tensors`; ignored with ``init_from``); ``num_layers`` drafter decoder layers (1 = EAGLE-3's;
    ``init_from`` a drafter with fewer layers grows it: the new layers start as the identity,
    ``init_drafter_tensors``); ``argmax_weight`` the share of the loss's target on the teacher's argmax
    (``ttt.TTTDrafter``; 0 = the EAGLE-3 loss); ``fc_norm`` one RMSNorm per captured layer before ``fc``
    (``DrafterConfig.fc_norm``; ``init_from`` a drafter without it: :func:`fc_norm_weights` starts it near that
    drafter's function)."""
    out: str
    features_dir: str
    vd: int = 8192
    ttt_length: int = 7
    steps: int = 1000
    lr: float = 3e-4
    warmup: int | None = None
    schedule: str = "cosine"
    max_len: int = 256
    intermediate: int | None = None
    seed: int = 0
    checkpoint_every: int = 100
    n_eval: int = 32
    max_samples: int | None = None
    stop_at: int | None = None
    command: str = ""
    progress: bool = True
    init_from: str | None = None
    batch_size: int = 1
    pack_len: int = 0
    init: str = "random"
    num_layers: int = 1
    argmax_weight: float = 0.0
    fc_norm: bool = False

    def check(self) -> None:
        """Raise ValueError naming the first out-of-range option (CLI names)."""
        if self.batch_size < 1:
            raise ValueError(f"--batch-size must be >= 1, got {self.batch_size}")
        if self.pack_len and self.pack_len < self.max_len:
            raise ValueError(f"--pack-len must be 0 (off) or >= --max-len {self.max_len}, got {self.pack_len}")
        if self.ttt_length < 1:
            raise ValueError(f"--ttt-length must be >= 1, got {self.ttt_length}")
        if self.init not in INITS:
            raise ValueError(f"--init must be one of {INITS}, got {self.init!r}")
        if self.num_layers < 1:
            raise ValueError(f"--num-layers must be >= 1, got {self.num_layers}")
        if not 0.0 <= self.argmax_weight <= 1.0:
            raise ValueError(f"--argmax-weight must be in [0, 1], got {self.argmax_weight}")
        if self.steps < 1 or self.checkpoint_every < 1:
            raise ValueError("--steps and --checkpoint-every must be >= 1")


def drafter_config(cfg, vd: int, intermediate: int | None = None, num_layers: int = 1,
                   fc_norm: bool = False) -> DrafterConfig:
    """Drafter config for teacher ``cfg``: H, heads, KV heads, head_dim and (default) FFN of the teacher,
    ``num_layers`` layers (EAGLE-3: one), RoPE theta 10000 (docs/design.md, "Drafter architecture"), aux layers = the
    teacher's capture layers."""
    return DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=intermediate or cfg.intermediate_size,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, draft_vocab_size=vd,
                         target_hidden_size=cfg.hidden_size, rms_norm_eps=cfg.rms_norm_eps,
                         aux_layers=tuple(cfg.aux_layers), num_hidden_layers=num_layers, fc_norm=fc_norm)


def fc_norm_weights(fs: FeatureSet, idx, ht: int) -> dict:
    """Starting ``fc_norm.{c}.weight`` [Ht] for a drafter trained without ``fc_norm``: every entry of chunk c =
    the median RMS of chunk c over the rows of samples ``idx``, each sample's first and last rows left out (the
    last is never fed: zeros where regeneration wrote the features; on SmolLM2-135M the first token's residual
    stream is 5x / 170x / 45x the median in the low / mid / high chunk, docs/training.md, "What moved acceptance"). Then
    rmsnorm_c(x_c) * w_c = x_c * median / rms(x_c): the drafter starts as before on rows of median scale.
    Returns float32 arrays. Raises ValueError when the samples hold no row but their first and last."""
    rms = [[] for _ in range(3)]
    for i in idx:
        aux = np.asarray(fs[i]["aux"][1:-1], np.float32)     # the last row: zeros in regen-written features
        for c in range(3):
            x = aux[:, c * ht:(c + 1) * ht]
            rms[c].append(np.sqrt((x * x).mean(-1)))
    if not any(len(r) for r in rms[0]):
        raise ValueError("fc_norm_weights: the samples hold no feature row but their first and last")
    return {f"fc_norm.{c}.weight": np.full(ht, np.median(np.concatenate(rms[c])), np.float32) for c in range(3)}


def next_batch(fs: FeatureSet, cursor: int, lengths: np.ndarray, tc: "TrainConfig", t2d: np.ndarray,
               dist: DistContext | None = None):
    """The batch of the step that starts at stream position ``cursor``.

    Args:
        lengths: int [n_train] sample lengths truncated to max_len; tc: batch_size, pack_len, max_len,
        ttt_length, seed; dist: rank r and world W (default one process).
    Returns:
        (Batch of B rows x T tokens (T = pack_len or max_len), cursor after the step). One process: B =
        batch_size. W ranks (unpacked only): B = batch_size / W, the rows of stream positions cursor + rB ..
        cursor + (r+1)B - 1 (``distributed.local_positions``); the cursor after the step is cursor + batch_size
        on every rank.
    Raises:
        DistError: W > 1 with packing or a batch_size that W does not divide.
    """
    n, B, T = len(lengths), tc.batch_size, tc.pack_len or tc.max_len
    if dist is not None and dist.world > 1:
        check_batch(B, dist.world, tc.pack_len)
        idx = [stream_sample(int(p), n, tc.seed) for p in local_positions(cursor, B, dist.rank, dist.world)]
        rows = plan_rows([int(lengths[i]) for i in idx], T, len(idx), False)
        end = cursor + B
    else:
        look = B if not tc.pack_len else B * (T // max(1, int(lengths.min())) + 1)  # more than B rows can hold
        idx = [stream_sample(cursor + j, n, tc.seed) for j in range(look)]
        rows = plan_rows([int(lengths[i]) for i in idx], T, B, bool(tc.pack_len))
        end = cursor + sum(len(r) for r in rows)

    def arrays(i):
        d = fs[i]
        return sample_arrays(d["input_ids"], d["loss_mask"], d["aux"], d["hidden"], d["argmax"], t2d,
                             tc.max_len, tc.ttt_length)
    batch = assemble([[arrays(idx[j]) for j in row] for row in rows], T, tc.ttt_length)
    return batch, end


def initial_tensors(dcfg: DrafterConfig, seed: int, used: np.ndarray, init: str, cfg, tensors: dict) -> dict:
    """Starting drafter tensors (SpecForge keys).

    "random": ``init_drafter_tensors`` (normal std 0.02, norms 1). "teacher": the same, then ``lm_head.weight``
    = the teacher's lm_head rows at the draft ids (the tied embedding for SmolLM2) and ``norm.weight`` = the
    teacher's final norm weight, so the drafter starts with the teacher's output head applied to its own hidden
    state (the drafter's output plays the role of the teacher's last hidden state;
    docs/design.md, "Drafter architecture").
    Raises:
        ValueError: unknown ``init`` or a drafter hidden size different from the teacher's.
    """
    if init not in INITS:
        raise ValueError(f"--init must be one of {INITS}, got {init!r}")
    t = init_drafter_tensors(dcfg, seed, used)
    if init == "teacher":
        if dcfg.hidden_size != cfg.hidden_size:
            raise ValueError(f"--init teacher needs drafter hidden {dcfg.hidden_size} == teacher {cfg.hidden_size}")
        t["lm_head.weight"] = np.array(head_weight(cfg, tensors)[np.asarray(used)], np.float32)
        t["norm.weight"] = np.array(tensors["model.norm.weight"], np.float32)
    return t


def save_resume(path: str, net: TTTDrafter, ts: TrainStep, step: int, extra: dict) -> None:
    """Atomically write resume state (weights, optimiser moments, step, extra arrays) to ``path``."""
    arrays = {"w:" + k: v for k, v in net.export_tensors().items()}
    arrays.update({"o:" + k: v for k, v in ts.state().items()})
    arrays["step"] = np.array(step, np.int64)
    arrays.update(extra)
    tmp = path + ".tmp.npz"
    np.savez(tmp, **arrays)
    os.replace(tmp, path)


def export(out: str, dcfg: DrafterConfig, net: TTTDrafter, vocab) -> None:
    """SpecForge export (fp16) of the current weights with d2t / t2d."""
    tensors = net.export_tensors()
    tensors.update({"d2t": vocab["d2t"], "t2d": vocab["t2d"]})
    save_drafter(out, dcfg, tensors, dtype=np.float16)


def evaluate(net: TTTDrafter, fs: FeatureSet, idx: list, t2d: np.ndarray, max_len: int, S: int,
             fwd=None, ks=KS, dist: DistContext | None = None) -> dict:
    """Held-out per-step top-1 accuracy, top-k coverage with the implied L_k (coverage.py), and loss.

    One sample per row of the net's T tokens (forward only, ``net.eval_topk`` jitted once: pass the same
    ``fwd = ms.jit(net.eval_topk)`` on every call to avoid recompiling). Returns a dict with acc [S], loss
    (mean of the per-sample losses), samples, masked_tokens_step0 and coverage_report's cov / positions /
    L_implied. ``dist`` with W > 1 ranks (collective: every rank calls it with the same ``idx``): rank r scores
    idx[r::W] and the sums (hits, positions, losses) are all-reduced, so every rank returns the result over
    all of ``idx`` (counts exact below 2^24).
    """
    import mindspore as ms

    world = dist.world if dist is not None else 1
    mine = idx[dist.rank::world] if world > 1 else idx
    fwd = fwd or ms.jit(net.eval_topk)
    correct, masked, losses = np.zeros(S), np.zeros(S), []
    hits, counts = np.zeros((S, len(ks)), np.int64), np.zeros(S, np.int64)
    for i in mine:
        d = fs[i]
        b = assemble([[sample_arrays(d["input_ids"], d["loss_mask"], d["aux"], d["hidden"], d["argmax"], t2d,
                                     max_len, S)]], net.T, S)
        loss, _, c, top = fwd(*b.tensors())
        top = top.asnumpy()
        for s in range(S):
            h, n = coverage_counts(top[s], b.tgt[s], b.loss_mask[s], ks)
            hits[s] += h
            counts[s] += n
        correct += c.asnumpy()
        masked += b.loss_mask.sum((1, 2))
        losses.append(float(loss.asnumpy()))
    loss_sum = float(np.sum(losses))
    if world > 1:
        K = len(ks)
        v = dist.sum(np.concatenate([correct, masked, hits.ravel(), counts, [loss_sum]]))
        correct, masked = v[:S], v[S:2 * S]
        hits = np.round(v[2 * S:2 * S + S * K]).astype(np.int64).reshape(S, K)
        counts, loss_sum = np.round(v[2 * S + S * K:-1]).astype(np.int64), float(v[-1])
    out = {"acc": (correct / np.maximum(masked, 1)).round(4).tolist(), "loss": loss_sum / max(len(idx), 1),
           "samples": len(idx), "masked_tokens_step0": int(masked[0])}
    out.update(coverage_report(hits, counts, ks, depths=tuple(D for D in (1, 2, 3, S) if D <= S)))
    return out


def train(tc: TrainConfig, cfg, tensors: dict, resume: bool = False, dist: DistContext | None = None) -> dict:
    """Train (or resume) a drafter for teacher (``cfg``, HF-named ``tensors``) from ``tc.features_dir``.

    ``dist``: this process's rank and world size (``distributed.init_from_env``; default one process). Under
    msrun every rank runs this function on the same features and ``<out>`` (rank 0 alone writes there).
    Returns:
        the summary dict (also written to ``<out>/summary.json`` by rank 0).
    Raises:
        FileNotFoundError: no feature shards, or ``resume`` without ``<out>/resume/state.npz``.
        ValueError: fewer than 2 samples, an option out of range (TrainConfig.check), or --resume with a
            different --batch-size / --pack-len than the run it continues.
        DistError (a ValueError): W > 1 ranks with --pack-len, or a --batch-size that W does not divide.
        RuntimeError: the ranks' weights / draft vocabularies differ (start or checkpoint).
    """
    from tqdm import tqdm

    # set up: options, features, resume state, held-out split
    tc.check()
    dist = dist or DistContext()
    check_batch(tc.batch_size, dist.world, tc.pack_len)
    main = dist.is_main
    t_start = time.time()
    fs = FeatureSet(tc.features_dir)
    rpath = os.path.join(tc.out, "resume", "state.npz")
    state, feats = _load_state(rpath, resume, fs)
    n_total, n_eval, n_train = _sample_split(state, fs, tc)
    # draft vocabulary and drafter: from the resume state, --init-from or new
    used, init, icfg = _draft_vocab(tc, cfg, fs, state, n_train, main)
    from mindspore_eagle.models.eagle3 import vocab_maps

    vocab = vocab_maps(used, cfg.vocab_size)
    mass = _vocab_mass(fs, n_train, used, cfg.vocab_size)
    dcfg, init = _drafter_init(tc, cfg, fs, n_train, used, init, icfg, main)
    net, ts = _make_net(tc, cfg, tensors, dcfg, used, vocab, init, dist)
    start, cursor = _resume_weights(state, tc, net, ts, main)
    dist.check_same([p.asnumpy() for p in net.trainable()] + [np.asarray(used)],
                    "initial weights / draft vocabulary")
    run = _Run(tc, dist, fs, net, ts, dcfg, vocab, rpath, state, start, cursor, n_train, n_total, used, feats,
               tqdm)
    # loop of steps, with a checkpoint (export, resume state, held-out score) every checkpoint_every steps
    if run.held_idx and start == 0:              # the curve's origin: the initial (random or --init-from) weights
        run.score(0)
    with _TermFlag() as term:
        for step in range(start, run.stop):
            run.step(step)
            halt = term.agreed(dist)                    # SIGTERM: checkpoint this step and end the run
            if (step + 1) % tc.checkpoint_every == 0 or step + 1 == run.stop or halt:
                run.checkpoint(step + 1, halt)
                if halt:
                    if main:
                        print(f"[train] SIGTERM: stopped after step {step + 1}, state saved; continue with --resume",
                              flush=True)
                    run.stop, run.stopped_by = step + 1, "SIGTERM"
                    break
    # final export, held-out score and report
    summary = run.finish(n_eval, mass, t_start)
    if main:
        with open(os.path.join(tc.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        held = summary["heldout"]
        print(f"[done] train acc(last 100) {summary['train_acc_last100']}; held-out {held.get('acc')}; "
              f"coverage {held.get('cov')}; L_implied {held.get('L_implied')}", flush=True)
    return summary


def _load_state(rpath: str, resume: bool, fs: FeatureSet) -> tuple:
    """(the resume state at ``rpath`` as a dict of arrays, or None without ``resume``; the JSON naming the
    features: absolute directories and samples per directory). Raises FileNotFoundError (``resume`` without a
    state) or ValueError (the samples per features directory changed since the run started)."""
    state = None
    if resume:
        if not os.path.exists(rpath):
            raise FileNotFoundError(f"--resume: no resume state at {rpath}")
        state = dict(np.load(rpath))
    feats = json.dumps({"dirs": [os.path.abspath(d) for d in fs.dirs], "counts": fs.counts})
    if state is not None and "features" in state and json.loads(str(state["features"]))["counts"] != fs.counts:
        raise ValueError(f"--resume: the samples per features directory changed since the run started (was "
                         f"{state['features']}, now {feats}), which would shift the training stream and the held-out "
                         "set; start a new run (--init-from the last export) to train on the new set")
    return state, feats


def _sample_split(state: dict | None, fs: FeatureSet, tc: TrainConfig) -> tuple[int, int, int]:
    """(N samples used, held-out samples = the last min(n_eval, N // 4), training samples = the first ones).
    A resumed run keeps its N. Raises ValueError when N < 2."""
    n_total = int(state["n_samples"]) if state is not None else min(len(fs), tc.max_samples or len(fs))
    if n_total < 2:
        raise ValueError(f"need at least 2 samples with features, have {n_total}")
    n_eval = min(tc.n_eval, n_total // 4)
    return n_total, n_eval, n_total - n_eval


def _draft_vocab(tc: TrainConfig, cfg, fs: FeatureSet, state: dict | None, n_train: int, main: bool) -> tuple:
    """(draft vocabulary: teacher ids [Vd], the ``--init-from`` drafter's tensors, its DrafterConfig), the last
    two None unless the run starts ``--init-from``. The ids come from the resume state (whose layer count and
    fc_norm must match ``tc``), the ``--init-from`` drafter (its t2d), or ``build_vocab`` over the training
    samples' data and teacher-argmax tokens. Raises ValueError on a mismatch with ``tc``."""
    init, icfg = None, None
    if state is not None:
        used = state["vocab_used"]
        got = 1 + len({k.split(".")[1] for k in state if k.startswith("w:layers.")})
        if got != tc.num_layers:
            raise ValueError(f"--resume: the run was started with --num-layers {got}, not {tc.num_layers}")
        if ("w:fc_norm.0.weight" in state) != tc.fc_norm:
            raise ValueError(f"--resume: the run was started {'with' if not tc.fc_norm else 'without'} --fc-norm")
    elif tc.init_from:
        from mindspore_eagle.models.eagle3 import load_drafter

        icfg, init = load_drafter(tc.init_from)
        if icfg.draft_vocab_size != tc.vd:
            raise ValueError(f"--init-from {tc.init_from}: draft_vocab_size {icfg.draft_vocab_size} != --vd {tc.vd}")
        if icfg.num_hidden_layers > tc.num_layers:
            raise ValueError(f"--init-from {tc.init_from}: it has {icfg.num_hidden_layers} layers, more than "
                             f"--num-layers {tc.num_layers}")
        used = np.nonzero(init["t2d"])[0]
        if main:
            print(f"[init] weights and draft vocabulary from {tc.init_from}", flush=True)
    else:
        data_pairs = [(fs[i]["input_ids"], fs[i]["loss_mask"]) for i in range(n_train)]
        teach_pairs = [(fs[i]["argmax"][:-1], fs[i]["loss_mask"][1:]) for i in range(n_train)]
        dv = build_vocab(data_pairs, cfg.vocab_size, tc.vd, teach_pairs)
        used = dv.used
        if main:
            print(f"[vocab] {dv.report()}", flush=True)
    return used, init, icfg


def _vocab_mass(fs: FeatureSet, n_train: int, used: np.ndarray, vocab_size: int) -> tuple[float, float]:
    """Shares of the training samples' loss-masked tokens (data, teacher argmax) that are in the draft ids ``used``."""
    counts = np.zeros(vocab_size, np.int64)
    tcount = np.zeros(vocab_size, np.int64)
    for i in range(n_train):
        d = fs[i]
        np.add.at(counts, d["input_ids"][d["loss_mask"].astype(bool)], 1)
        np.add.at(tcount, d["argmax"][:-1][d["loss_mask"][1:].astype(bool)], 1)
    return float(counts[used].sum() / max(counts.sum(), 1)), float(tcount[used].sum() / max(tcount.sum(), 1))


def _drafter_init(tc: TrainConfig, cfg, fs: FeatureSet, n_train: int, used: np.ndarray, init: dict | None,
                  icfg: DrafterConfig | None, main: bool) -> tuple:
    """(DrafterConfig of the run, ``--init-from`` tensors completed for it: new layers as the identity, fc_norm
    weights from the training features when the drafter had none; None without ``--init-from``). Raises
    ValueError when the ``--init-from`` drafter has fc_norm and ``tc`` not."""
    dcfg = drafter_config(cfg, tc.vd, tc.intermediate, tc.num_layers, tc.fc_norm)
    if init is not None and dcfg.num_hidden_layers > icfg.num_hidden_layers:    # grow: new layers start as identity
        init = init_drafter_tensors(dcfg, tc.seed, used) | init
        if main:
            print(f"[init] layers {icfg.num_hidden_layers}..{dcfg.num_hidden_layers - 1} added (identity at start)",
                  flush=True)
    if init is not None and dcfg.fc_norm and not icfg.fc_norm:
        init = init | fc_norm_weights(fs, range(min(n_train, 64)), dcfg.target_hidden_size)
        if main:
            print("[init] fc_norm added: " + ", ".join(f"chunk {c} {init[f'fc_norm.{c}.weight'][0]:.3f}"
                                                       for c in range(3)), flush=True)
    if init is not None and icfg.fc_norm and not dcfg.fc_norm:
        raise ValueError(f"--init-from {tc.init_from} has fc_norm: train it with --fc-norm")
    return dcfg, init


def _make_net(tc: TrainConfig, cfg, tensors: dict, dcfg: DrafterConfig, used: np.ndarray, vocab: dict,
              init: dict | None, dist: DistContext) -> tuple[TTTDrafter, TrainStep]:
    """The TTT drafter (rows of R = pack_len or T tokens, S steps) with its starting weights (``init`` or
    :func:`initial_tensors`) and its optimiser step (gradients all-reduced over the ranks)."""
    T, S = tc.max_len, tc.ttt_length
    head = head_weight(cfg, tensors)
    R = tc.pack_len or T
    net = TTTDrafter(dcfg, tensors["model.embed_tokens.weight"], head[used], vocab["d2t"], R, S, max_len=T,
                     argmax_weight=tc.argmax_weight)
    net.load_tensors(init if init is not None else initial_tensors(dcfg, tc.seed, used, tc.init, cfg, tensors))
    ts = TrainStep(net, grad_reduce=dist.grad_reduce())
    return net, ts


def _resume_weights(state: dict | None, tc: TrainConfig, net: TTTDrafter, ts: TrainStep, main: bool) -> tuple:
    """(first step, stream cursor): (0, 0) for a new run; else the state's, with its weights and optimiser
    moments loaded into ``net`` / ``ts``. Raises ValueError when --batch-size / --pack-len differ from the
    state's."""
    start, cursor = 0, 0
    if state is not None:
        start = int(state["step"])
        cursor = int(state["cursor"]) if "cursor" in state else start     # states before batching: 1 per step
        for key, want in (("batch_size", tc.batch_size), ("pack_len", tc.pack_len)):
            got = int(state[key]) if key in state else (1 if key == "batch_size" else 0)
            if got != want:
                raise ValueError(f"--resume: the run was started with --{key.replace('_', '-')} {got}, not {want}")
        net.load_tensors({k[2:]: v for k, v in state.items() if k.startswith("w:")})
        ts.load_state({k[2:]: v for k, v in state.items() if k.startswith("o:")})
        if main:
            print(f"[resume] from step {start} (stream position {cursor})", flush=True)
    return start, cursor


class _Run:
    """The state of one :func:`train` call's loop: model, optimiser, stream cursor, log files, the last-100-step
    windows (correct [S], masked [S], loss) and this run's counters (real tokens, samples, seconds)."""

    def __init__(self, tc: TrainConfig, dist: DistContext, fs: FeatureSet, net: TTTDrafter, ts: TrainStep,
                 dcfg: DrafterConfig, vocab: dict, rpath: str, state: dict | None, start: int, cursor: int,
                 n_train: int, n_total: int, used: np.ndarray, feats: str, tqdm):
        self.tc, self.dist, self.main, self.fs, self.net, self.ts = tc, dist, dist.is_main, fs, net, ts
        self.dcfg, self.vocab, self.t2d, self.rpath = dcfg, vocab, vocab["t2d"], rpath
        self.T, self.S, self.start, self.cursor, self.n_train = tc.max_len, tc.ttt_length, start, cursor, n_train
        self.warmup = tc.warmup if tc.warmup is not None else max(1, int(0.03 * tc.steps))
        self.log_path, self.eval_path = os.path.join(tc.out, "train_log.jsonl"), os.path.join(tc.out, "eval_log.jsonl")
        if self.main:
            os.makedirs(os.path.join(tc.out, "resume"), exist_ok=True)
            _trim_log(self.log_path, start)                      # train_log "step" = 0-based step index
            _trim_log(self.eval_path, start + 1 if start else 0)  # eval_log "step" = steps done at the checkpoint
        self.extra = {"vocab_used": used, "n_samples": np.array(n_total), "batch_size": np.array(tc.batch_size),
                      "features": np.array(feats),
                      "pack_len": np.array(tc.pack_len),
                      "rng": np.array(json.dumps({"seed": tc.seed, "order": "permutation(seed, epoch)"}))}
        self.lengths = np.array([min(len(fs[i]["input_ids"]), self.T) for i in range(n_train)])
        self.tokens_before = 0
        if state is not None:        # states before tokens_seen was kept: the sum over the (trimmed) step log
            self.tokens_before = (int(state["tokens_seen"]) if "tokens_seen" in state
                                  else _logged_tokens(self.log_path))
        self.held_idx = list(range(n_train, n_total))
        self.fwd_eval = None
        self.bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step",
                        disable=not (tc.progress and self.main), mininterval=5)
        self.win_c, self.win_m, self.win_l = [], [], []
        self.tok_seen, self.samples_seen, self.t_loop, self.c_loop, self.history = (
            0, 0, time.time(), time.process_time(), [])
        self.eval_s, self.first, self.held, self.held_step = 0.0, (0.0, 0, 0), {}, None
        self.stop = tc.steps if tc.stop_at is None else min(tc.steps, tc.stop_at)
        self.stopped_by = None

    def score(self, done: int) -> None:
        """Score the held-out samples after ``done`` steps (every rank) and log the line (rank 0)."""
        import mindspore as ms

        t0 = time.time()
        self.fwd_eval = self.fwd_eval or ms.jit(self.net.eval_topk)     # compiled once, reused by every checkpoint
        self.held = evaluate(self.net, self.fs, self.held_idx, self.t2d, self.T, self.S, self.fwd_eval,
                             dist=self.dist)
        self.held_step = done
        self.eval_s += time.time() - t0
        if self.main:
            _append(self.eval_path, {"step": done, "tokens_seen": self.tokens_before + self.tok_seen, **self.held})

    def step(self, step: int) -> None:
        """One optimiser step on the next batch of the stream: log line (rank 0), windows, counters, progress bar."""
        tc, t0 = self.tc, time.time()
        b, self.cursor = next_batch(self.fs, self.cursor, self.lengths, tc, self.t2d, self.dist)
        lr = lr_at(step, tc.lr, self.warmup, tc.steps, tc.schedule)
        loss, losses, correct = self.ts(b, lr)
        loss, losses, correct, masked, n_samples, n_valid = reduce_step_stats(  # global batch (W > 1)
            self.dist, loss, losses, correct, b.loss_mask.sum((1, 2)), b.n_samples, b.n_valid)
        if step == self.start:                                              # includes compiling the step
            self.first = (time.time() - t0, n_valid, n_samples)
        rec = {"step": step, "lr": lr, "loss": loss, "losses": np.round(losses, 5).tolist(),
               "correct": correct.tolist(), "masked": masked.tolist(), "samples": n_samples,
               "tokens": n_valid, "cursor": self.cursor, "elapsed_s": round(time.time() - self.t_loop, 3),
               "cpu_s": round(time.process_time() - self.c_loop, 3)}
        self.history.append(loss)
        if self.main:
            _append(self.log_path, rec)
        self.win_c, self.win_m = (self.win_c + [correct])[-100:], (self.win_m + [masked])[-100:]
        self.win_l = (self.win_l + [loss])[-100:]
        self.tok_seen += n_valid
        self.samples_seen += n_samples
        acc = np.sum(self.win_c, 0) / np.maximum(np.sum(self.win_m, 0), 1)
        self.bar.update(1)
        self.bar.set_postfix(loss=f"{np.mean(self.win_l):.3f}", acc0=f"{acc[0]:.3f}",
                             tok_s=f"{self.tok_seen / max(time.time() - self.t_loop - self.eval_s, 1e-9):.0f}",
                             refresh=False)

    def checkpoint(self, done: int, halt: bool) -> None:
        """After ``done`` steps: check the ranks agree, export + resume state (rank 0), and score the held-out
        samples unless the run is stopping (``halt``: a grace period is short)."""
        self.dist.check_same([p.asnumpy() for p in self.net.trainable()], f"weights after step {done}")
        if self.main:
            export(self.tc.out, self.dcfg, self.net, self.vocab)
            save_resume(self.rpath, self.net, self.ts, done, {
                **self.extra, "cursor": np.array(self.cursor, np.int64),
                "tokens_seen": np.array(self.tokens_before + self.tok_seen, np.int64)})
        if self.held_idx and not halt:
            self.score(done)

    def finish(self, n_eval: int, mass: tuple, t_start: float) -> dict:
        """Close the bar, export (rank 0), score the held-out samples unless the last checkpoint did (or SIGTERM
        stopped the run), and return the summary (``mass``: vocab mass of data / teacher argmax; ``t_start``:
        time.time() when :func:`train` began)."""
        tc, fs, n_train, R = self.tc, self.fs, self.n_train, self.tc.pack_len or self.T
        self.bar.close()
        if self.main:
            export(tc.out, self.dcfg, self.net, self.vocab)
        loop_s = time.time() - self.t_loop
        train_s, eval_s, tok_seen, first = loop_s - self.eval_s, self.eval_s, self.tok_seen, self.first
        n_steps = self.stop - self.start
        win_c, win_m, win_l = self.win_c, self.win_m, self.win_l
        acc_train = (np.sum(win_c, 0) / np.maximum(np.sum(win_m, 0), 1)).round(4).tolist() if win_c else []
        if self.held_idx and self.held_step != self.stop and self.stopped_by is None:
            self.held = evaluate(self.net, fs, self.held_idx, self.t2d, self.T, self.S, self.fwd_eval, dist=self.dist)
        return {
            "samples_train": n_train, "samples_eval": n_eval, "train_tokens": int(sum(len(fs[i]["input_ids"])
                                                                                      for i in range(n_train))),
            "vd": tc.vd, "vocab_mass_data": round(mass[0], 4), "vocab_mass_teacher_argmax": round(mass[1], 4),
            "ttt_length": self.S, "steps": tc.steps, "resumed_from": self.start, "max_len": self.T, "lr": tc.lr,
            "warmup": self.warmup, "schedule": tc.schedule, "argmax_weight": tc.argmax_weight, "fc_norm": tc.fc_norm,
            "batch_size": tc.batch_size, "pack_len": tc.pack_len, "row_len": R,
            "world_size": self.dist.world,
            "init": tc.init if not tc.init_from else "init_from", "drafter": self.dcfg.to_json(),
            "train_acc_last100": acc_train, "train_loss_last100": float(np.mean(win_l)) if win_l else None,
            "heldout": self.held, "train_seconds_this_run": round(train_s, 1),
            "eval_seconds_this_run": round(eval_s, 1),
            "wall_seconds_this_run": round(time.time() - t_start, 1),
            "steps_per_s": round(n_steps / max(train_s, 1e-9), 3),
            "tokens_per_s": round(tok_seen / max(train_s, 1e-9), 1),
            "throughput_after_first_step": _rates(n_steps - 1, tok_seen - first[1], self.samples_seen - first[2],
                                                  train_s - first[0], tc.batch_size * R),
            "first_step_seconds": round(first[0], 2), "stopped_by": self.stopped_by, "command": tc.command,
            "config": asdict(tc), "losses_this_run": [round(x, 5) for x in self.history],
        }


class _TermFlag:
    """SIGTERM as a request to stop at the next step boundary (a context manager; the previous handler is
    restored on exit). Outside the main thread no handler can be set and SIGTERM keeps its default action.
    ``agreed(dist)`` is True once any rank got the signal (one scalar all-reduce per step when W > 1, so all
    ranks stop after the same step and write the same state)."""

    def __init__(self):
        self.flag, self._old = False, None

    def __enter__(self) -> "_TermFlag":
        try:
            self._old = signal.signal(signal.SIGTERM, self._on_term)
        except ValueError:                                   # not the main thread
            self._old = None
        return self

    def _on_term(self, signum, frame) -> None:
        self.flag = True

    def agreed(self, dist: DistContext) -> bool:
        if dist.world == 1:
            return self.flag
        return bool(dist.sum(np.array([float(self.flag)], np.float32))[0] > 0)

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGTERM, self._old)


def _rates(steps: int, tokens: int, samples: int, seconds: float, row_tokens: int) -> dict:
    """Throughput of ``steps`` steps (the first step of a run, which compiles, excluded by the caller) taking
    ``seconds`` (batch building + optimiser step + logging + checkpoints, no held-out evaluation): steps/s,
    real tokens/s, samples/s, padded tokens/s (``row_tokens`` = B x T per step)."""
    if steps < 1 or seconds <= 0:
        return {}
    return {"steps": steps, "seconds": round(seconds, 1), "steps_per_s": round(steps / seconds, 3),
            "tokens_per_s": round(tokens / seconds, 1), "samples_per_s": round(samples / seconds, 3),
            "padded_tokens_per_s": round(steps * row_tokens / seconds, 1)}


def _logged_tokens(path: str) -> int:
    """Real tokens over the steps of a step log (train_log.jsonl; 0 when there is none)."""
    if not os.path.exists(path):
        return 0
    with open(path) as f:
        return int(sum(json.loads(ln)["tokens"] for ln in f if ln.strip()))


def _append(path: str, rec: dict) -> None:
    with open(path, "a") as f:
        f.write(json.dumps(rec) + "\n")


def _trim_log(path: str, start: int) -> None:
    """Keep the JSONL lines of ``path`` whose "step" is below ``start`` (the file is removed when start is 0)."""
    if not os.path.exists(path):
        return
    if start == 0:
        os.remove(path)
        return
    with open(path) as f:
        keep = [ln for ln in f if json.loads(ln)["step"] < start]
    with open(path, "w") as f:
        f.writelines(keep)
