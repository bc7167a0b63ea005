"""The upstream llama-server peer (mindspore_eagle.bench.llama_server): our drafter written as llama.cpp's eagle3
GGUF and read back, variant parsing, and the peer harness with a stand-in ``llama-server`` executable on PATH
(the real one is a 10-20 minute CMake build, not part of the test install): the peer process must not inherit our
environment, its tokens are compared with ours, and the report's peer rows come from what it answered."""
import json
import os
import stat
import sys

import numpy as np
import pytest

from mindspore_eagle.bench import llama_server as ls
from mindspore_eagle.bench import report as report_mod

from test_bench import GEN, MAIN, TURNS, FakeEngine, FakePool, _tokenizer_gguf  # noqa: E402

STAND_IN = r'''#!PYTHON
"""Stand-in llama-server: /health, /completion on token ids. Greedy answers 7 8 9 and EOS 1 (EOS not returned,
as llama-server); any --spec-type answers 7 8 4 (differs from greedy at the third token) with draft counts. It
writes its environment and arguments to <model>.<port>.json."""
import json, os, sys
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

args = sys.argv[1:]
opt = {args[i]: args[i + 1] for i in range(len(args) - 1) if args[i].startswith("-")}
if "--version" in args:
    print("version: 0 (stand-in)")
    sys.exit(0)
port, model = int(opt["--port"]), opt["-m"]
spec = opt.get("--spec-type")
with open(f"{model}.{port}.json", "w") as f:
    json.dump({"env": dict(os.environ), "args": args}, f)


class H(BaseHTTPRequestHandler):
    def log_message(self, *a):
        pass

    def _send(self, code, obj):
        body = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        self._send(200, {"status": "ok"}) if self.path == "/health" else self._send(404, {})

    def do_POST(self):
        req = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        assert req["temperature"] == 0 and req["cache_prompt"] is False and req["return_tokens"] is True
        out = ([7, 8, 4] if spec else [7, 8, 9])[: req["n_predict"]]
        n = len(out) + (1 if len(out) == 3 and req["n_predict"] > 3 else 0)     # the EOS is counted, not returned
        t = {"prompt_n": len(req["prompt"]), "prompt_ms": 10.0, "predicted_n": n, "predicted_ms": 5.0 * n}
        if spec:
            t.update(draft_n=4, draft_n_accepted=3)
        self._send(200, {"tokens": out, "timings": t})


ThreadingHTTPServer(("127.0.0.1", port), H).serve_forever()
'''


@pytest.fixture
def stand_in(tmp_path, monkeypatch):
    """A ``llama-server`` stand-in first on PATH; returns the folder it writes its records to."""
    bindir = tmp_path / "bin"
    bindir.mkdir()
    exe = bindir / "llama-server"
    exe.write_text(STAND_IN.replace("#!PYTHON", "#!" + sys.executable, 1))
    exe.chmod(exe.stat().st_mode | stat.S_IEXEC)
    monkeypatch.setenv("PATH", f"{bindir}{os.pathsep}{os.environ['PATH']}")
    return tmp_path


def _tiny_drafter():
    from mindspore_eagle.models.eagle3 import DrafterConfig, init_drafter_tensors

    dcfg = DrafterConfig(hidden_size=32, intermediate_size=48, num_attention_heads=4, num_key_value_heads=2,
                         head_dim=8, vocab_size=261, draft_vocab_size=64, target_hidden_size=32,
                         aux_layers=(1, 2, 3), rope_theta=1e4)
    used = np.sort(np.random.default_rng(3).choice(261, 64, replace=False))
    return dcfg, init_drafter_tensors(dcfg, seed=4, used_ids=used), used


