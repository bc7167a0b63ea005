"""llama.cpp peer worker: one process of its own, run by file path (``python llamacpp_worker.py``), never imported.

It imports neither ``mindspore_eagle`` nor MindSpore, so nothing of ours (``runtime.configure``'s thread settings,
an inherited ``OMP_*`` variable) reaches llama.cpp: bench/peer.py starts it with a cleaned environment
(``peer.peer_env``). A peer measured inside our process ran at half its speed (llama.cpp synchronises its threads
with OpenMP barriers after every op, and a passive wait policy turns each into a sleep and a wake-up;
docs/performance.md, "How peers are measured").

Protocol: one JSON object a line on stdin, one JSON answer a line on stdout (``{"error": "..."}`` on failure).

    {"cmd": "env"}        -> {"env": {name: value} of every OMP_ / GOMP_ / KMP_ / MSEAGLE_ / MS_ variable, "pid"}
    {"cmd": "load", "model": PATH, "n_threads": T, "n_ctx": C, "lookup": [2, 10]}
                          -> {"variants": ["greedy", "lookup2", "lookup10"]}: one llama_cpp.Llama per variant, greedy
                             and greedy with llama-cpp-python's LlamaPromptLookupDecoding(num_pred_tokens=n)
    {"cmd": "generate", "variant": V, "prompt_ids": [...], "max_new_tokens": N, "eos": [...]}
                          -> {"ids": [...], "seconds": s}: greedy (top_k 1, temperature 0, no penalty), prompt
                             evaluation included, stopping at an eos id (kept) or after N tokens
    {"cmd": "forward", "ctx_ids": [...], "ks": [1, 4, ...], "repeat": R}
                          -> {"decode_ms": ms, "ms": {k: median ms}}: after ctx_ids are evaluated, one eval of k
                             new tokens with logits for all k rows (as tree verification needs), median of R
    {"cmd": "quit"}       -> exits 0
"""
import json
import os
import sys
import time

if sys.path and os.path.abspath(sys.path[0]) == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)                       # run by path: do not shadow installed modules with this folder's files

OURS = ("OMP_", "GOMP_", "KMP_", "MSEAGLE_", "MS_")

_models: dict = {}
_forward = {}


def _greedy_kwargs(llm) -> dict:
    import inspect

    want = {"top_k": 1, "top_p": 1.0, "min_p": 0.0, "temp": 0.0, "repeat_penalty": 1.0, "reset": True}
    params = inspect.signature(llm.generate).parameters               # older releases lack min_p
    return {k: v for k, v in want.items() if k in params}


def _load(req: dict) -> dict:
    import llama_cpp
    from llama_cpp.llama_speculative import LlamaPromptLookupDecoding

    common = dict(model_path=req["model"], n_threads=int(req["n_threads"]), n_threads_batch=int(req["n_threads"]),
                  n_ctx=int(req["n_ctx"]), n_batch=512, verbose=False, seed=0)
    _models.clear()
    _models["greedy"] = llama_cpp.Llama(**common)
    for n in req.get("lookup", []):
        # logits_all=True: with a draft model llama-cpp-python keeps logits of every row evaluated but sizes its
        # buffer by this argument (n_batch rows when False), so a turn past 512 tokens overflowed it
        _models[f"lookup{int(n)}"] = llama_cpp.Llama(
            **common, logits_all=True, draft_model=LlamaPromptLookupDecoding(num_pred_tokens=int(n)))
    _forward["common"] = common
    return {"variants": list(_models)}


def _generate(req: dict) -> dict:
    llm = _models[req["variant"]]
    eos = {int(e) for e in req.get("eos", [])} | {int(llm.token_eos())}
    limit = int(req["max_new_tokens"])
    out = []
    t0 = time.perf_counter()
    for tok in llm.generate([int(i) for i in req["prompt_ids"]], **_greedy_kwargs(llm)):
        out.append(int(tok))
        if tok in eos or len(out) >= limit:
            break
    return {"ids": out, "seconds": time.perf_counter() - t0}


def _median_ms(fn, repeat: int) -> float:
    """Median wall ms of ``repeat`` calls after one warm call (as bench/micro/forward.py times ours; repeated
    here because this file must not import the package: module docstring)."""
    fn()
    times = []
    for _ in range(repeat):
        t0 = time.perf_counter()
        fn()
        times.append((time.perf_counter() - t0) * 1e3)
    return sorted(times)[len(times) // 2]


def _forward_ms(req: dict) -> dict:
    import llama_cpp

    if "all_rows" not in _forward:
        _forward["all_rows"] = llama_cpp.Llama(**_forward["common"], logits_all=True)
    llm = _forward["all_rows"]
    prefix = [int(t) for t in req["ctx_ids"]]
    repeat = int(req.get("repeat", 5))
    llm.reset()
    llm.eval(prefix)

    def decode_run(n=32):
        llm.n_tokens = len(prefix)
        t0 = time.perf_counter()
        for _ in range(n):
            llm.eval([42])
        return (time.perf_counter() - t0) * 1e3 / n

    decode = sorted(decode_run() for _ in range(3))[1]
    out = {}
    for k in req["ks"]:
        def one_eval(k=int(k)):
            llm.n_tokens = len(prefix)          # drop the previous call's tokens, keep the cached prefix
            llm.eval([42] * k)
        out[str(k)] = _median_ms(one_eval, repeat)
    return {"decode_ms": decode, "ms": out}


def main() -> int:
    # the protocol gets its own copy of stdout; fd 1 then points at stderr, so whatever llama.cpp or a library
    # prints can never be read as an answer
    proto = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    for line in sys.stdin:
        if not line.strip():
            continue
        try:
            req = json.loads(line)
            cmd = req.get("cmd")
            if cmd == "quit":
                return 0
            if cmd == "env":
                ans = {"env": {k: v for k, v in os.environ.items() if k.startswith(OURS)}, "pid": os.getpid()}
            elif cmd == "load":
                ans = _load(req)
            elif cmd == "generate":
                ans = _generate(req)
            elif cmd == "forward":
                ans = _forward_ms(req)
            else:
                ans = {"error": f"unknown cmd {cmd!r}"}
        except Exception as e:  # noqa: BLE001  (the parent gets the reason in one line)
            ans = {"error": f"{type(e).__name__}: {e}"}
        proto.write(json.dumps(ans) + "\n")
        proto.flush()
    return 0


if __name__ == "__main__":
    sys.exit(main())
