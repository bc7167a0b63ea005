"""Command line: --help everywhere, one-line errors (each row of docs/errors.md), streaming generate on the tiny
openPangu fixture, inspect, delegation to bench / train-drafter, and scripts/run_eagle.py on the real teacher.

Most tests call ``cli.main(argv)`` in-process (one MindSpore import for the module); a few run real processes to
check what a user sees (exit code, no traceback). The tiny teacher runs in eager mode (no graph compilation).
"""
from __future__ import annotations

import io
import json
import os
import re
import shutil
import subprocess
import sys
import types
from pathlib import Path

import numpy as np
import pytest
from error_rows import ERRORS_MD, ROOT, check_row

from mindspore_eagle import cli

ENV = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
TINY_FAST = ["--mode", "eager", "--max-new-tokens", "6", "--set", "speculative.policy=fixed"]


@pytest.fixture(autouse=True)
def _quiet_mindspore_log(monkeypatch):
    """cli.guarded() sets GLOG_v with setdefault; keep that from leaking into later tests' environment."""
    monkeypatch.setenv("GLOG_v", os.environ.get("GLOG_v", "3"))


# ------------------------------------------------------------------------------------------------ helpers --
def run_main(capsys, argv) -> tuple:
    """(exit code, stdout, stderr) of an in-process ``mindspore-eagle`` call."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:  # argparse --help / usage errors
        rc = e.code
    out, err = capsys.readouterr()
    return rc, out, err


def expect_error(capsys, argv, row: str) -> str:
    rc, out, err = run_main(capsys, argv)
    lines = err.strip().splitlines()
    assert rc == 2, err
    assert lines and "Traceback" not in err, err
    check_row(row, lines[-1])
    return lines[-1]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    from tiny_pangu import write_tiny_pangu

    return write_tiny_pangu(tmp_path_factory.mktemp("tiny_teacher"))


@pytest.fixture(scope="module")
def tiny_cfg(tiny):
    from mindspore_eagle.models.checkpoints import load_teacher

    return load_teacher(tiny)


def _drafter(tmp_path, tiny_cfg, name="drafter", **changes):
    from dataclasses import replace

    from mindspore_eagle.models.eagle3 import init_drafter_tensors, save_drafter
    from mindspore_eagle.serving.pipeline import random_drafter

    dcfg, _ = random_drafter(tiny_cfg[0])
    dcfg = replace(dcfg, **changes)
    path = tmp_path / name
    save_drafter(str(path), dcfg, init_drafter_tensors(dcfg, 0))
    return path


def _cfg_file(tmp_path, text):
    p = tmp_path / "c.yaml"
    p.write_text(text, encoding="utf-8")
    return str(p)


# ---------------------------------------------------------------------------------------------------- help --
@pytest.mark.parametrize("argv", [["--help"], ["generate", "--help"], ["batch", "--help"], ["inspect", "--help"],
                                  ["bench", "--help"], ["train-drafter", "--help"]])
def test_help(capsys, argv):
    try:
        rc, out, _ = run_main(capsys, argv)
    except SystemExit as e:          # delegated sub-commands exit from argparse
        rc, out = e.code, capsys.readouterr().out
    assert rc == 0 and out.startswith(f"usage: mindspore-eagle {argv[0] if len(argv) > 1 else ''}".rstrip())


def test_help_subprocess_and_module_entry():
    res = subprocess.run([sys.executable, "-m", "mindspore_eagle", "--help"], env=ENV, capture_output=True,
                         text=True, timeout=120)
    assert res.returncode == 0
    for cmd in ("generate", "batch", "inspect", "bench", "train-drafter"):
        assert cmd in res.stdout


@pytest.mark.skipif(shutil.which("mindspore-eagle") is None, reason="console script not installed (pip install -e .)")
def test_console_script():
    res = subprocess.run(["mindspore-eagle", "batch", "--help"], capture_output=True, text=True, timeout=120)
    assert res.returncode == 0 and "--resume" in res.stdout


def test_scripts_help():
    for script in ("run_eagle.py", "modelarts_boot.py"):
        res = subprocess.run([sys.executable, str(ROOT / "scripts" / script), "--help"], env=ENV,
                             capture_output=True, text=True, timeout=120)
        assert res.returncode == 0 and "usage:" in res.stdout, res.stderr
    res = subprocess.run(["bash", str(ROOT / "scripts" / "msrun_batch.sh"), "--help"], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 0 and "msrun" in res.stdout


def test_no_command_prints_help(capsys):
    rc, out, _ = run_main(capsys, [])
    assert rc == 2 and "COMMAND" in out


# ------------------------------------------------------------------------------------ errors (errors.md) --
def test_error_malformed_yaml(capsys, tmp_path):
    path = _cfg_file(tmp_path, "speculative:\n  M: [16\n  D_max: 5\n")
    expect_error(capsys, ["generate", "--config", path, "--prompt", "hi"], "malformed YAML")


def test_error_unknown_key(capsys, tmp_path):
    path = _cfg_file(tmp_path, "speculative:\n  budget: 8\n")
    expect_error(capsys, ["generate", "--config", path, "--prompt", "hi"], "unknown key")


def test_error_unknown_section(capsys, tmp_path):
    path = _cfg_file(tmp_path, "parallel:\n  data_parallel: 1\n")
    expect_error(capsys, ["batch", "--config", path, "--input", "x", "--output", "y"], "unknown section")


def test_error_bad_range(capsys):
    expect_error(capsys, ["generate", "--set", "speculative.M=1", "--prompt", "hi"], "bad range")


def test_error_wrong_type(capsys):
    expect_error(capsys, ["generate", "--set", "speculative.M=abc", "--prompt", "hi"], "wrong type")


def test_error_missing_checkpoint(capsys, tmp_path):
    msg = expect_error(capsys, ["generate", "--set", f"model.teacher={tmp_path}/nowhere", "--prompt", "hi"],
                       "missing checkpoint")
    assert str(tmp_path / "nowhere") in msg


def test_error_not_a_checkpoint_directory(capsys, tmp_path):
    (tmp_path / "a.gguf").write_bytes(b""), (tmp_path / "b.gguf").write_bytes(b"")
    for argv in (["generate", "--set", f"model.teacher={tmp_path}", "--prompt", "hi"], ["inspect", str(tmp_path)]):
        msg = expect_error(capsys, argv, "not a checkpoint directory")
        assert f"{tmp_path}: not a checkpoint directory (no config.json and 2 .gguf files" in msg


def test_error_drafter_hidden_size(capsys, tmp_path, tiny, tiny_cfg):
    bad = _drafter(tmp_path, tiny_cfg, hidden_size=32, num_attention_heads=2, num_key_value_heads=1, head_dim=16)
    msg = expect_error(capsys, ["generate", "--set", f"model.teacher={tiny}", "--set", f"model.drafter={bad}",
                                "--prompt", "hi"], "drafter whose hidden size does not fit the teacher")
    assert msg == "error: drafter hidden_size = 32 does not fit the teacher (needs 64)"


def test_error_drafter_vocabulary(capsys, tmp_path, tiny, tiny_cfg):
    v = tiny_cfg[0].vocab_size
    bad = _drafter(tmp_path, tiny_cfg, vocab_size=v + 100, draft_vocab_size=v + 100)
    msg = expect_error(capsys, ["batch", "--set", f"model.teacher={tiny}", "--set", f"model.drafter={bad}",
                                "--input", str(_one_record(tmp_path)), "--output", str(tmp_path / "o.jsonl"),
                                "--no-progress"], "drafter whose vocabulary does not fit the teacher")
    assert msg == f"error: drafter vocab_size = {v + 100} does not fit the teacher (needs {v})"


def _one_record(tmp_path) -> Path:
    p = tmp_path / "in.jsonl"
    p.write_text(json.dumps({"id": 1, "prompt": "What is the capital of France?"}) + "\n", encoding="utf-8")
    return p


def test_error_embedded_drafter_missing(capsys, tmp_path, tiny, monkeypatch):
    from mindspore_eagle.serving import pipeline

    monkeypatch.setattr(pipeline, "EMBEDDED_DRAFTER", str(tmp_path / "no_drafter"))
    expect_error(capsys, ["generate", "--set", f"model.teacher={tiny}", "--set", "model.drafter=embedded",
                          "--prompt", "hi"], "embedded drafter not installed")


def test_error_pickle_teacher(capsys, tmp_path, tiny):
    d = tmp_path / "pickled"
    d.mkdir()
    shutil.copy(tiny / "config.json", d / "config.json")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    msg = expect_error(capsys, ["generate", "--set", f"model.teacher={d}", "--prompt", "hi"],
                       "pickle teacher checkpoint")
    assert str(d / "pytorch_model.bin") in msg


def test_error_pickle_drafter(capsys, tmp_path, tiny, tiny_cfg):
    d = _drafter(tmp_path, tiny_cfg)
    os.remove(d / "model.safetensors")
    (d / "pytorch_model.bin").write_bytes(b"\x80\x04K\x01.")
    expect_error(capsys, ["generate", "--set", f"model.teacher={tiny}", "--set", f"model.drafter={d}",
                          "--prompt", "hi"], "pickle drafter checkpoint")


def test_error_prompt_longer_than_context(capsys, tiny):
    msg = expect_error(capsys, ["generate", "--set", f"model.teacher={tiny}", "--set", "model.drafter=random",
                                "--set", "cache.max_seq_len=64", "--set", "cache.num_blocks=4", *TINY_FAST,
                                "--prompt", "word " * 100], "prompt longer than the context (`generate`)")
    assert "+ generation.max_new_tokens=6 = " in msg and msg.endswith("cache.max_seq_len=64")


def test_error_run_eagle_train_mode():
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_eagle.py"), "--run_mode", "train",
                          "--predict_data", "hi"], env=ENV, capture_output=True, text=True, timeout=120)
    assert res.returncode == 2 and "Traceback" not in res.stderr
    check_row("`run_eagle.py --run_mode train`", res.stderr.strip().splitlines()[-1])


def test_error_is_one_line_in_a_real_process(tmp_path):
    """What a user sees: exit code 2, one stderr line, no traceback (MindSpore is imported on this path)."""
    res = subprocess.run([sys.executable, "-m", "mindspore_eagle", "generate", "--set",
                          f"model.teacher={tmp_path}/nowhere", "--prompt", "hi"], env=ENV, cwd=tmp_path,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 2 and res.stdout == ""
    assert res.stderr.strip() == f"error: {tmp_path}/nowhere: no such file or directory"


def test_every_documented_row_is_tested():
    """Each row of docs/errors.md's command-line table is named by a check_row call in the tests (test_cli,
    serving/test_batch_job), and each error code of its server table is asserted in serving/test_server.py or
    serving/test_api_server.py."""
    text = ERRORS_MD.read_text(encoding="utf-8")
    cli_part, _, server_part = text.partition("## The server")
    rows = [c.strip() for line in cli_part.splitlines()
            if line.startswith("| ") and not line.startswith("| Bad input")
            for c in [line.strip().strip("|").split(" | ")[0]]]
    sources = "".join(p.read_text(encoding="utf-8") for p in sorted(Path(__file__).parent.rglob("test_*.py")))
    missing = [r for r in rows if f'"{r}"' not in sources]
    assert rows and not missing, missing
    codes = [c for line in server_part.splitlines() if line.startswith("| ") and not line.startswith("| Status")
             for c in re.findall(r"`([a-z_]+)`", line.split(" | ")[1])]
    server_tests = "".join((Path(__file__).parent / "serving" / name).read_text(encoding="utf-8")
                           for name in ("test_server.py", "test_api_server.py"))
    untested = [c for c in codes if f'"{c}"' not in server_tests]
    assert len(codes) >= 12 and not untested, untested


# ------------------------------------------------------------------------------------------------ generate --
def test_generate_multi_turn_streams_and_summarises(capsys, tiny, tmp_path):
    trace = tmp_path / "trace.jsonl"
    argv = ["generate", "--set", f"model.teacher={tiny}", "--set", "model.drafter=random", *TINY_FAST,
            "--prompt", "What is the capital of France?", "--prompt", "And of Italy?"]
    rc, out, err = run_main(capsys, argv + ["--trace", str(trace), "--stats"])
    assert rc == 0, err
    assert out.startswith("user: What is the capital of France?\nassistant: ")
    assert "\nuser: And of Italy?\nassistant: " in out
    summaries = re.findall(r"\[(\d+) new tokens, [\d.]+ tok/s, mean L_k ([\d.]+) over (\d+) steps, (\d+) compiles, "
                           r"eager, speculative, stop: (eos|length|stop)\]", err)
    assert len(summaries) == 2 and all(int(s[0]) >= 1 for s in summaries)
    assert "mean accept_len" in err  # --stats table
    kinds = [json.loads(line)["kind"] for line in trace.read_text().splitlines()]
    assert kinds.count("turn") == 2 and "step" in kinds

    rc, base_out, base_err = run_main(capsys, argv + ["--baseline"])
    assert rc == 0 and "teacher-only" in base_err
    base_summaries = re.findall(r"\[(\d+) new tokens, [\d.]+ tok/s, (\d+) compiles, eager, teacher-only, "
                                r"stop: (eos|length|stop)\]", base_err)
    assert len(base_summaries) == 2 and "L_k" not in base_err     # no "mean L_k 1.00 over 0 steps"
    assert base_out == out  # greedy speculative decoding is lossless: same streamed text as teacher-only


def test_generate_prints_logprobs_when_generation_logprobs_is_set(capsys, tiny):
    """generation.logprobs = 2: after the answer, a heading and one line per generated token (EOS left out): its
    log-probability, its text and its 2 most likely alternatives, the server's chat logprobs of the same turn."""
    from mindspore_eagle.serving.openai_protocol import chat_logprobs
    from mindspore_eagle.serving.pipeline import build_engine

    sets = ["--set", f"model.teacher={tiny}", "--baseline", *TINY_FAST, "--set", "generation.logprobs=2"]
    prompt = "What is the capital of France?"
    rc, out, err = run_main(capsys, ["generate", *sets, "--prompt", prompt])
    assert rc == 0, err
    cfg = cli.config_from_args(cli.build_parser().parse_args(["generate", *sets, "--prompt", prompt]))
    eng = build_engine(cfg)
    g = eng.generate(prompt, cfg.generation, speculative=False)
    entries = chat_logprobs(g.logprobs, eng.tokenizer, eng.eos)["content"]
    lines = cli.logprob_lines(g.logprobs, eng.tokenizer, eng.eos)
    assert out == g.text + "\n" + "\n".join(lines) + "\n"
    assert lines[0].startswith("logprobs: ") and len(lines) == 1 + len(entries) >= 2
    for line, e in zip(lines[1:], entries):
        assert line == (f"{e['logprob']:10.4f}  {json.dumps(e['token'], ensure_ascii=False)}  | " +
                        ", ".join(f"{json.dumps(a['token'], ensure_ascii=False)} {a['logprob']:.4f}"
                                  for a in e["top_logprobs"]))
        assert len(e["top_logprobs"]) == 2 and e["top_logprobs"][0]["logprob"] >= e["logprob"]
    rc, plain, _ = run_main(capsys, ["generate", *sets[:-2], "--prompt", prompt])
    assert rc == 0 and plain == g.text + "\n"                         # without the key: the answer alone


