"""``mindspore-eagle bench``: the paper's evaluation reproduced (EAGLE-Pangu, Tables 1-3, Figures 1-7).

    python -m mindspore_eagle bench --config configs/default.yaml --turns 24 --out runs/t24
    python -m mindspore_eagle bench --turns 6 --sweep budget --budgets 8,16,32 --depths 2,4,6 --out runs/sweep
    python -m mindspore_eagle bench --turns 6 --sweep window --windows none,128,256,512 --out runs/window
(``python -m mindspore_eagle.bench ...`` is the same command.)

Evaluation set (evalsets.eval_turns): 240 turns = 80 MT-Bench questions x 2 turns (turn 2 asked after the teacher's
own turn-1 answer) + 80 HumanEval prompts. ``--turns N`` takes the first N turns of the fixed round-robin order
documented in ``evalsets.eval_turns`` (8 MT-Bench categories, then HumanEval, one item each per round; so
``--turns 18`` = the first question of each MT-Bench category with both turns + HumanEval/0 + writing/82 turn 1);
``--subset mtbench,humaneval,coding,...`` restricts the groups first.

Per turn: teacher-only greedy, then speculative decoding for each setting, same prompt, same process (see
throughput.py); outputs must be identical (the run stops with exit code 3 otherwise, after writing the report).
Outputs in the run folder (``--out DIR``; default ``runs/<date>_<config>_M.._D.._K.._t<turns>``):
    turns.jsonl   one record per finished turn (a restarted run with the same --out skips finished turns)
    run.json      the run's fixed parameters (a restart with different ones is refused)
    sessions.jsonl one line per invocation that timed turns (warm-up, machine, load average, wall time); an
                  invocation with nothing left to time only rewrites the report
    report.json   turns, M, D_max, top_k, identical_outputs, baseline_tok_s / ea_tok_s / speedup / accept_len
                  ({mean, p50, p90, p99, n}), figures, sweeps, paper numbers, machine
    report.md     the tables, beside the paper's numbers;   fig1..fig7 PNGs (Figures 4 / 6 with the sweeps)
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import shlex
import sys
import time

__all__ = ["cli_main", "build_parser"]


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindspore-eagle bench",
                                description="Paired teacher-only vs EAGLE-3 throughput benchmark, sweeps, figures.")
    p.add_argument("--config", default=None, help="YAML config (default: built-in defaults)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="config override, repeatable (e.g. --set speculative.M=32)")
    p.add_argument("--turns", type=int, default=None, help="number of turns (default: all 240)")
    p.add_argument("--subset", default=None,
                   help="comma-separated groups: mtbench, humaneval or MT-Bench categories (writing, coding, ...)")
    p.add_argument("--out", default=None, help="run folder (default runs/<date>_<config>...); reused to resume")
    p.add_argument("--sweep", choices=("none", "budget", "window", "policy", "all"), default="none",
                   help="also time the budget sweep (M, D_max, top_k), the drafter window study, and/or the policy "
                        "comparison (the config's budget under fixed and adaptive, beside the fixed CPU presets)")
    p.add_argument("--budgets", default="8,16,32,64,128", help="M values of the budget sweep (at the config D_max)")
    p.add_argument("--depths", default="2,4,6,8", help="D_max values of the budget sweep (at the config M)")
    p.add_argument("--top-ks", default="2,4,8", help="top_k values of the budget sweep ('' = none)")
    p.add_argument("--windows", default="none,128,256,512", help="drafter windows W (none = unlimited)")
    p.add_argument("--max-new-tokens", type=int, default=128, help="new tokens per turn (default 128)")
    p.add_argument("--warmup", choices=("full", "short", "none"), default="full",
                   help="compile before timing: full = every shape bucket + one short generation per engine; "
                        "short = one short generation per engine; none")
    p.add_argument("--attn-samples", type=int, default=4,
                   help="context-pass rows per turn sampled for the attention evidence (Figure 7); 0 = off")
    p.add_argument("--peer-llamacpp", action="store_true",
                   help="also time upstream llama.cpp's llama-server (pip install -e '.[peer]') on an F32 GGUF of the "
                        "teacher, one server process per --peer-variants entry with a clean environment, turn by "
                        "turn between ours")
    p.add_argument("--peer-variants", default=None, metavar="greedy,ngram-mod,eagle3:3",
                   help="llama-server variants of --peer-llamacpp: greedy, an n-gram --spec-type (ngram-mod, "
                        "ngram-map-k, ngram-map-k4v, ngram-simple, ngram-cache), eagle3[:N] (our drafter converted to "
                        "GGUF, --spec-draft-n-max N), '+' joins kinds (default "
                        "greedy,ngram-mod,eagle3:2,eagle3:3,eagle3:4)")
    p.add_argument("--allow-mismatch", action="store_true",
                   help="record output mismatches instead of stopping (identical_outputs becomes false)")
    p.add_argument("--no-progress", action="store_true", help="no tqdm progress bar")
    p.add_argument("--batch-sizes", default=None, metavar="1,4,16",
                   help="instead of the paired turns: total tok/s of --batch-prompts chat prompts at each max_batch "
                        "(continuous batching, teacher-only; speculative at 1), texts checked against batch 1")
    p.add_argument("--batch-prompts", type=int, default=64, help="prompts of --batch-sizes (default 64)")
    p.add_argument("--batch-offset", type=int, default=9000,
                   help="first ShareGPT conversation of --batch-sizes' prompts (evaluation prompts excluded)")
    return p


def _log(msg: str) -> None:
    print(f"[bench] {msg}", file=sys.stderr, flush=True)


def machine_info() -> dict:
    """CPU model and vector width (AVX-512 / AVX2, from /proc/cpuinfo's flags), core count, load average, MindSpore
    version (for report.md)."""
    model, flags = platform.processor() or "", set()
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name") and not flags:
                    model = line.split(":", 1)[1].strip()
                elif line.startswith("flags"):
                    flags = set(line.split(":", 1)[1].split())
                    break
    except OSError:
        pass
    vector = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else "no AVX2" if flags else "?"
    try:
        import mindspore

        msv = mindspore.__version__
    except Exception:  # pragma: no cover - mindspore is a dependency
        msv = "?"
    load = os.getloadavg() if hasattr(os, "getloadavg") else (float("nan"),) * 3
    cores = os.cpu_count() or 1
    return {"cpu": model, "vector": vector, "cores": cores, "loadavg_start": list(load),
            "python": platform.python_version(), "mindspore": msv, "platform": platform.platform(),
            "summary": f"{model} ({vector}), {cores} cores, MindSpore {msv}, Python {platform.python_version()}"}


def _threads(cfg) -> int:
    return cfg.context.threads or int(os.environ.get("MSEAGLE_THREADS", 0)) or min(os.cpu_count() or 1, 8)


def _inputs(args):
    """Config, subset, evaluation items and the sweep value lists from the parsed arguments.

    Returns (cfg, subset, items, (budgets, depths, top_ks, windows)). Raises ConfigError / ValueError (usage)."""
    from mindspore_eagle.bench import sweeps as sw
    from mindspore_eagle.config import ConfigError, load_config
    from mindspore_eagle.evalsets import eval_turns

    cfg = load_config(args.config, args.set)
    if args.max_new_tokens < 1:
        raise ConfigError(f"--max-new-tokens = {args.max_new_tokens} is out of range: must be >= 1")
    subset = [s.strip() for s in args.subset.split(",") if s.strip()] if args.subset else None
    items = eval_turns(args.turns, subset)
    if args.peer_variants is not None:
        from mindspore_eagle.bench.llama_server import parse_variants

        parse_variants(args.peer_variants)                   # a bad spec fails before any model is loaded
    budgets = sw.parse_int_list(args.budgets)
    depths = sw.parse_int_list(args.depths)
    top_ks = sw.parse_int_list(args.top_ks) if args.top_ks.strip() else ()
    windows = sw.parse_int_list(args.windows, allow_none=True)
    return cfg, subset, items, (budgets, depths, top_ks, windows)


def _sweep_settings(sp, sweep: str, budgets, depths, top_ks, windows):
    """The main setting, the distinct settings to time (main first) and the sweep rows of each study.

    Returns (main, settings, {"budget": rows, "window": rows, "policy": rows}); a study not asked for has []."""
    from mindspore_eagle.bench import sweeps as sw

    main = sw.main_setting(sp)
    points = {"budget": [], "window": [], "policy": []}
    if sweep in ("budget", "all"):
        points["budget"] = sw.budget_points(sp, budgets, depths, top_ks)
    if sweep in ("window", "all"):
        points["window"] = sw.window_points(sp, windows)
    if sweep in ("policy", "all"):
        points["policy"] = sw.policy_points(sp)
    settings, rows_all = sw.dedupe(main, points["budget"] + points["window"] + points["policy"])
    rows, at = {}, 0
    for k in ("budget", "window", "policy"):
        rows[k], at = rows_all[at:at + len(points[k])], at + len(points[k])
    return main, settings, rows


def _run_name(args, cfg, n_turns: int) -> str:
    """Default run name: <date>_<config stem>_M.._D.._K..[_W..]_t<turns>[_sweep-<study>]."""
    stem = os.path.splitext(os.path.basename(args.config))[0] if args.config else "defaults"
    sp = cfg.speculative
    return (f"{time.strftime('%Y%m%d-%H%M%S')}_{stem}_M{sp.M}_D{sp.D_max}_K{sp.top_k}"
            f"{'_W' + str(sp.window) if sp.window else ''}_t{n_turns}"
            f"{'' if args.sweep == 'none' else '_sweep-' + args.sweep}")


def _open_run(out: str, name: str, fixed: dict, cfg):
    """Write run.json in a new run folder, or check that an existing one holds the same fixed parameters.

    Returns the run's name (the stored one when resuming), or None (error printed) when the parameters differ."""
    run_json = os.path.join(out, "run.json")
    if os.path.exists(run_json):
        with open(run_json, encoding="utf-8") as f:
            prev = json.load(f)
        if prev.get("fixed") != fixed:
            diff = sorted(k for k in fixed if prev.get("fixed", {}).get(k) != fixed[k])
            print(f"error: {out} holds a run with different parameters ({', '.join(diff)}); use another --out",
                  file=sys.stderr)
            return None
        _log(f"resuming {out}")
        return prev.get("name", name)
    with open(run_json, "w", encoding="utf-8") as f:
        json.dump({"name": name, "fixed": fixed, "config": cfg.to_dict()}, f, indent=1)
    return name


def _command(argv) -> str:
    """The invocation as a shell command line (for report.md and sessions.jsonl)."""
    return "python -m mindspore_eagle bench " + " ".join(shlex.quote(a) for a in (argv if argv is not None
                                                                                 else sys.argv[1:]))


def _time_turns(args, cfg, gen, turns, todo, settings, out: str, jsonl: str) -> dict:
    """Load the models, build and warm the engines (and the llama.cpp peer), time the turns not yet in ``jsonl``
    and write policy.json. Returns {"warm", "peer_note", "failed" (mismatch message or None), "policy_state"}."""
    from mindspore_eagle.bench.throughput import EnginePool, OutputMismatchError, run_turns

    res = {"warm": {"mode": args.warmup, "seconds": 0.0, "compiles": 0}, "peer_note": None, "failed": None,
           "policy_state": None}
    if not todo:
        if args.peer_llamacpp:
            res["peer_note"] = "resumed run: no turns left to time"
        return res
    from mindspore_eagle.serving.pipeline import load_models

    _log(f"{len(todo)} of {len(turns)} turns to run, {len(settings)} speculative setting(s): "
         + ", ".join(f"{s.name}(M={s.M},D={s.D_max},K={s.top_k},W={s.window or 'none'})" for s in settings))
    t0 = time.perf_counter()
    loaded = load_models(cfg)
    pool = EnginePool(cfg, loaded, settings)
    _log(f"models loaded and engines built in {time.perf_counter() - t0:.1f} s")
    res["warm"].update(pool.warmup(gen, args.warmup, log=_log))
    peer = None
    if args.peer_llamacpp:
        from mindspore_eagle.bench.llama_server import make_peer

        peer = make_peer(cfg, loaded, out, _threads(cfg), args.peer_variants, log=_log)
        res["peer_note"] = (f"llama-server ({peer.version}), one process per variant: "
                            + ", ".join(peer.variants)) if peer else "llama-server not found (or teacher not GGUF): skipped"
    try:
        run_turns(pool, turns, gen, settings, jsonl, args.attn_samples, peer, args.allow_mismatch,
                  progress=not args.no_progress)
    except OutputMismatchError as e:
        res["failed"] = str(e)
    finally:
        if peer is not None:
            peer.close()
    res["policy_state"] = pool.engine("main").policy.report()
    with open(os.path.join(out, "policy.json"), "w", encoding="utf-8") as f:
        json.dump(res["policy_state"], f, indent=1)
    return res


def _sessions(out: str, todo, command: str, t_start: float, warm: dict, machine: dict):
    """Append this invocation's line to sessions.jsonl when it timed turns, then read them all back.

    Returns (sessions, warm, machine): warm-up and machine summed / taken over the sessions that produced the
    records (not a later report-only invocation); unchanged when there are none and turns were timed."""
    sessions_path = os.path.join(out, "sessions.jsonl")
    if todo:   # one line per invocation that timed turns: its warm-up, machine state, wall time
        with open(sessions_path, "a", encoding="utf-8") as f:
            f.write(json.dumps({"started": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(t_start)),
                                "command": command, "turns_timed": len(todo), "warmup": warm, "machine": machine,
                                "wall_s": time.time() - t_start}) + "\n")
    sessions = []
    if os.path.exists(sessions_path):
        with open(sessions_path, encoding="utf-8") as f:
            sessions = [json.loads(line) for line in f if line.strip()]
    if sessions:   # report the sessions that produced the records, not a later report-only invocation
        warm = {"mode": "+".join(dict.fromkeys(x["warmup"]["mode"] for x in sessions)),
                "seconds": sum(x["warmup"]["seconds"] for x in sessions),
                "compiles": sum(x["warmup"]["compiles"] for x in sessions)}
        machine = dict(sessions[0]["machine"], loadavg_end=sessions[-1]["machine"].get("loadavg_end"))
    elif not todo:
        warm = {"mode": "unknown (no sessions.jsonl)", "seconds": float("nan"), "compiles": "?"}
    return sessions, warm, machine


