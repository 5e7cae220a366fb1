"""Sealed channels between parties: what another party or someone on the wire cannot do."""

from __future__ import annotations

import numpy as np
import pytest

from protocols.channels import ChannelKeys, generate_key_pair
from protocols.errors import ProtocolViolation
from tests.conftest import run_mpi
from tests.test_runtime import CANCER, metrics, train


@pytest.fixture
def pair():
    (a, pa), (b, pb) = generate_key_pair(), generate_key_pair()
    publics = (pa, pb)
    return (ChannelKeys(a, publics, b"job").channels(0, b"data"),
            ChannelKeys(b, publics, b"job").channels(1, b"data"))


def test_a_sealed_message_opens_only_once_in_order_and_untouched(pair):
    alice, bob = pair
    words = np.arange(5, dtype=np.uint64)
    first, second = alice.seal(1, 7, words), alice.seal(1, 7, words + 1)
    assert not np.array_equal(first[1:6], words)  # the words are not on the wire in clear
    np.testing.assert_array_equal(bob.open(0, 7, first), words)
    with pytest.raises(ProtocolViolation, match="party 0 sent an invalid sealed message: counter 0, "):
        bob.open(0, 7, first)  # replayed
    tampered = second.copy()
    tampered[2] ^= np.uint64(4)
    with pytest.raises(ProtocolViolation, match="authentication failed"):
        bob.open(0, 7, tampered)
    with pytest.raises(ProtocolViolation, match="authentication failed"):
        bob.open(0, 8, second)  # the tag is authenticated too
    np.testing.assert_array_equal(bob.open(0, 7, second), words + 1)


def test_keys_of_another_job_or_plane_do_not_open_a_message():
    (a, pa), (b, pb) = generate_key_pair(), generate_key_pair()
    sealed = ChannelKeys(a, (pa, pb), b"job 1").channels(0, b"data").seal(1, 7, np.arange(3, dtype=np.uint64))

    for job, plane in ((b"job 2", b"data"), (b"job 1", b"full-passes")):
        with pytest.raises(ProtocolViolation, match="authentication failed"):
            ChannelKeys(b, (pa, pb), job).channels(1, plane).open(0, 7, sealed)
    with pytest.raises(ValueError, match="does not match its pinned public key"):
        ChannelKeys(a, (pb, pa), b"job 1").channels(0, b"data")


@pytest.mark.mpi
@pytest.mark.parametrize("scenario", ["tampered", "replayed"])
def test_a_tampered_or_replayed_message_ends_the_job_naming_the_sender(scenario):
    proc = run_mpi(3, ["tests/mpi_scripts/tamper_sealed.py", scenario], timeout=120, check=False)
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "NOT REJECTED" not in output
    assert "party 1 sent an invalid sealed message" in output, output


@pytest.mark.mpi
def test_training_over_channels_sealed_with_the_organisations_own_keys_matches_training_in_clear(tmp_path):
    """The deployment path: each party makes its key pair in its own folder (readable by it only) and
    shares only the public half; the job pins the list. Sealed so, training ends where training in
    clear does; a wrong pin ends the job. (The launcher's own keys, made when no list is given, are
    checked by the network job of tests/test_vertical_nn_runtime.py.)"""
    import contextlib
    import io
    import json

    from vfl.cli import main

    publics = []
    for rank in range(3):  # `vfl keygen` in this process: what the command runs, without 3 interpreters
        out = io.StringIO()
        with contextlib.redirect_stdout(out):
            assert main(["keygen", "--party-dir", str(tmp_path / f"org{rank}"), "--rank", str(rank)]) == 0
        publics.append(out.getvalue().split()[-1])
    assert (tmp_path / "org2" / "party-2.channel.key").stat().st_mode & 0o077 == 0
    (tmp_path / "keys.json").write_text(json.dumps(publics))
    own_keys = ["--secure-channels", "--channel-keys", str(tmp_path / "keys.json"), "--party-dir",
                str(tmp_path / "org{rank}")]
    train(tmp_path / "clear", "-n", "3", "-m", "1", "--algorithm", "svrg", "--epochs", "3", *CANCER)
    train(tmp_path / "sealed", "-n", "3", "-m", "1", "--algorithm", "svrg", "--epochs", "3", *own_keys,
          *CANCER)
    clear, sealed = metrics(tmp_path / "clear")[-1], metrics(tmp_path / "sealed")[-1]
    assert sealed["epoch"] == 3 and sealed["loss"] == pytest.approx(clear["loss"], rel=1e-3)
    publics[1], publics[2] = publics[2], publics[1]  # a wrong pin: party 1 cannot prove who it is
    (tmp_path / "keys.json").write_text(json.dumps(publics))
    proc = train(tmp_path / "sealed", "-n", "3", "-m", "1", "--epochs", "1", "--overwrite", *own_keys,
                 *CANCER, check=False)
    assert proc.returncode != 0 and "does not match its pinned public key" in proc.stdout + proc.stderr