def test_suffix_without_a_drafter_generate_and_batch_equal_teacher_only(capsys, tiny, tmp_path):
    """``speculative.method: suffix`` needs no drafter: ``generate`` and ``batch`` speculate with copies of earlier
    text (the tiny teacher repeats itself, so some are accepted) and print teacher-only greedy output."""
    sets = ["--set", f"model.teacher={tiny}", "--set", "model.drafter=none", "--set", "speculative.method=suffix",
            "--mode", "eager", "--max-new-tokens", "40", "--set", "speculative.policy=fixed"]
    prompts = ["--prompt", "Tell me about the sea.", "--prompt", "Again, please."]
    rc, out, err = run_main(capsys, ["generate", *sets, *prompts])
    assert rc == 0, err
    lks = [float(x) for x in re.findall(r"mean L_k ([\d.]+) over \d+ steps[^,]*, \d+ compiles, eager, speculative", err)]
    assert len(lks) == 2 and max(lks) > 1.0, err
    rc, base, base_err = run_main(capsys, ["generate", *sets, *prompts, "--baseline"])
    assert rc == 0 and "teacher-only" in base_err and base == out

    inp = tmp_path / "in.jsonl"
    inp.write_text("".join(json.dumps({"id": i, "prompt": p}) + "\n"
                           for i, p in enumerate(["Tell me about the sea.", "Count to five.", "Hello"])))
    texts = {}
    for name, extra in (("spec", []), ("base", ["--baseline"])):
        rc, _, err = run_main(capsys, ["batch", "--input", str(inp), "--output", str(tmp_path / f"{name}.jsonl"),
                                       "--no-progress", "--max-batch", "2", "--set", "batch.speculative=true",
                                       *sets, *extra])
        assert rc == 0, err
        rows = [json.loads(line) for line in (tmp_path / f"{name}.jsonl").read_text().splitlines()]
        texts[name] = {r["id"]: (r["text"], r["mean_accept_len"]) for r in rows}
    assert {k: v[0] for k, v in texts["spec"].items()} == {k: v[0] for k, v in texts["base"].items()}
    assert len(texts["spec"]) == 3 and max(v[1] for v in texts["spec"].values()) > 1.0
    assert all(v[1] == 1.0 for v in texts["base"].values())              # --baseline drafts nothing

    from mindspore_eagle.serving.api_server import serve_config
    for extra, spec in (([], True), (["--baseline"], False)):
        args = cli.build_parser().parse_args(["serve", "--set", f"model.teacher={tiny}", "--set", "model.drafter=none",
                                              "--set", "speculative.method=suffix", *extra])
        assert serve_config(cli.config_from_args(args)).batch.speculative is spec


