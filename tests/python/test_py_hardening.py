"""What a newcomer types wrong, from Python: each gets a clear error, and nothing is written."""
import os

import numpy as np
import pytest

import ckptio

BAD_ROOTS = ["s3://bucket/run", "gcs://bucket/run", "gs:/bucket/run", "gs://", "gs://UPPER/x"]


@pytest.mark.parametrize("root", BAD_ROOTS)
def test_a_manager_on_an_unknown_or_malformed_url_raises_and_creates_nothing(root, tmp_path, monkeypatch, small):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ckptio.InvalidArgumentError) as e:
        ckptio.CheckpointManager(root, **small)
    assert isinstance(e.value, ValueError)
    assert root in str(e.value) and "gs://BUCKET[/PREFIX]" in str(e.value)
    assert os.listdir(tmp_path) == []


@pytest.mark.parametrize("root", BAD_ROOTS)
def test_flax_save_checkpoint_on_an_unknown_or_malformed_url_raises_and_creates_nothing(root, tmp_path, monkeypatch,
                                                                                        flax_ckpt):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(ValueError, match="gs://BUCKET"):
        flax_ckpt.save_checkpoint(root, {"w": np.arange(4)}, 1)
    with pytest.raises(ValueError, match="gs://BUCKET"):
        flax_ckpt.restore_checkpoint(root, None)
    with pytest.raises(ValueError, match="gs://BUCKET"):
        flax_ckpt.latest_checkpoint(root)
    assert os.listdir(tmp_path) == []


def test_a_local_directory_named_like_a_url_is_written_with_a_dot_slash(tmp_path, monkeypatch, small):
    monkeypatch.chdir(tmp_path)
    with ckptio.CheckpointManager("./gcs:/b/run", **small) as mgr:
        mgr.save(1, {"w": np.arange(4)})
        mgr.wait_until_finished()
        assert mgr.root == str(tmp_path / "gcs:" / "b" / "run")
    assert (tmp_path / "gcs:" / "b" / "run" / "checkpoint_1" / "manifest.json").is_file()
