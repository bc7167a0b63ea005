"""Shared fixtures: the tiny openPangu-format checkpoint, runtime setup, and the real embedded teacher."""
import os
import sys

import pytest

os.environ.setdefault("MSEAGLE_THREADS", "2")


@pytest.fixture(autouse=True)
def no_compile_listener_left():
    """A test that runs the CLI, a bench or a warm-up in-process installs the process-wide compile listener
    (``warmup.report_compiles``); remove it after the test, so later tests' compiles print nothing into their
    captured stderr."""
    yield
    runtime = sys.modules.get("mindspore_eagle.kernels.runtime")
    if runtime is not None:
        runtime.set_compile_listener(None)


@pytest.fixture(autouse=True)
def release_graphs():
    """Free what a test's engines leave in MindSpore after it (only when graphs were compiled).

    A fused engine's compiled graphs, and the teacher weights they reference, stay in MindSpore's process-wide
    graph executor after the engine is garbage (measured: +0.8 GB resident per SmolLM2 engine, which took the
    suite to ~15 GB in one process). ``mindspore.ms_memory_recycle()`` drops them and ``malloc_trim`` hands the
    freed heap back to the OS. An engine that outlives the test (a module fixture) would compile again on next use.
    """
    yield
    api = sys.modules.get("mindspore.graph.api")
    if os.environ.get("MSEAGLE_TEST_KEEP_GRAPHS") or api is None or not api.ms_compile_cache:
        return
    import gc

    gc.collect()
    if "mindspore" in sys.modules:
        import ctypes

        sys.modules["mindspore"].ms_memory_recycle()
        gc.collect()
        try:
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        except (OSError, AttributeError):    # not glibc
            pass


@pytest.fixture(scope="session")
def ms_runtime():
    from mindspore_eagle.kernels import runtime

    runtime.configure()
    return runtime


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    from tiny_pangu import write_tiny_pangu

    return write_tiny_pangu(tmp_path_factory.mktemp("tiny_pangu"))


@pytest.fixture(scope="session")
def tiny(tiny_dir):
    """(ModelConfig, HF tensors, Tokenizer) of the tiny openPangu checkpoint."""
    from mindspore_eagle.models.checkpoints import load_teacher

    return load_teacher(tiny_dir)


@pytest.fixture(scope="session")
def real_loaded():
    """numpy weights of the embedded default teacher (SmolLM2-135M-Instruct GGUF) + drafter, read once."""
    from mindspore_eagle.config import load_config
    from mindspore_eagle.serving.pipeline import load_models

    return load_models(load_config(None, ["model.drafter=none"]))