def test_generate_chat_from_stdin(capsys, tiny, monkeypatch):
    """--chat reads turns from stdin; a turn that overflows the context is reported and the session goes on."""
    long_turn = "word " * 100
    monkeypatch.setattr(sys, "stdin", io.StringIO(f"Hello there\n\n{long_turn}\n/reset\nWhat is 2 + 2?\n/exit\n"
                                                  "never asked\n"))
    rc, out, err = run_main(capsys, ["generate", "--chat", "--set", f"model.teacher={tiny}", "--baseline",
                                     "--set", "cache.max_seq_len=64", "--set", "cache.num_blocks=4", *TINY_FAST])
    assert rc == 0, err
    assert len(re.findall(r"new tokens", err)) == 2 and "never asked" not in out
    assert re.search(r"error: prompt of \d+ tokens .* exceeds cache.max_seq_len=64 \(/reset starts a new "
                     r"conversation\)", err)


def test_generate_needs_a_prompt(capsys):
    rc, _, err = run_main(capsys, ["generate"])
    assert rc == 2 and err.strip() == "error: generate needs --prompt TEXT (repeatable for a multi-turn chat) or --chat"


def test_streamer_holds_back_stop_strings(tiny_cfg):
    _, _, tok = tiny_cfg
    text = "The capital of France is Paris. Speculative decoding drafts several tokens."
    ids = tok.encode(text, add_bos=False)
    full = tok.decode(ids)
    for stop in (["Paris"], ["decoding", "capital of X"], []):
        buf = io.StringIO()
        s = cli.Streamer(tok, eos_ids=[], stop=stop, out=buf)
        for i in ids:
            s(i)
        cut = min([full.index(x) for x in stop if x in full], default=len(full))
        assert buf.getvalue() == full[:cut]  # everything before the stop string, never the stop string
        s.finish(full[:cut])
        assert buf.getvalue() == full[:cut] + "\n"


