"""The OpenAI-compatible server (serving/api_server.py) started and stopped within one test: the fast smoke test
(start, chat, stream, SIGTERM), a suffix-only configuration's speculation and metrics, the drain timeout on SIGTERM,
``scripts/modelarts_boot.py --serve``'s address and ranks, and one slow test on the embedded default (SmolLM2-135M +
its drafter). The tiny openPangu teacher otherwise; the helpers: tests/tiny_engines.py, the ``reference`` fixture:
conftest.py."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import pytest
from tiny_engines import GOOD, ServerProcess, chat, chat_stream, metric, tiny_overrides, wait_for
from tiny_engines import SERVER_PROMPTS as PROMPTS

from mindspore_eagle.config import load_config

ROOT = Path(__file__).resolve().parents[2]


def test_smoke_one_server_process_start_chat_stream_sigterm(tiny_dir, reference):
    """The fast smoke test (not slow): a suffix-only speculative tiny server starts, /health turns 200, one greedy
    chat equals teacher-only decoding, one stream gives the same text, and SIGTERM ends it with exit status 0."""
    p = ServerProcess(tiny_overrides(tiny_dir) + ["speculative.method=suffix"], ["--max-batch", "2"])
    try:
        p.ready(120)
        c = p.client()
        want = reference(PROMPTS[0])
        assert chat(c, PROMPTS[0]).choices[0].message.content == want.text
        assert chat_stream(c, PROMPTS[0])[0] == want.text
    finally:
        p.stop()
    assert p.proc.returncode == 0, p.log()


def test_a_suffix_only_server_speculates_and_counts_acceptance_per_depth(tiny_dir):
    """``speculative.method: suffix`` needs no drafter: the server's batch drafts suffix candidates and its metrics
    count acceptance at every depth up to D_max (before, no drafter meant teacher-only and depth 0)."""
    from mindspore_eagle.serving.api_server import Server, serve_config

    cfg = serve_config(load_config(None, tiny_overrides(tiny_dir) + ["speculative.method=suffix",
                                                                     "speculative.D_max=4"]))
    assert cfg.batch.speculative and cfg.model.drafter == "none"
    server = Server(cfg, build=lambda: None, log_line=lambda line: None)
    assert server.metrics.max_depth == 4
    plain = serve_config(load_config(None, tiny_overrides(tiny_dir) + ["speculative.method=eagle3"]))
    assert not plain.batch.speculative and Server(plain, build=lambda: None).metrics.max_depth == 0
    off = serve_config(load_config(None, tiny_overrides(tiny_dir) + ["speculative.method=suffix",
                                                                   "serve.speculative=false"]))
    assert not off.batch.speculative


@pytest.mark.slow
def test_drain_timeout_cancels_what_is_left_and_exits_0(tiny_dir):
    """``serve.drain_timeout_s`` 1: a request that needs longer than that is cut at the timeout (the client's
    stream ends without its last chunk), the engine cancels it and the process exits 0 well before the request
    could have finished."""
    p = ServerProcess(tiny_overrides(tiny_dir) + ["serve.drain_timeout_s=1", "cache.max_seq_len=2048",
                                                  "cache.num_blocks=256", "generation.max_new_tokens=2000"],
                      ["--max-batch", "1"])
    p.ready(300)
    events, errors = [], []

    def stream():
        body = {**GOOD, "max_tokens": 2000, "stream": True}
        try:
            with httpx.stream("POST", p.url + "/v1/chat/completions", json=body, timeout=120) as r:
                events.extend(line[6:] for line in r.iter_lines() if line.startswith("data: "))
        except httpx.TransportError as e:
            errors.append(e)
    th = threading.Thread(target=stream)
    try:
        th.start()
        wait_for(lambda: len(events) >= 3, 60, "the stream to start")
        t0 = time.monotonic()
        p.proc.send_signal(signal.SIGTERM)
        assert p.proc.wait(60) == 0, p.log()
        waited = time.monotonic() - t0
        th.join(30)
    finally:
        p.stop()
    chunks = [json.loads(e) for e in events if e != "[DONE]"]
    assert chunks and not any(c["choices"][0]["finish_reason"] for c in chunks if c.get("choices"))   # cut short
    assert 1.0 <= waited < 30, waited                                    # the drain waited its second, no more
    assert any("draining in-flight ones for up to 1 s" in line for line in p.lines), p.log()


def test_modelarts_boot_serve_address_and_ranks(monkeypatch, capsys):
    """``scripts/modelarts_boot.py --serve``: 0.0.0.0:8080 unless MSEAGLE_HOST / MSEAGLE_PORT / PORT or the flags say
    otherwise; a bad port is one error line (exit 2); ranks other than 0 have nothing to serve (exit 0)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("modelarts_boot", ROOT / "scripts" / "modelarts_boot.py")
    boot = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(boot)
    for var in ("MSEAGLE_HOST", "MSEAGLE_PORT", "PORT", "RANK_ID", "RANK_SIZE", "MS_ROLE"):
        monkeypatch.delenv(var, raising=False)
    assert boot.serve_env(boot.parse_args(["--serve"])) == ("0.0.0.0", 8080)
    monkeypatch.setenv("PORT", "9000")
    assert boot.serve_env(boot.parse_args(["--serve"])) == ("0.0.0.0", 9000)
    monkeypatch.setenv("MSEAGLE_PORT", "9100")
    monkeypatch.setenv("MSEAGLE_HOST", "127.0.0.1")
    assert boot.serve_env(boot.parse_args(["--serve"])) == ("127.0.0.1", 9100)
    assert boot.serve_env(boot.parse_args(["--serve", "--port", "7000", "--host", "::1"])) == ("::1", 7000)
    monkeypatch.setenv("MSEAGLE_PORT", "http")
    assert boot.main(["--serve"]) == 2
    assert capsys.readouterr().err.strip().endswith("error: MSEAGLE_PORT / PORT must be an integer port, got 'http'")
    monkeypatch.setenv("RANK_ID", "1")
    monkeypatch.setenv("RANK_SIZE", "2")
    monkeypatch.setenv("MSEAGLE_PORT", "9100")
    assert boot.main(["--serve"]) == 0 and "rank 0 only" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        boot.parse_args([])                          # a batch job needs --input and --output


