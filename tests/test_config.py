"""YAML configs: shipped files load, strict keys/types/ranges with key path and allowed range, --set, merging.

No MindSpore import: every test here runs in milliseconds.
"""
from __future__ import annotations

from pathlib import Path

import pytest

from mindspore_eagle.config import Config, ConfigError, load_config, parse_override

ROOT = Path(__file__).resolve().parents[1]
CONFIGS = sorted((ROOT / "configs").glob("*.yaml"))
PRESETS = sorted(p for p in (ROOT / "configs" / "presets").glob("*.yaml") if not p.name.startswith("ascend_"))
# budget presets (speculative section only); the ascend_* deployment presets are checked in test_dtype.py


def _yaml(tmp_path, text: str, name: str = "c.yaml") -> str:
    p = tmp_path / name
    p.write_text(text, encoding="utf-8")
    return str(p)


def test_shipped_configs_exist():
    names = {p.name for p in CONFIGS}
    assert {"default.yaml", "openpangu_embedded_1b.yaml", "openpangu_embedded_7b.yaml"} <= names
    assert {"chain.yaml", "small_tree.yaml", "large_tree.yaml"} <= {p.name for p in PRESETS}


@pytest.mark.parametrize("path", CONFIGS, ids=lambda p: p.name)
def test_shipped_config_loads(path):
    cfg = load_config(str(path))
    assert cfg.context.mode in (0, 1) and cfg.speculative.M >= 2


def test_default_yaml_equals_builtin_defaults():
    """configs/default.yaml documents the dataclass defaults exactly (policy adaptive included: a run without
    --config gets the policy measured best, docs/design.md, "Measurements behind the design: The adaptive policy
    against fixed budgets")."""
    yaml_cfg = load_config(str(ROOT / "configs" / "default.yaml")).to_dict()
    assert yaml_cfg["speculative"]["policy"] == "adaptive"
    assert yaml_cfg == Config().validate().to_dict()


def test_openpangu_configs_target_ascend():
    for name in ("openpangu_embedded_1b.yaml", "openpangu_embedded_7b.yaml"):
        cfg = load_config(str(ROOT / "configs" / name))
        assert cfg.context.device_target == "Ascend" and cfg.model.teacher.startswith("/path/to/")


@pytest.mark.parametrize("preset", PRESETS, ids=lambda p: p.name)
def test_preset_merges_over_deployment(preset):
    base = load_config(str(ROOT / "configs" / "openpangu_embedded_7b.yaml"))
    cfg = load_config([str(ROOT / "configs" / "openpangu_embedded_7b.yaml"), str(preset)])
    assert cfg.model == base.model and cfg.cache == base.cache and cfg.context == base.context
    assert cfg.speculative.top_k <= cfg.speculative.M


def test_chain_preset_is_a_chain():
    sp = load_config([str(ROOT / "configs" / "default.yaml"), str(ROOT / "configs/presets/chain.yaml")]).speculative
    assert sp.top_k == 1 and sp.M == sp.D_max + 1


def test_malformed_yaml_names_line(tmp_path):
    path = _yaml(tmp_path, "speculative:\n  M: [16\n  D_max: 5\n")
    with pytest.raises(ConfigError) as e:
        load_config(path)
    assert str(e.value).startswith(f"config file {path!r} is not valid YAML at line ")


def test_missing_file():
    with pytest.raises(ConfigError, match="config file '/no/such.yaml' does not exist"):
        load_config("/no/such.yaml")


def test_unknown_key_lists_allowed(tmp_path):
    with pytest.raises(ConfigError) as e:
        load_config(_yaml(tmp_path, "speculative:\n  budget: 8\n"))
    assert str(e.value) == ("unknown key speculative.budget; allowed keys: M, D_max, top_k, window, mode, policy, "
                            "validate_tree, trace, method, suffix_tokens, batch_tree_rows")


def test_method_is_checked():
    with pytest.raises(ConfigError, match=r"speculative.method = 'ngram': must be one of eagle3, suffix, hybrid"):
        load_config(None, ["speculative.method=ngram"])
    assert load_config(None, ["speculative.method=hybrid"]).speculative.method == "hybrid"


def test_unknown_section(tmp_path):
    with pytest.raises(ConfigError, match="unknown section 'parallel'; allowed sections: context, model, "
                                          "speculative, generation, cache, batch, serve$"):
        load_config(_yaml(tmp_path, "parallel:\n  data_parallel: 1\n"))


