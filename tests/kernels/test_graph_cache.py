"""kernels/graph_cache.py: the graph store keyed by shape. What identifies a graph (MindIR header, Cell
fingerprint), and, across processes, that graphs compiled in one order are loaded in another with bit-identical
results, and that a damaged or mismatched stored file is detected, deleted and compiled afresh, never run."""
import json
import os
import subprocess
import sys
import textwrap

import numpy as np
import pytest


def _mindir(name, inputs, params):
    """Bytes of a MindIR ModelProto holding only a graph name, inputs [(dims, dtype code)] and parameters
    {name: dims} (MindSpore's own protobuf classes)."""
    import mindspore  # noqa: F401  (sets up the protobuf runtime mind_ir_pb2 needs)
    from mindspore.train import mind_ir_pb2

    m = mind_ir_pb2.ModelProto()
    m.ir_version, m.producer_name = "1.1", "MindSpore"
    m.graph.name = name
    for i, (dims, code) in enumerate(inputs):
        v = m.graph.input.add()
        v.name = f"{name}:x{i}"
        t = v.tensor.add()
        t.dims.extend(dims)
        t.data_type = code
    for pname, dims in params.items():
        p = m.graph.parameter.add()
        p.name = f"{name}:{pname}"
        p.dims.extend(dims)
        p.data_type = 1
    n = m.graph.node.add()            # a node the reader must skip
    n.name = "op"
    return m.SerializeToString()


class LlamaModel:                      # stands in for the Cell: its class name and Parameter shapes
    def __init__(self, params):
        self._p = params

    def parameters_dict(self):
        from types import SimpleNamespace

        return {k: SimpleNamespace(shape=tuple(v)) for k, v in self._p.items()}


def test_read_graph_and_check_graph():
    from mindspore_eagle.kernels.graph_cache import check_graph, read_graph

    name = "552_1_mindspore_eagle_models_llama_LlamaModel_construct_86"
    data = _mindir(name, [([16], 6), ([16, 256], 1)], {"embed": [400, 64], "layers.0.attn.wqkv": [128, 64]})
    g = read_graph(data)
    assert g == {"name": name, "inputs": [([16], 6), ([16, 256], 1)],
                 "params": {"embed": [400, 64], "layers.0.attn.wqkv": [128, 64]}}
    cell = LlamaModel({"embed": (400, 64), "layers.0.attn.wqkv": (128, 64), "norm.weight": (64,)})
    sig = (((16,), "Int32"), ((16, 256), "Float32"))
    assert check_graph(data, cell, "construct", sig) is None
    assert "inputs" in check_graph(data, cell, "construct", (((32,), "Int32"), ((32, 256), "Float32")))
    assert "inputs" in check_graph(data, cell, "construct", (((16,), "Int64"), ((16, 256), "Float32")))
    assert "is not LlamaModel.hidden" in check_graph(data, cell, "hidden", sig)
    other = _mindir("357_1_context_83", [([16], 6), ([16, 256], 1)], {"embed": [400, 64]})
    assert check_graph(other, cell, "context", sig) is None                # a method other than construct
    assert "is not LlamaModel.construct" in check_graph(other, cell, "construct", sig)
    assert "parameter embed" in check_graph(data, LlamaModel({"embed": (401, 64)}), "construct", sig)
    assert check_graph(b"not a graph", cell, "construct", sig) == "not a MindIR graph"
    assert check_graph(data[: len(data) // 2], cell, "construct", sig) is not None


def test_fingerprint_follows_structure_and_constants_not_weights(ms_runtime, tiny):
    """Two Cells of one architecture share their graphs whatever their weights; another cache geometry (Parameter
    shapes) or another RoPE base (a constant tensor in the graph) does not."""
    from mindspore_eagle.kernels.graph_cache import cell_fingerprint
    from mindspore_eagle.models.llama import LlamaModel as Cell

    cfg, tensors, _ = tiny
    a = Cell(cfg, 64, 8, 512)
    a.load_hf_weights(tensors)
    b = Cell(cfg, 64, 8, 512)
    b.load_hf_weights({k: v * 1.5 for k, v in tensors.items()})
    assert cell_fingerprint(a) == cell_fingerprint(b)
    assert cell_fingerprint(Cell(cfg, 32, 8, 512))["params"] != cell_fingerprint(a)["params"]
    assert cell_fingerprint(Cell(cfg.replace(rope_theta=cfg.rope_theta * 2), 64, 8, 512))["tree"] != \
        cell_fingerprint(a)["tree"]


def test_activate_only_on_cpu(tmp_path, monkeypatch):
    from mindspore_eagle.kernels import graph_cache as gcache

    monkeypatch.setattr(gcache, "_active", None)
    assert gcache.activate(tmp_path, device="Ascend") is None and gcache.active() is None


def test_default_root_is_under_mseagle_cache(tmp_path, monkeypatch):
    from mindspore_eagle.kernels.graph_cache import default_root

    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path))
    assert default_root() == tmp_path / "graphs"