def test_streamer_skips_eos(tiny_cfg):
    _, _, tok = tiny_cfg
    ids = tok.encode("Paris is nice.", add_bos=False)
    buf = io.StringIO()
    s = cli.Streamer(tok, eos_ids=[99999], stop=[], out=buf)
    for i in ids + [99999]:
        s(i)
    s.finish(tok.decode(ids))
    assert buf.getvalue() == tok.decode(ids) + "\n"


def test_progress_line_mid_answer_gets_its_own_line_on_a_shared_terminal(tiny_cfg):
    _, _, tok = tiny_cfg
    ids = tok.encode("The capital of France is Paris.", add_bos=False)
    buf = io.StringIO()
    s = cli.Streamer(tok, eos_ids=[], stop=[], out=buf)
    assert s.break_line() == ""                     # nothing printed yet: the cursor is at a line start
    s.write("user: Hi\nassistant: ")
    logged = []
    shared = cli.line_breaking_log(lambda: s, True, logged.append)
    apart = cli.line_breaking_log(lambda: s, False, logged.append)
    shared("compiled graph 1: a")                   # right after the chat label: mid-line
    shared("compiled graph 2: b")                   # the first progress line already ended the line
    for i in ids[:3]:
        s(i)
    apart("compiled graph 3: c")                    # stdout and stderr apart: passed through unchanged
    shared("compiled graph 4: d")                   # mid-answer
    for i in ids[3:]:
        s(i)
    s.finish(tok.decode(ids))
    shared("compiled graph 5: e")                   # after the answer's newline
    cli.line_breaking_log(lambda: None, True, logged.append)("warm-up: f")   # before any answer
    assert logged == ["\ncompiled graph 1: a", "compiled graph 2: b", "compiled graph 3: c",
                      "\ncompiled graph 4: d", "compiled graph 5: e", "warm-up: f"]
    assert buf.getvalue() == "user: Hi\nassistant: " + tok.decode(ids) + "\n"   # stdout's text is unchanged


