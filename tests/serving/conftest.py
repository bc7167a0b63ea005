"""Fixtures of the server tests (test_server.py, test_server_lifecycle.py). A module that defines a fixture of the
same name (test_api_server.py, test_batch_job.py) uses its own."""
import pytest
from tiny_engines import tiny_overrides

from mindspore_eagle.config import load_config


@pytest.fixture(scope="module")
def reference(tiny_dir):
    """In-process teacher-only engine of the tiny config: the one-at-a-time greedy answers."""
    from mindspore_eagle.serving.pipeline import build_engine

    cfg = load_config(None, tiny_overrides(tiny_dir))
    engine = build_engine(cfg)
    cache = {}

    def answer(prompt, max_tokens=24, raw=False):
        key = (prompt, max_tokens, raw)
        if key not in cache:
            import dataclasses

            gen = dataclasses.replace(cfg.generation, max_new_tokens=max_tokens)
            ids = engine.tokenizer.encode(prompt) if raw else engine.encode_chat(prompt)
            cache[key] = engine.generate_ids(ids, gen, speculative=False)
        return cache[key]
    answer.engine = engine
    return answer
