"""The GGUF conversion cache under concurrent loaders (a local stack converts the default
model in the proposer and the scorer at once on a fresh machine)."""

from __future__ import annotations

from pathlib import Path

import pytest

from specdecode.models.checkpoints import publish_dir


def _finished(path: Path, content: str) -> Path:
    path.mkdir()
    (path / "model.safetensors").write_text(content)
    return path


def test_the_second_converter_keeps_the_winners_copy_and_drops_its_own(tmp_path):
    out = tmp_path / "converted"
    publish_dir(_finished(tmp_path / "converted.tmp1", "first"), out)
    loser = _finished(tmp_path / "converted.tmp2", "second")
    publish_dir(loser, out)  # the rename finds `out` non-empty: no error
    assert (out / "model.safetensors").read_text() == "first"
    assert not loser.exists()


def test_a_failed_rename_with_nothing_published_is_an_error(tmp_path):
    with pytest.raises(OSError):
        publish_dir(_finished(tmp_path / "x.tmp1", "x"), tmp_path / "missing-parent" / "x")