# ------------------------------------------------------------------------------------------------- inspect --
def test_inspect_teacher_dir(capsys, tiny):
    rc, out, err = run_main(capsys, ["inspect", str(tiny)])
    assert rc == 0, err
    assert "teacher:" in out and "pangu decoder, 4 layers, hidden 64" in out
    assert "compatible drafters: EAGLE-3 with hidden_size = target_hidden_size = 64, vocab_size = 400" in out
    assert "chat template yes" in out
    assert ("model.drafter: embedded gives: no drafter (drafter hidden_size = 576 does not fit the teacher (needs "
            "64)): copies of earlier text alone (speculative.method=suffix)") in out


def test_chat_template_flag_sets_the_key_and_a_bad_path_is_one_line(capsys, tmp_path):
    from mindspore_eagle.cli import build_parser, config_from_args

    f = tmp_path / "t.jinja"
    f.write_text("{% for m in messages %}{{ m['content'] }}{% endfor %}", encoding="utf-8")
    args = build_parser().parse_args(["generate", "--chat-template", str(f), "--prompt", "hi"])
    assert config_from_args(args).model.chat_template == str(f)
    msg = expect_error(capsys, ["generate", "--chat-template", str(tmp_path / "missing.jinja"), "--set",
                                "model.drafter=none", "--prompt", "hi"], "chat template file missing")
    assert str(tmp_path / "missing.jinja") in msg


