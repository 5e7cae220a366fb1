"""A party's files are written whole, in its own folder, and never through a link planted there."""

from __future__ import annotations

import json

import numpy as np
import pytest

from parties.checkpoint import (
    MANIFEST,
    checkpoint_path,
    complete_epochs,
    load_checkpoint,
    mark_complete,
    metrics_before,
    sampler_from_words,
    sampler_words,
    save_checkpoint,
)


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


# ---------------------------------------------------------------------------- resume points (issue 26)


def _save(folder, epochs, keep):
    save_checkpoint(folder, 0, np.full(3, epochs), epochs=epochs, train_time=epochs, updates=int(epochs),
                    keep=keep)


def test_two_crashes_before_the_mark_keep_the_marked_epoch(tmp_path):
    """Epoch 1 marked; the parties write 2 and crash before the mark; the resume from 1 writes 2 again
    and crashes again before the mark: epoch 1 must still be there to resume from."""
    _save(tmp_path, 1.0, keep=None)
    mark_complete(tmp_path, 1.0)
    _save(tmp_path, 2.0, keep=1.0)                # crash 1: epoch 2 never marked
    marked = complete_epochs(tmp_path)
    assert load_checkpoint(tmp_path, 0, 3, marked).epochs == 1.0
    _save(tmp_path, 2.0, keep=marked)             # the resumed run writes 2 again; crash 2
    restored = load_checkpoint(tmp_path, 0, 3, complete_epochs(tmp_path))
    assert restored.epochs == 1.0 and np.array_equal(restored.w, np.full(3, 1.0))
    mark_complete(tmp_path, 2.0)                  # once 2 is marked, it is the file kept
    _save(tmp_path, 3.0, keep=2.0)
    assert load_checkpoint(tmp_path, 0, 3, 2.0).epochs == 2.0


@pytest.mark.parametrize("text", ['{"epochs": NaN}', '{"epochs": Infinity}', '{"epochs": -1}',
                                  '{"epochs": "3"}', '{"epochs": 1e300}', '{"epochs": true}', "[3]",
                                  "not json", '{"epochs": ' + "[" * 100000 + "]" * 100000 + "}",
                                  '{"epochs": 1, "pad": "' + "x" * 10**6 + '"}'])
def test_a_damaged_manifest_is_one_clear_error(tmp_path, text):
    (tmp_path / MANIFEST).write_text(text)
    with pytest.raises(ValueError, match=r"checkpoint\.json is damaged") as caught:
        complete_epochs(tmp_path)
    assert len(str(caught.value)) < 300


@pytest.mark.parametrize("field, value", [("epochs", np.nan), ("train_time", np.inf), ("train_time", -1.0),
                                          ("updates", -5), ("updates", 1.5), ("w", np.array(["a"] * 3)),
                                          ("w", np.array([np.nan, 0, 0])), ("epochs", np.array([1.0, 2.0])),
                                          ("gamma", 0.0), ("gamma", np.nan), ("gamma", np.array([0.1, 0.2]))])
def test_a_party_file_with_bad_scalars_is_refused(tmp_path, field, value):
    arrays = {"w": np.zeros(3), "epochs": 1.0, "train_time": 0.5, "updates": 3, field: value}
    np.savez(checkpoint_path(tmp_path, 0), **arrays)
    with pytest.raises((ValueError, FileNotFoundError), match=r"damaged|shape"):
        load_checkpoint(tmp_path, 0, 3, 1.0)


def test_the_step_is_kept_with_the_block_and_an_older_file_has_none(tmp_path):
    save_checkpoint(tmp_path, 0, np.ones(3), 1.0, 0.5, 3, gamma=0.125)
    assert load_checkpoint(tmp_path, 0, 3, 1.0).gamma == 0.125
    np.savez(checkpoint_path(tmp_path, 1), w=np.zeros(3), epochs=1.0, train_time=0.5, updates=3)
    assert load_checkpoint(tmp_path, 1, 3, 1.0).gamma is None  # written before the step was kept


def test_a_dominators_sampler_is_kept_and_goes_on_where_it_stood(tmp_path):
    rng = np.random.default_rng([0, 2])
    rng.integers(0, 100, size=(7, 3))
    rng.random(dtype=np.float32)  # leaves half a word cached
    save_checkpoint(tmp_path, 0, np.ones(3), 1.0, 0.5, 3, sampler=sampler_words(rng))
    restored = sampler_from_words(load_checkpoint(tmp_path, 0, 3, 1.0).sampler, "test")
    assert restored.integers(0, 10**9, size=50).tolist() == rng.integers(0, 10**9, size=50).tolist()


@pytest.mark.parametrize("words", [np.arange(5, dtype=np.uint64), np.zeros(6, dtype=np.uint64),
                                   np.array([1, 2, 3, 5, 2, 0], dtype=np.uint64),
                                   np.array([1, 2, 3, 5, 1, 2**33], dtype=np.uint64), np.ones(6)])
def test_a_damaged_sampler_is_refused_before_training(tmp_path, words):
    np.savez(checkpoint_path(tmp_path, 0), w=np.zeros(3), epochs=1.0, train_time=0.5, updates=3,
             sampler=words)
    with pytest.raises((ValueError, FileNotFoundError), match="damaged"):
        load_checkpoint(tmp_path, 0, 3, 1.0)


def test_a_pickled_block_is_not_unpickled(tmp_path):
    np.savez(checkpoint_path(tmp_path, 0), w=np.array([object()], dtype=object), epochs=1.0, train_time=0.5,
             updates=3)
    with pytest.raises((ValueError, FileNotFoundError), match="damaged"):
        load_checkpoint(tmp_path, 0, 1, 1.0)


def test_the_resumed_epoch_is_logged_once(tmp_path):
    """The records from the resumed epoch on (logged before a crash) go: the run logs them again."""
    log = tmp_path / "metrics.jsonl"
    log.write_text("".join(json.dumps({"epoch": e, "loss": 1.0}) + "\n" for e in (0, 1, 2, 3)) + '{"epo')
    metrics_before(log, 2.0)
    assert [json.loads(line)["epoch"] for line in log.read_text().splitlines()] == [0, 1]


def test_a_block_announcing_a_terabyte_is_refused_from_its_header(tmp_path):
    """A planted ``w.npy`` whose header claims 2^40 weights (and holds none) is refused unread."""
    import io
    import zipfile

    def member(array: np.ndarray | None, shape=None) -> bytes:
        buf = io.BytesIO()
        if array is not None:
            np.lib.format.write_array(buf, array)
        else:
            header = {"descr": "<f8", "fortran_order": False, "shape": shape}
            np.lib.format.write_array_header_1_0(buf, header)
        return buf.getvalue()

    with zipfile.ZipFile(checkpoint_path(tmp_path, 0), "w") as zf:
        zf.writestr("w.npy", member(None, (2**40,)))
        for key, value in (("epochs", 1.0), ("train_time", 0.5), ("updates", 3)):
            zf.writestr(f"{key}.npy", member(np.array(value)))
    with pytest.raises(ValueError, match=r"block of shape \(1099511627776,\), this party holds 3"):
        load_checkpoint(tmp_path, 0, 3, 1.0)
