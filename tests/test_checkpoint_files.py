"""A party's files are written whole, in its own folder, and never through a link planted there."""

from __future__ import annotations

import numpy as np

from parties.checkpoint import load_checkpoint, save_checkpoint


def test_a_symlink_planted_at_the_temporary_name_is_not_followed(tmp_path):
    """Someone who can write into the run folder plants ``party-1.ckpt.npz.tmp`` pointing at a file
    outside it: the save replaces the link and leaves that file as it was."""
    outside = tmp_path / "outside.txt"
    outside.write_text("not the party's to overwrite\n")
    folder = tmp_path / "run"
    folder.mkdir()
    (folder / "party-1.ckpt.npz.tmp").symlink_to(outside)
    w = np.arange(5, dtype=np.float64)
    save_checkpoint(folder, 1, w, epochs=1.0, train_time=0.5, updates=10)
    assert outside.read_text() == "not the party's to overwrite\n"
    assert not (folder / "party-1.ckpt.npz.tmp").exists()
    restored = load_checkpoint(folder, 1, n_features=5, epochs=1.0)
    assert np.array_equal(restored.w, w) and restored.updates == 10