def test_generate_on_a_teacher_without_a_fitting_drafter_answers_with_a_notice(capsys, tiny):
    """The default config (model.drafter: embedded) with another teacher: one notice line, then the answer."""
    rc, out, err = run_main(capsys, ["generate", "--set", f"model.teacher={tiny}", "--set",
                                     "generation.max_new_tokens=8", "--prompt", "hi"])
    assert rc == 0, err
    notes = [line for line in err.splitlines() if line.startswith("notice:")]
    assert len(notes) == 1 and "no shipped drafter fits teacher" in notes[0] and "Traceback" not in err
    assert out.strip()


def test_inspect_drafter_and_fit(capsys, tmp_path, tiny, tiny_cfg):
    d = _drafter(tmp_path, tiny_cfg)
    rc, out, err = run_main(capsys, ["inspect", str(d), "--teacher", str(tiny)])
    assert rc == 0, err
    assert "drafter:" in out and "1 decoder layer, hidden 64" in out and "fits teacher" in out
    assert "fc_norm" not in out
    two = _drafter(tmp_path, tiny_cfg, "two", num_hidden_layers=2, fc_norm=True)
    rc, out, err = run_main(capsys, ["inspect", str(two)])
    assert rc == 0 and "2 decoder layers, hidden 64" in out and "each chunk RMS-normed first (fc_norm)" in out
    bad = _drafter(tmp_path, tiny_cfg, "bad", hidden_size=32, num_attention_heads=2, num_key_value_heads=1,
                   head_dim=16)
    rc, out, err = run_main(capsys, ["inspect", str(bad), "--teacher", str(tiny)])
    assert rc == 2 and err.strip() == "error: drafter hidden_size = 32 does not fit the teacher (needs 64)"