@pytest.mark.slow
def test_embedded_default_server_equals_generate(tmp_path):
    """configs/default.yaml (SmolLM2-135M-Instruct + its drafter), 2 rows: a chat's greedy text equals the CLI's
    ``generate`` (speculative, the same config), alone and beside a second client; trees were verified."""
    sets = ["cache.max_seq_len=512", "generation.max_new_tokens=32"]
    prompt = "What is the capital of France?"
    gen = subprocess.run([sys.executable, "-m", "mindspore_eagle", "generate", "--config", "configs/default.yaml",
                          "--prompt", prompt, *sum((["--set", s] for s in sets), [])], cwd=ROOT, capture_output=True,
                         text=True, timeout=900, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert gen.returncode == 0, gen.stderr[-2000:]
    want = gen.stdout[:-1]                       # generate prints the answer and a newline
    p = ServerProcess(sets, ["--config", "configs/default.yaml", "--max-batch", "2"])
    name = "SmolLM2-135M-Instruct"
    try:
        p.ready(1800)
        r = chat(p.client(), prompt, name, max_tokens=32)
        assert r.choices[0].message.content == want
        with ThreadPoolExecutor(2) as pool:
            both = list(pool.map(lambda q: chat_stream(p.client(), q, model=name, max_tokens=32)[0],
                                 [prompt, "Name three colours."]))
        assert both[0] == want
        m = p.metrics()
        assert metric(m, "mseagle_steps_total", kind="tree") > 0 and r.usage.mean_accept_len > 1.0
        ready = next(i for i, line in enumerate(p.lines) if line.startswith("ready in "))
        assert not any("compiled graph" in line for line in p.lines[ready:])      # nothing after the warm-up
        assert m[("mseagle_graphs_made_after_warmup", frozenset())] == 0
    finally:
        p.stop()
