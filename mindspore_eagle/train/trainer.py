"""Drafter training loop: feature shards -> draft vocab -> TTT steps -> SpecForge export, with exact resume.

Legend: T = max_len, S = ttt_length, N = training samples, Vd = draft vocab, V = teacher vocab, H = hidden.

Layout of ``<out>`` (the drafter directory):
    config.json, model.safetensors   SpecForge / EAGLE-3 drafter (fp16 weights, d2t int64, t2d bool, no
                                     embedding; ``models.eagle3.save_drafter``), rewritten at every checkpoint
    train_log.jsonl                  one line per step: step, lr, loss, step losses [S], correct [S], masked [S],
                                     tokens, elapsed_s / cpu_s (wall / this process's CPU seconds since the loop began)
    summary.json                     final numbers (accuracies, wall time, data counts, vocab mass, command)
    resume/state.npz                 float32 weights, optimiser moments, step, vocab ids, sample count, RNG state

Sample order is a pure function of (seed, epoch) (a permutation per epoch), the learning rate a pure function
of the step (``ttt.lr_at``), so a resumed run repeats the uninterrupted loss curve. One optimiser step = one
sample padded to T (fixed shapes: the step compiles once); with ``batch_size`` G > 1 one step averages the
gradients of G consecutive positions of the sample order (accumulated, and split over msrun ranks by
``distributed.local_positions``; the logged loss is the mean over the G samples). The last ``n_eval`` samples
are held out and scored at the end (per-step top-1 accuracy, eagle3.md §4 "Accuracy metric").
"""
from __future__ import annotations

import json
import os
import time
from dataclasses import dataclass, asdict

import numpy as np

from ..models.eagle3 import DrafterConfig, init_drafter_tensors, save_drafter
from .features import FeatureSet, head_weight
from .distributed import DistContext, check_batch, data_parallel_step, local_positions
from .ttt import TTTDrafter, TrainStep, lr_at, make_batch
from .vocab import build_vocab


@dataclass
class TrainConfig:
    """Options of :func:`train` (CLI names in ``__main__``). ``warmup`` None = 3 % of steps; ``intermediate``
    None = the teacher's FFN width; ``n_eval`` held-out samples; ``max_samples`` caps the samples used;
    ``stop_at`` ends the loop early (as if killed there; the schedule still spans ``steps``); ``init_from`` a
    SpecForge drafter directory to fine-tune (its weights and its draft vocabulary; ``vd`` must match);
    ``batch_size`` G samples per optimiser step (the global batch over all msrun ranks, a multiple of them)."""
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


def drafter_config(cfg, vd: int, intermediate: int | None = None) -> DrafterConfig:
    """Drafter config for teacher ``cfg``: H, heads, KV heads, head_dim and (default) FFN of the teacher, one
    layer, RoPE theta 10000 (eagle3.md §1), aux layers = the teacher's capture layers."""
    return DrafterConfig(hidden_size=cfg.hidden_size, intermediate_size=intermediate or cfg.intermediate_size,
                         num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
                         head_dim=cfg.head_dim, vocab_size=cfg.vocab_size, draft_vocab_size=vd,
                         target_hidden_size=cfg.hidden_size, rms_norm_eps=cfg.rms_norm_eps,
                         aux_layers=tuple(cfg.aux_layers))


def sample_order(step: int, n: int, seed: int) -> int:
    """Index of the sample used at ``step``: permutation (seed, epoch) of range(n), position step % n."""
    epoch, i = divmod(step, n)
    return int(np.random.default_rng([seed, epoch]).permutation(n)[i])


def sample_batch(fs: FeatureSet, i: int, t2d: np.ndarray, T: int, S: int):
    d = fs[i]
    return make_batch(d["input_ids"], d["loss_mask"], d["aux"], d["hidden"], d["argmax"], t2d, T, S)


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


def evaluate(net: TTTDrafter, fs: FeatureSet, idx: list, t2d: np.ndarray, T: int, S: int) -> dict:
    """Held-out per-step accuracy and loss (forward only, one jitted graph)."""
    import mindspore as ms

    fwd = ms.jit(net.construct)
    correct, masked, losses = np.zeros(S), np.zeros(S), []
    for i in idx:
        b = sample_batch(fs, i, t2d, T, S)
        loss, _, c = fwd(*b.tensors())
        correct += c.asnumpy()
        masked += b.loss_mask.sum(1)
        losses.append(float(loss.asnumpy()))
    return {"acc": (correct / np.maximum(masked, 1)).round(4).tolist(), "loss": float(np.mean(losses)),
            "samples": len(idx), "masked_tokens_step0": int(masked[0])}