def pipeline_embedded() -> str:
    from mindspore_eagle.serving.pipeline import EMBEDDED_DRAFTER

    return EMBEDDED_DRAFTER


@pytest.mark.slow
def test_inspect_embedded_gguf(capsys):
    rc, out, err = run_main(capsys, ["inspect", "embedded"])
    assert rc == 0, err
    assert "GGUF (llama" in out and "30 layers, hidden 576" in out and "vocab 49152" in out
    assert "model.drafter: embedded gives: " + pipeline_embedded() in out


# -------------------------------------------------------------------------------------------- delegation --
def test_bench_and_train_are_delegated(capsys, monkeypatch):
    seen = {}
    fake_bench = types.ModuleType("mindspore_eagle.bench")
    fake_bench.cli_main = lambda argv: seen.setdefault("bench", argv) and 3
    fake_train = types.ModuleType("mindspore_eagle.train.__main__")
    fake_train.main = lambda argv: seen.setdefault("train", argv) and 0
    monkeypatch.setitem(sys.modules, "mindspore_eagle.bench", fake_bench)
    monkeypatch.setitem(sys.modules, "mindspore_eagle.train.__main__", fake_train)
    assert cli.main(["bench", "--help", "--x"]) == 3
    assert cli.main(["train-drafter", "--steps", "2"]) == 0
    assert seen == {"bench": ["--help", "--x"], "train": ["--steps", "2"]}


def test_missing_delegate_is_an_error(capsys, monkeypatch):
    monkeypatch.setitem(sys.modules, "mindspore_eagle.bench", None)
    rc, _, err = run_main(capsys, ["bench"])
    assert rc == 2 and err.strip().startswith("error: 'bench' is not available")


# ------------------------------------------------------------------------------------ MindFormers entry --
@pytest.mark.slow
def test_run_eagle_answers_paris(tmp_path):
    """The MindFormers-style command of the issue, on the real embedded teacher (+ drafter once shipped)."""
    from mindspore_eagle.serving.pipeline import EMBEDDED_DRAFTER

    drafter = "embedded" if os.path.isdir(EMBEDDED_DRAFTER) else "none"
    res = subprocess.run([sys.executable, str(ROOT / "scripts" / "run_eagle.py"), "--config",
                          str(ROOT / "configs" / "default.yaml"), "--run_mode", "predict", "--predict_data",
                          "What is the capital of France?", "--set", f"model.drafter={drafter}",
                          "--set", "generation.max_new_tokens=16", "--use_parallel", "False",
                          "--output_dir", "results/run1"],
                         cwd=tmp_path, env=ENV, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-2000:]
    assert "Paris" in res.stdout
    assert sorted(os.listdir(tmp_path)) == ["results"]            # nothing left in the working directory
    assert sorted(os.listdir(tmp_path / "results" / "run1")) == ["text_generation_result.jsonl",
                                                                  "text_generation_result.txt"]
    lines = (tmp_path / "results" / "run1" / "text_generation_result.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 1 and lines[0].startswith("{'text_generation_text': [") and "Paris" in lines[0]


def test_run_eagle_predict_data_file(tmp_path):
    """--predict_data FILE.txt: one prompt per line (records built without a model)."""
    sys.path.insert(0, str(ROOT / "scripts"))
    try:
        import run_eagle
    finally:
        sys.path.remove(str(ROOT / "scripts"))
    p = tmp_path / "prompts.txt"
    p.write_text("first question\n\nsecond question\n", encoding="utf-8")
    recs = run_eagle.build_records([str(p)])
    assert [(r.id, r.payload) for r in recs] == [(0, "first question"), (1, "second question")]
    assert [r.payload for r in run_eagle.build_records(["a b", "c"])] == ["a b", "c"]
    assert np.array_equal([r.index for r in recs], [0, 1])