def test_drafter_gguf_is_llama_cpps_eagle3_layout(tmp_path):
    """Every tensor read back equals ours (q / k rows in llama.cpp's RoPE order, matrices as float16), d2t holds
    absolute target ids, the eagle3 keys name the captured layers (inputs) and the teacher's width, and the
    teacher's tokenizer is copied."""
    from gguf import GGUFReader

    from mindspore_eagle.bench.peer import permute_qk

    dcfg, t, used = _tiny_drafter()
    path = ls.write_drafter_gguf(tmp_path / "d.gguf", dcfg, t, _tokenizer_gguf(tmp_path / "tok.gguf"))
    r = GGUFReader(path)
    f = r.fields
    assert bytes(f["general.architecture"].parts[-1]).decode() == "eagle3"
    assert list(f["eagle3.target_layers"].contents()) == [1, 2, 3]
    assert f["eagle3.target_hidden_size"].contents() == 32 and f["eagle3.block_count"].contents() == 1
    assert f["eagle3.attention.head_count_kv"].contents() == 2 and f["eagle3.rope.freq_base"].contents() == 1e4
    assert len(f["tokenizer.ggml.tokens"].contents()) == 261
    got = {x.name: x for x in r.tensors}
    assert set(got) == set(ls.DRAFTER_TENSORS.values()) | {"d2t"}
    assert np.array_equal(np.asarray(got["d2t"].data), used)              # absolute ids, not offsets
    for key, name in ls.DRAFTER_TENSORS.items():
        want = t[key]
        if key.endswith("q_proj.weight"):
            want = permute_qk(want, 4)
        elif key.endswith("k_proj.weight"):
            want = permute_qk(want, 2)
        arr = np.asarray(got[name].data)
        if want.ndim == 2:
            assert arr.dtype == np.float16 and np.array_equal(arr, want.astype(np.float16)), key
        else:
            assert arr.dtype == np.float32 and np.array_equal(arr, want), key
    q = t["midlayer.self_attn.q_proj.weight"]
    assert not np.array_equal(permute_qk(q, 4), q)                       # the permutation is not the identity


def test_drafter_gguf_refuses_what_eagle3_does_not_compute(tmp_path):
    import dataclasses

    dcfg, t, _ = _tiny_drafter()
    tok = _tokenizer_gguf(tmp_path / "tok.gguf")
    with pytest.raises(ValueError, match="one decoder layer"):
        ls.write_drafter_gguf(tmp_path / "a.gguf", dataclasses.replace(dcfg, num_hidden_layers=2), t, tok)
    with pytest.raises(ValueError, match="three captured layers"):
        ls.write_drafter_gguf(tmp_path / "b.gguf", dataclasses.replace(dcfg, aux_layers=(1, 2)), t, tok)
    bad = dict(t, d2t=np.full(64, 300, np.int64))
    with pytest.raises(ValueError, match="outside the teacher vocabulary"):
        ls.write_drafter_gguf(tmp_path / "c.gguf", dcfg, bad, tok)


def test_parse_variants():
    v = ls.parse_variants("greedy,ngram-mod,eagle3:4,ngram-mod+eagle3")
    assert [n for n, _ in v] == ["llama-server greedy", "llama-server ngram-mod", "llama-server eagle3:4",
                                 "llama-server ngram-mod+eagle3"]
    assert v[0][1] == [] and v[1][1] == ["--spec-type", "ngram-mod"]
    assert v[2][1] == ["--spec-type", "draft-eagle3", "--spec-draft-model", "{drafter}", "--spec-draft-n-max", "4"]
    assert v[3][1][:2] == ["--spec-type", "ngram-mod,draft-eagle3"] and v[3][1][-1] == "3"
    for bad, msg in (("lookup", "unknown"), ("eagle3:0", "1 <= N"), ("eagle3:x", "1 <= N"), ("greedy,greedy", "twice"),
                     ("", "no peer variant")):
        with pytest.raises(ValueError, match=msg):
            ls.parse_variants(bad)


def test_compare():
    assert ls.compare([1, 2, 3], [1, 2, 3]) == {"same_tokens": True, "match_prefix": 1.0}
    assert ls.compare([1, 2, 4], [1, 2, 3, 5]) == {"same_tokens": False, "match_prefix": 0.5}
    assert ls.compare([1, 2], [1, 2, 9], eos=(9,))["same_tokens"]                 # the EOS it does not return
    assert ls.compare([], [9], eos=(9,))["same_tokens"]
    assert not ls.compare([1, 2], [1, 2, 9])["same_tokens"]                       # 9 is not an EOS here
    assert not ls.compare([1, 3], [1, 2, 9], eos=(9,))["same_tokens"]