def train(tc: TrainConfig, cfg, tensors: dict, resume: bool = False, dist: DistContext | None = None) -> dict:
    """Train (or resume) a drafter for teacher (``cfg``, HF-named ``tensors``) from ``tc.features_dir``.

    ``dist``: this process's rank and world size (``distributed.init_from_env``; default one process). Every rank
    runs this function on the same features; rank 0 alone writes files.
    Returns:
        the summary dict (also written to ``<out>/summary.json`` by rank 0).
    Raises:
        FileNotFoundError: no feature shards, or ``resume`` without ``<out>/resume/state.npz``.
        ValueError: fewer than 2 samples; ``batch_size`` not a positive multiple of the world size, or unlike
            the resumed run's.
    """
    from tqdm import tqdm

    dist = dist or DistContext()
    check_batch(tc.batch_size, dist.world)
    main = dist.is_main

    t_start = time.time()
    T, S = tc.max_len, tc.ttt_length
    fs = FeatureSet(tc.features_dir)
    rpath = os.path.join(tc.out, "resume", "state.npz")
    state = None
    if resume:
        if not os.path.exists(rpath):
            raise FileNotFoundError(f"--resume: no resume state at {rpath}")
        state = dict(np.load(rpath))
        if int(state.get("batch_size", 1)) != tc.batch_size:
            raise ValueError(f"--batch-size {tc.batch_size} differs from the resumed run's "
                             f"{int(state.get('batch_size', 1))} (the sample order depends on it)")
    n_total = int(state["n_samples"]) if state is not None else min(len(fs), tc.max_samples or len(fs))
    if n_total < 2:
        raise ValueError(f"need at least 2 samples with features, have {n_total}")
    n_eval = min(tc.n_eval, n_total // 4)
    n_train = n_total - n_eval
    init = None
    if state is not None:
        used = state["vocab_used"]
    elif tc.init_from:
        from ..models.eagle3 import load_drafter

        icfg, init = load_drafter(tc.init_from)
        if icfg.draft_vocab_size != tc.vd:
            raise ValueError(f"--init-from {tc.init_from}: draft_vocab_size {icfg.draft_vocab_size} != --vd {tc.vd}")
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
    from ..models.eagle3 import vocab_maps

    vocab = vocab_maps(used, cfg.vocab_size)
    t2d = vocab["t2d"]
    counts = np.zeros(cfg.vocab_size, np.int64)
    tcount = np.zeros(cfg.vocab_size, np.int64)
    for i in range(n_train):
        d = fs[i]
        np.add.at(counts, d["input_ids"][d["loss_mask"].astype(bool)], 1)
        np.add.at(tcount, d["argmax"][:-1][d["loss_mask"][1:].astype(bool)], 1)
    mass = (float(counts[used].sum() / max(counts.sum(), 1)), float(tcount[used].sum() / max(tcount.sum(), 1)))

    dcfg = drafter_config(cfg, tc.vd, tc.intermediate)
    head = head_weight(cfg, tensors)
    net = TTTDrafter(dcfg, tensors["model.embed_tokens.weight"], head[used], vocab["d2t"], T, S)
    net.load_tensors(init if init is not None else init_drafter_tensors(dcfg, tc.seed, used))
    ts = TrainStep(net, grad_reducer=dist.grad_reducer())
    start = 0
    if state is not None:
        net.load_tensors({k[2:]: v for k, v in state.items() if k.startswith("w:")})
        ts.load_state({k[2:]: v for k, v in state.items() if k.startswith("o:")})
        start = int(state["step"])
        if main:
            print(f"[resume] from step {start}", flush=True)
    dist.check_same([p.asnumpy() for p in net.trainable()] + [used], "initial weights / draft vocabulary")
    warmup = tc.warmup if tc.warmup is not None else max(1, int(0.03 * tc.steps))
    os.makedirs(os.path.join(tc.out, "resume"), exist_ok=True)
    log_path = os.path.join(tc.out, "train_log.jsonl")
    if main and state is None and os.path.exists(log_path):
        os.remove(log_path)
    elif main and state is not None and os.path.exists(log_path):  # drop log lines past the resume point
        with open(log_path) as f:
            keep = [ln for ln in f if json.loads(ln)["step"] < start]
        with open(log_path, "w") as f:
            f.writelines(keep)
    extra = {"vocab_used": used, "n_samples": np.array(n_total),
             "rng": np.array(json.dumps({"seed": tc.seed, "order": "permutation(seed, epoch)"})),
             "batch_size": np.array(tc.batch_size)}
    bar = tqdm(total=tc.steps, initial=start, desc="train", unit="step", disable=not (tc.progress and main),
               mininterval=5)
    win_c, win_m, win_l = [], [], []
    tok_seen, t_loop, c_loop, history = 0, time.time(), time.process_time(), []
    stop = tc.steps if tc.stop_at is None else min(tc.steps, tc.stop_at)
    for step in range(start, stop):
        batches = [sample_batch(fs, sample_order(int(p), n_train, tc.seed), t2d, T, S)
                   for p in local_positions(step, tc.batch_size, dist.rank, dist.world)]
        lr = lr_at(step, tc.lr, warmup, tc.steps, tc.schedule)
        if tc.batch_size == 1:
            b = batches[0]
            loss, losses, correct = ts(b, lr)
            masked, tokens = b.loss_mask.sum(1), b.n_valid
        else:   # gradient mean over the global batch (accumulated here, all-reduced over ranks)
            r = data_parallel_step(ts, batches, lr, dist)
            loss, losses, correct, masked, tokens = r["loss"], r["losses"], r["correct"], r["masked"], r["tokens"]
        rec = {"step": step, "lr": lr, "loss": loss, "losses": np.round(losses, 5).tolist(),
               "correct": correct.tolist(), "masked": masked.tolist(), "tokens": tokens,
               "elapsed_s": round(time.time() - t_loop, 3), "cpu_s": round(time.process_time() - c_loop, 3)}
        history.append(loss)
        if main:
            with open(log_path, "a") as f:
                f.write(json.dumps(rec) + "\n")
        win_c, win_m, win_l = (win_c + [correct])[-100:], (win_m + [masked])[-100:], (win_l + [loss])[-100:]
        tok_seen += tokens
        acc = np.sum(win_c, 0) / np.maximum(np.sum(win_m, 0), 1)
        bar.update(1)
        bar.set_postfix(loss=f"{np.mean(win_l):.3f}", acc0=f"{acc[0]:.3f}",
                        tok_s=f"{tok_seen / (time.time() - t_loop):.0f}", refresh=False)
        if (step + 1) % tc.checkpoint_every == 0 or step + 1 == stop:
            dist.check_same([p.asnumpy() for p in net.trainable()], f"weights after step {step + 1}")
            if main:
                export(tc.out, dcfg, net, vocab)
                save_resume(rpath, net, ts, step + 1, extra)
    bar.close()
    if main:
        export(tc.out, dcfg, net, vocab)
    train_s = time.time() - t_loop
    acc_train = (np.sum(win_c, 0) / np.maximum(np.sum(win_m, 0), 1)).round(4).tolist() if win_c else []
    held = evaluate(net, fs, list(range(n_train, n_total)), t2d, T, S) if n_eval and main else {}
    summary = {
        "samples_train": n_train, "samples_eval": n_eval, "train_tokens": int(sum(len(fs[i]["input_ids"])
                                                                                  for i in range(n_train))),
        "vd": tc.vd, "vocab_mass_data": round(mass[0], 4), "vocab_mass_teacher_argmax": round(mass[1], 4),
        "ttt_length": S, "steps": tc.steps, "resumed_from": start, "max_len": T, "lr": tc.lr, "warmup": warmup,
        "schedule": tc.schedule, "drafter": dcfg.to_json(), "train_acc_last100": acc_train,
        "train_loss_last100": float(np.mean(win_l)) if win_l else None, "heldout": held,
        "train_seconds_this_run": round(train_s, 1), "wall_seconds_this_run": round(time.time() - t_start, 1),
        "steps_per_s": round((stop - start) / max(train_s, 1e-9), 3), "command": tc.command,
        "batch_size": tc.batch_size, "world_size": dist.world, "tokens_this_run": int(tok_seen),
        "tokens_per_s": round(tok_seen / max(train_s, 1e-9), 1),
        "config": asdict(tc), "losses_this_run": [round(x, 5) for x in history],
    }
    if main:
        with open(os.path.join(tc.out, "summary.json"), "w") as f:
            json.dump(summary, f, indent=1)
        print(f"[done] train acc(last 100) {acc_train}; held-out {held.get('acc')}", flush=True)
    return summary