def _log_summary(rep: dict, policy_state, out: str) -> None:
    """The closing log lines: headline numbers, the adaptive policy's cost table, what was written."""
    from mindspore_eagle.core.costs import CostTable

    s, a = rep["speedup"], rep["accept_len"]
    _log(f"{rep['turns']} turns: baseline {rep['baseline_tok_s']['mean']:.2f} tok/s, EAGLE-3 "
         f"{rep['ea_tok_s']['mean']:.2f} tok/s, speedup mean {s['mean']:.3f}x p10 {s['p10']:.3f}x min "
         f"{s['min']:.3f}x p99 {s['p99']:.3f}x, L_k mean {a['mean']:.3f}, steps speculated "
         f"{rep['spec_share']['mean']:.2f}; identical outputs: {rep['identical_outputs']}")
    if policy_state and policy_state.get("costs"):
        _log("cost table (adaptive policy):\n" + CostTable(**policy_state["costs"]).describe())
    _log(f"wrote {os.path.join(out, 'report.json')}, report.md and {len(rep['run']['figure_files'])} figures")


def cli_main(argv=None) -> int:
    """Entry point of ``mindspore-eagle bench``; returns the exit code (0 ok, 2 usage/config error, 3 mismatch)."""
    from mindspore_eagle.bench import report as report_mod
    from mindspore_eagle.bench import sweeps as sw
    from mindspore_eagle.bench.throughput import read_records, turn_specs
    from mindspore_eagle.config import ConfigError

    args = build_parser().parse_args(argv)
    try:
        cfg, subset, items, lists = _inputs(args)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if cfg.generation.temperature != 0:
        _log("generation.temperature forced to 0: the benchmark is greedy (identical-output check)")
    gen = dataclasses.replace(cfg.generation, max_new_tokens=args.max_new_tokens, temperature=0.0)
    if args.batch_sizes:
        return _batch_sizes_main(args, cfg, gen, argv)
    turns = turn_specs(items)
    main, settings, rows = _sweep_settings(cfg.speculative, args.sweep, *lists)
    try:
        for s in settings:
            s.spec(cfg.speculative)
    except ConfigError as e:
        print(f"error: sweep setting invalid: {e}", file=sys.stderr)
        return 2

    name = _run_name(args, cfg, len(turns))
    out = args.out or os.path.join("runs", name)
    os.makedirs(out, exist_ok=True)
    fixed = {"turn_ids": [t.turn_id for t in turns], "settings": [s.to_dict() for s in settings],
             "max_new_tokens": gen.max_new_tokens, "teacher": cfg.model.teacher, "drafter": cfg.model.drafter,
             "cache": dataclasses.asdict(cfg.cache), "mode": cfg.exec_mode}
    if args.peer_llamacpp:                # a resumed run keeps the peers its turns were timed against
        fixed["peers"] = args.peer_variants or "default"
    name = _open_run(out, name, fixed, cfg)
    if name is None:
        return 2
    jsonl = os.path.join(out, "turns.jsonl")
    machine = machine_info()
    command = _command(argv)
    todo = [t for t in turns if t.turn_id not in read_records(jsonl)]
    t_start = time.time()
    timed = _time_turns(args, cfg, gen, turns, todo, settings, out, jsonl)
    records = [r for r in (read_records(jsonl).get(t.turn_id) for t in turns) if r is not None]
    machine["loadavg_end"] = list(os.getloadavg()) if hasattr(os, "getloadavg") else None
    machine["threads"] = _threads(cfg)
    sessions, warm, machine = _sessions(out, todo, command, t_start, timed["warm"], machine)
    policy_state = timed["policy_state"]
    if policy_state is None and os.path.exists(os.path.join(out, "policy.json")):
        with open(os.path.join(out, "policy.json"), encoding="utf-8") as f:
            policy_state = json.load(f)
    sweeps = {k: sw.summarize_points(records, rows[k], settings) for k in ("budget", "window", "policy") if rows[k]}
    meta = {"name": name, "main": main.to_dict(), "command": sessions[0]["command"] if sessions else command,
            "turns_requested": len(turns), "subset": subset, "max_new_tokens": gen.max_new_tokens,
            "teacher": cfg.model.teacher, "drafter": cfg.model.drafter, "mode": cfg.exec_mode, "machine": machine,
            "warmup": warm, "sessions": sessions, "settings": [s.to_dict() for s in settings], "sweeps": sweeps,
            "peer_llamacpp": timed["peer_note"], "wall_s": sum(x["wall_s"] for x in sessions) if sessions else
            time.time() - t_start, "finished": time.strftime("%Y-%m-%d %H:%M:%S"), "config": cfg.to_dict(),
            "policy_state": policy_state}
    rep = report_mod.build_report(records, meta)
    report_mod.write_all(rep, out)
    _log_summary(rep, policy_state, out)
    if timed["failed"]:
        print(f"error: OUTPUT MISMATCH: {timed['failed']}", file=sys.stderr)
        return 3
    return 0