# ------------------------------------------------------------------------------ across processes --
RUN = textwrap.dedent("""
    import json, sys
    import numpy as np
    sys.path[:0] = [p for p in sys.argv[3].split(":") if p]
    from mindspore_eagle.kernels import graph_cache, runtime
    runtime.configure()
    from mindspore_eagle.models.checkpoints import load_teacher
    from tiny_engines import make_target
    cfg, tensors, _ = load_teacher(sys.argv[1])
    tg = make_target(cfg, tensors, "fused", num_blocks=64, block_size=8, max_seq_len=512, host=False)
    store = graph_cache.activate(sys.argv[2])
    def run(ids):
        sid = tg.new_seq()
        out = tg.prefill(sid, ids[:-1])[0] if len(ids) > 1 else None
        logits, _ = tg.decode(sid, ids[-1])
        tg.free(sid)
        return logits
    calls = {"short": list(range(5, 15)), "long": list(range(300)), "one": [7]}
    got = {name: run(calls[name]).tobytes().hex() for name in sys.argv[4].split(",")}
    class Engine:
        pass
    graph_cache.deactivate()
    holder = Engine()
    again = graph_cache.activate(sys.argv[2], holder=holder) is store
    del holder
    import gc, mindspore
    gc.collect()
    released = graph_cache.active() is None and not mindspore.get_context("enable_compile_cache")
    print(json.dumps({"logits": got, "stats": store.stats, "graphs": runtime.graph_stats(),
                      "runner": [tg.compiles, tg.loads], "holder": [again, released]}))
""")


def _start(tmp_path, tiny_dir, order) -> subprocess.Popen:
    env = dict(os.environ, GLOG_v="3")
    return subprocess.Popen([sys.executable, "-c", RUN, str(tiny_dir), str(tmp_path / "graphs"), ":".join(sys.path),
                             order], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, err[-3000:]
    return json.loads(out.strip().splitlines()[-1])


def _run(tmp_path, tiny_dir, order):
    return _result(_start(tmp_path, tiny_dir, order))


@pytest.mark.slow
def test_graphs_compiled_in_one_order_load_in_another_and_bad_files_are_rebuilt(tmp_path, tiny_dir):
    """Process 1 compiles prefill 16 x 256, decode 1 x 256, prefill 16 x 512, decode 1 x 512; process 2 makes the
    same graphs in another order and loads all four (logits bit-identical); then one stored file gets a flipped
    byte and two others are swapped whole (their sha256 records with them): process 3 rejects those three,
    compiles them again and stores them, and still computes the same logits."""
    first = _run(tmp_path, tiny_dir, "short,long")
    assert first["stats"] == {"loaded": 0, "compiled": 4, "stored": 4, "rejected": 0}
    assert first["holder"] == [True, True]                 # active again for a holder, off once it is gone
    second = _run(tmp_path, tiny_dir, "long,one,short")
    assert second["stats"] == {"loaded": 4, "compiled": 0, "stored": 0, "rejected": 0}
    assert second["graphs"]["compiles"] == 0 and second["graphs"]["loads"] == 4
    assert first["runner"] == [4, 0] and second["runner"] == [0, 4]    # the runner counts loads (server gauge)
    assert second["logits"]["short"] == first["logits"]["short"] and second["logits"]["long"] == first["logits"]["long"]

    store = next((tmp_path / "graphs").glob("ms-*"))
    assert not list((store / "stage").iterdir())                       # each process removed its staging directory
    entries = sorted(store.glob("entries/*.json"))
    metas = [json.loads(p.read_text()) for p in entries]
    rows = [m["key"]["inputs"][0][0][0] for m in metas]
    widths = [m["key"]["inputs"][4][0][1] for m in metas]
    assert sorted(zip(rows, widths)) == [(1, 256), (1, 512), (16, 256), (16, 512)]
    by = {(r, w): p.with_suffix("") for r, w, p in zip(rows, widths, entries)}
    flip = by[(1, 256)].with_suffix(".mindir")
    data = bytearray(flip.read_bytes())
    data[len(data) // 2] ^= 0xFF
    flip.write_bytes(bytes(data))                                      # bytes changed: the sha256 no longer holds
    a, b = by[(16, 256)], by[(16, 512)]                                # same shapes but the width: a swap whose
    for suffix in (".mindir",):                                        # sha256 records follow the files
        pa, pb = a.with_suffix(suffix), b.with_suffix(suffix)
        da, db = pa.read_bytes(), pb.read_bytes()
        pa.write_bytes(db), pb.write_bytes(da)
    ma, mb = json.loads(a.with_suffix(".json").read_text()), json.loads(b.with_suffix(".json").read_text())
    ma["sha256"], mb["sha256"] = mb["sha256"], ma["sha256"]
    a.with_suffix(".json").write_text(json.dumps(ma)), b.with_suffix(".json").write_text(json.dumps(mb))

    third = _run(tmp_path, tiny_dir, "short,long")
    assert third["stats"] == {"loaded": 1, "compiled": 3, "stored": 3, "rejected": 3}
    assert third["logits"] == first["logits"]
    assert np.array_equal(np.frombuffer(bytes.fromhex(third["logits"]["short"]), np.float32),
                          np.frombuffer(bytes.fromhex(first["logits"]["short"]), np.float32))


@pytest.mark.slow
def test_two_processes_fill_one_graph_store_at_once(tmp_path, tiny_dir):
    """Two processes start on one empty store together and compile the same four graphs: both finish with the
    same logits, the store ends with one entry per graph and no staging left, and a third process loads all
    four without compiling."""
    a, b = _start(tmp_path, tiny_dir, "short,long"), _start(tmp_path, tiny_dir, "long,short")
    ra, rb = _result(a), _result(b)
    assert ra["logits"] == rb["logits"]
    assert ra["stats"]["loaded"] + ra["stats"]["compiled"] == 4 and rb["stats"]["loaded"] + rb["stats"]["compiled"] == 4
    assert ra["stats"]["rejected"] == rb["stats"]["rejected"] == 0
    store = next((tmp_path / "graphs").glob("ms-*"))
    assert len(list(store.glob("entries/*.json"))) == len(list(store.glob("entries/*.mindir"))) == 4
    assert not list((store / "stage").iterdir())
    third = _run(tmp_path, tiny_dir, "short,long")
    assert third["stats"] == {"loaded": 4, "compiled": 0, "stored": 0, "rejected": 0}
    assert third["logits"] == ra["logits"]