@pytest.mark.parametrize("override, message", [
    ("speculative.M=1", "speculative.M = 1 is out of range: must be an int in [2, 512]"),
    ("batch.max_batch=0", "batch.max_batch = 0 is out of range: must be an int in [1, 256]"),
    ("serve.port=70000", "serve.port = 70000 is out of range: must be an int in [0, 65535]"),
    ("serve.max_batch=0", "serve.max_batch = 0 is out of range: must be an int in [1, 256]"),
    ("serve.speculative=1", "serve.speculative must be true or false, got 1"),
    ("serve.drain_timeout_s=-1", "serve.drain_timeout_s = -1.0 is out of range: must be a number in [0.0, 86400.0]"),
    ("serve.max_body_bytes=10", "serve.max_body_bytes = 10 is out of range: must be an int in [1024, 1073741824]"),
    ("speculative.M=abc", "speculative.M = 'abc' is out of range: must be an int in [2, 512]"),
    ("speculative.M=16.0", "speculative.M = 16.0 is out of range: must be an int in [2, 512]"),
    ("speculative.D_max=0", "speculative.D_max = 0 is out of range: must be an int in [1, 64]"),
    ("speculative.top_k=32", "speculative.top_k = 32 is out of range: must be <= speculative.M = 16"),
    ("speculative.window=-1", "speculative.window = -1 is out of range: must be an int >= 0"),
    ("speculative.mode=fast", "speculative.mode = 'fast': must be 'fused' or 'eager'"),
    ("speculative.validate_tree=1", "speculative.validate_tree must be true or false, got 1"),
    ("context.mode=2", "context.mode = 2 is out of range: must be an int in [0, 1]"),
    ("context.device_target=TPU", "context.device_target = 'TPU': must be CPU, GPU or Ascend"),
    ("model.teacher=3", "model.teacher must be a string, got 3"),
    ("model.dtype=bfloat16", "model.dtype = 'bfloat16' needs context.device_target: Ascend (MindSpore 2.9's CPU "
                             "backend has no bfloat16 MatMul); use float16 or float32 on CPU"),
    ("model.dtype=float64", "model.dtype = 'float64': must be float32, float16 or bfloat16"),
    ("model.weight_dtype=int8", "model.weight_dtype = 'int8': must be one of auto, float32, float16"),
    ("model.dtype=float16,model.weight_dtype=float16", "model.weight_dtype = float16 needs model.dtype float32 (the "
                                                      "CPU kernels widen half weights into float32 arithmetic), got "
                                                      "model.dtype float16"),
    ("generation.max_new_tokens=0", "generation.max_new_tokens = 0 is out of range: must be an int in [1, 1048576]"),
    ("generation.temperature=-1", "generation.temperature = -1.0 is out of range: must be a number in [0.0, 100.0]"),
    ("generation.top_p=0", "generation.top_p = 0.0 is out of range: must be a number in (0.0, 1.0]"),
    ("generation.stop=abc", "generation.stop must be a list of non-empty strings"),
    ("cache.max_seq_len=1000", "cache.max_seq_len = 1000 is out of range: must be a multiple of cache.block_size = 16"),
    ("cache.num_blocks=8", "cache.num_blocks = 8 is out of range: must be an int >= 64"),
    ("cache.prefill_chunk=100", "cache.prefill_chunk = 100: must be one of 16, 32, ..., 512"),
])
def test_bad_values_name_key_and_range(override, message):
    with pytest.raises(ConfigError) as e:
        load_config(None, override.split(","))
    assert str(e.value) == message


def test_overrides_are_typed_and_applied_last(tmp_path):
    path = _yaml(tmp_path, "speculative:\n  M: 16\ngeneration:\n  stop: ['x']\n")
    cfg = load_config(path, ["speculative.M=32", "generation.temperature=0.7", "generation.stop=[END, '###']",
                             "model.teacher=/a=b/c"])
    assert cfg.speculative.M == 32 and cfg.generation.temperature == 0.7
    assert cfg.generation.stop == ["END", "###"] and cfg.model.teacher == "/a=b/c"


def test_override_into_empty_section(tmp_path):
    assert load_config(_yaml(tmp_path, "speculative:\n"), ["speculative.M=8"]).speculative.M == 8


@pytest.mark.parametrize("text", ["speculative", "M=3", "=3"])
def test_malformed_override(text):
    with pytest.raises(ConfigError, match="--set expects section.key=value"):
        parse_override(text)


def test_override_unknown_key():
    with pytest.raises(ConfigError, match="unknown key speculative.depth"):
        load_config(None, ["speculative.depth=3"])


def test_exec_mode_follows_context_mode():
    assert load_config(None, ["context.mode=1", "speculative.mode=fused"]).exec_mode == "eager"
    assert load_config(None, ["context.mode=0", "speculative.mode=fused"]).exec_mode == "fused"


def test_non_mapping_file(tmp_path):
    with pytest.raises(ConfigError, match="must hold a mapping of sections"):
        load_config(_yaml(tmp_path, "- a\n- b\n"))


@pytest.mark.parametrize("text, value", [("1e-6", 1e-6), ("5E-1", 0.5), ("2e1", 20.0), ("+1e-3", 1e-3),
                                         (".5e1", 5.0), ("1.5e-2", 0.015)])
def test_exponent_floats_without_a_dot_are_numbers(tmp_path, text, value):
    """PyYAML reads '1e-6' as a string; both --set and YAML files must give the number."""
    assert load_config(None, [f"generation.temperature={text}"]).generation.temperature == value
    path = tmp_path / "c.yaml"
    path.write_text(f"generation:\n  temperature: {text}\n  top_p: {text if value <= 1 else 1}\n")
    cfg = load_config(str(path))
    assert cfg.generation.temperature == value and type(cfg.generation.temperature) is float
    assert cfg.generation.top_p == (value if value <= 1 else 1)


@pytest.mark.parametrize("text", ["1e", "e-6", "1e-6x", "abc", "1e-6.5"])
def test_strings_that_are_not_numbers_still_refused(text):
    with pytest.raises(ConfigError) as ei:
        load_config(None, [f"generation.temperature={text}"])
    assert str(ei.value) == f"generation.temperature = {text!r} is out of range: must be a number in [0.0, 100.0]"


def test_exponent_float_in_an_int_key_is_refused():
    with pytest.raises(ConfigError, match=r"^speculative.M = 10000.0 is out of range: must be an int in \[2, 512\]$"):
        load_config(None, ["speculative.M=1e4"])