def _batch_sizes_main(args, cfg, gen, argv) -> int:
    """``bench --batch-sizes``: bench/batching.py on ``--batch-prompts`` prompts; writes batching.json / .md."""
    from mindspore_eagle.bench import batching
    from mindspore_eagle.bench import sweeps as sw
    from mindspore_eagle.config import ConfigError
    from mindspore_eagle.serving.pipeline import build_engine, load_models, prepare

    try:
        sizes = sorted(set(sw.parse_int_list(args.batch_sizes)) | {1})
        if min(sizes) < 1 or max(sizes) > 256:
            raise ValueError(f"--batch-sizes must lie in [1, 256], got {args.batch_sizes}")
        if args.batch_prompts < 1:
            raise ValueError(f"--batch-prompts = {args.batch_prompts} is out of range: must be >= 1")
        prompts = batching.chat_prompts(args.batch_prompts, args.batch_offset)
    except (ConfigError, ValueError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    name = f"{time.strftime('%Y%m%d-%H%M%S')}_batching_{'-'.join(map(str, sizes))}_p{len(prompts)}"
    out = args.out or os.path.join("runs", name)
    from mindspore_eagle.serving.batch_job import batched_config

    bcfg = batched_config(dataclasses.replace(cfg, batch=dataclasses.replace(cfg.batch, max_batch=max(sizes),
                                                                             speculative=True)))
    engine = build_engine(bcfg, load_models(bcfg))
    if args.warmup != "none":
        prepare(engine, bcfg, gen, args.warmup, _log, graph_cache=bcfg.context.graph_cache)
    machine = machine_info()
    command = _command(argv)
    _log(f"{len(prompts)} prompts x {gen.max_new_tokens} new tokens at max_batch {', '.join(map(str, sizes))}")
    result = batching.run_batch_sizes(engine, prompts, sizes, gen, _log)
    meta = {"name": name, "command": command, "machine": machine["summary"], "loadavg_start":
            machine["loadavg_start"], "loadavg_end": list(os.getloadavg()), "prompts": len(prompts),
            "max_new_tokens": gen.max_new_tokens, "batch_offset": args.batch_offset, "config": cfg.to_dict()}
    batching.write_report(result, meta, out)
    _log(f"wrote {os.path.join(out, 'batching.md')}")
    return 0