def test_peer_runs_clean_and_compares_tokens(stand_in, monkeypatch):
    """Each variant is its own process that sees none of our / OpenMP's variables although this process has
    them; the eagle3 variant gets our drafter file and its n-max; tokens are compared with ours (the EOS that
    llama-server does not return restored only where the rest is equal); tok/s from the server's own clock."""
    monkeypatch.setenv("OMP_WAIT_POLICY", "PASSIVE")
    monkeypatch.setenv("MSEAGLE_THREADS", "2")
    monkeypatch.setenv("MS_DEV_X", "1")
    model = stand_in / "teacher.gguf"
    model.write_bytes(b"")
    assert ls.binary() == str(stand_in / "bin" / "llama-server") and ls.version() == "version: 0 (stand-in)"
    with pytest.raises(ValueError, match="need our drafter"):
        ls.LlamaServerPeer(str(model), None, 2, 512, "greedy,eagle3:2")
    peer = ls.LlamaServerPeer(str(model), "/d/drafter.gguf", 2, 512, "greedy,ngram-mod,eagle3:2", eos_ids=(1,),
                              log_dir=str(stand_in))
    try:
        assert peer.variants == ["llama-server greedy", "llama-server ngram-mod", "llama-server eagle3:2"]
        seen = [json.loads(p.read_text()) for p in sorted(stand_in.glob("teacher.gguf.*.json"))]
        assert len(seen) == 3
        for s in seen:
            assert not [k for k in s["env"] if k.startswith(("OMP_", "GOMP_", "KMP_", "MSEAGLE_", "MS_"))]
            assert s["args"][s["args"].index("-t") + 1] == "2" and s["args"][s["args"].index("-np") + 1] == "1"
        eagle = [s["args"] for s in seen if "draft-eagle3" in s["args"]]
        assert len(eagle) == 1 and eagle[0][eagle[0].index("--spec-draft-model") + 1] == "/d/drafter.gguf"
        r = peer.run([0, 5, 6], 128, [7, 8, 9, 1])
        g, m = r["llama-server greedy"], r["llama-server ngram-mod"]
        assert g["same_tokens"] and g["match_prefix"] == 1.0 and g["new_tokens"] == 4
        assert g["seconds"] == pytest.approx(0.030) and g["tok_s"] == pytest.approx(4 / 0.030)
        assert g["prompt_n"] == 3 and g["draft_n"] == 0
        assert not m["same_tokens"] and m["match_prefix"] == 0.5 and m["draft_accepted"] == 3
        short = peer.run([0], 2, [7, 8])["llama-server greedy"]
        assert short["same_tokens"] and short["new_tokens"] == 2
        assert not peer.run([0], 128, [7, 8, 9, 5])["llama-server greedy"]["same_tokens"]   # ours went on
    finally:
        peer.close()
    assert all(s.proc.poll() is not None for s in peer.servers.values())

    class Peer:                                   # the bench's turn loop and report with the peer's answers
        def run(self, ids, n, ref):
            return {"llama-server greedy": {"tok_s": 20.0, "new_tokens": n, "seconds": n / 20.0, "same_tokens": True,
                                            "match_prefix": 1.0},
                    "llama-server ngram-mod": {"tok_s": 25.0, "new_tokens": n, "seconds": n / 25.0,
                                               "same_tokens": False, "match_prefix": 0.5, "draft_n": 10,
                                               "draft_accepted": 4}}

    from mindspore_eagle.bench.throughput import run_turns

    recs = run_turns(FakePool(FakeEngine()), TURNS[:1], GEN, MAIN, str(stand_in / "t.jsonl"), peer=Peer(),
                     progress=False)
    rep = report_mod.build_report(recs, {"main": MAIN[0].to_dict(), "sweeps": {}})
    rows = rep["peers"]["rows"]
    main = recs[0]["settings"]["main"]
    ours = main["new_tokens"] / ((main["prefill_ms"] + main["decode_ms"]) / 1e3)
    assert rows["llama-server ngram-mod"]["ea_over"] == pytest.approx(ours / 25.0)
    assert rows["llama-server greedy"]["same_turns"] == 1 and rows["llama-server ngram-mod"]["same_turns"] == 0
    assert rows["llama-server ngram-mod"]["draft_acceptance"] == pytest.approx(0.4)
    assert rep["peers"]["best"] == "llama-server ngram-mod" and rep["peer_llamacpp_tok_s"]["mean"] == 20.0
    md = report_mod.markdown(rep)
    assert "| llama-server ngram-mod (fastest peer) | 25.00 |" in md and "| 0 / 1 | 40 % |" in md


def test_server_that_fails_to_start_is_named(stand_in):
    bad = stand_in / "bin" / "llama-server"
    bad.write_text("#!/bin/sh\necho 'error: failed to load model' >&2\nexit 1\n")
    with pytest.raises(ls.PeerError, match="exited with code 1 at start.*failed to load model"):
        ls.LlamaServer(str(stand_in / "m.gguf"), 2, 512, log_path=str(stand_in / "log"))
