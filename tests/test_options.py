"""The user's options (parties.config) against the job plan (parties.plan): the options are frozen
and described by one table, validation reads no file and returns what it was given, and the segment
schedule that the training loop takes is the one the label-DP accounting counts."""

from __future__ import annotations

import builtins
import contextlib
import dataclasses
import math
import pathlib
from unittest import mock

import numpy as np
import pytest

from parties.config import (
    HE_KEY_BITS,
    HE_SCHEMES,
    ConfigError,
    RunConfig,
    build_parser,
    from_args,
    long_flag,
    validate,
)
from parties.plan import JobPlan, label_dp_releases, next_segment, resolve, segment_quota, segment_schedule


def test_options_are_frozen_and_the_plan_too():
    options = RunConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        options.out = "/tmp/elsewhere"  # type: ignore[misc]
    plan = JobPlan.of(options)
    with pytest.raises(dataclasses.FrozenInstanceError):
        plan.party_files = "/tmp/elsewhere"  # type: ignore[misc]
    # the plan reads every option by its own name (what the ranks and the runtime read)
    assert plan.batch_size == options.batch_size and plan.worker_threads == options.active
    assert dataclasses.replace(plan, out="/x").out == "/x" and plan.out is None


@contextlib.contextmanager
def no_files():
    """Any attempt to read a file inside the block fails the test (the modules validation imports are
    imported first: a module's own set-up may read a file, and that is no data)."""
    import protocols.label_he  # noqa: F401
    import vertical.problems  # noqa: F401

    def refuse(*args, **kwargs):
        raise AssertionError(f"validate read a file: {args[:1]}")

    with contextlib.ExitStack() as stack:
        stack.enter_context(mock.patch.object(builtins, "open", refuse))
        for name in ("read_text", "read_bytes", "open", "exists", "is_dir", "iterdir", "glob", "stat"):
            stack.enter_context(mock.patch.object(pathlib.Path, name, refuse))
        stack.enter_context(mock.patch.object(np, "load", refuse))
        stack.enter_context(mock.patch.object(np, "loadtxt", refuse))
        yield


GOOD = [RunConfig(), RunConfig(parties=3, active=1, dataset="news20", data_dir="/no/such/folder"),
        RunConfig(parties=3, active=1, party_files="/no/such/files", algorithm="saga"),
        RunConfig(parties=3, active=1, label_privacy="he", algorithm="sgd", batch_size=64, epsilon=1.0),
        RunConfig(parties=3, active=1, label_privacy="dp", epsilon=4.0, dataset="no-such-dataset")]


@pytest.mark.parametrize("options", GOOD)
def test_validate_reads_no_file_and_returns_its_input(options):
    before = dataclasses.replace(options)
    with no_files():
        validated = validate(options)
    assert validated is options
    assert options == before


@pytest.mark.parametrize("bad, message", [
    (dict(batch_size=0), "--batch-size must be between 1 and 4000 (got 0)"),
    (dict(parties=1), "--parties must be at least 2 (got 1): vertical FL needs several parties"),
    (dict(link_delay_ms=-1.0), "--link-delay must be non-negative (ms)"),
    (dict(saga_table_budget=0.0), "--saga-table-budget must be positive (GiB), got 0.0"),
    (dict(mode="later"), "unknown --mode 'later'; choose one of async, sync, sync-global"),
    (dict(algorithm="adam"), "unknown --algorithm 'adam'; choose one of"),
    (dict(problem="hinge"), "unknown --problem 'hinge'; choose one of"),
    (dict(he_key_bits=1024), "--he-key-bits must be one of 2048, 3072, 4096 (got 1024)"),
    (dict(time_limit=0.0), "--time-limit must be positive (seconds)"),
    (dict(active=5), "--active must be between 1 and --parties=4 (got 5)"),
    (dict(inflight=257), "--inflight must be between 1 and 256 (got 257)"),  # every party holds that many
])
def test_bad_options_fail_in_one_line_without_reading_files(bad, message):
    options = RunConfig(**bad)
    with pytest.raises(ConfigError) as caught, no_files():
        validate(options)
    assert str(caught.value).startswith(message) and "\n" not in str(caught.value)


def test_every_option_is_one_row_of_the_parser():
    parser = build_parser()
    text = parser.format_help()
    for f in dataclasses.fields(RunConfig):
        assert long_flag(f.name) in text
    assert from_args(parser.parse_args([])) == RunConfig()  # the parser's defaults are the table's
    parsed = from_args(parser.parse_args(["--link-delay", "5", "--no-progress", "--algo", "sgd", "-B", "8"]))
    assert (parsed.link_delay_ms, parsed.progress, parsed.algorithm, parsed.batch_size) == \
        (5.0, False, "sgd", 8)
    assert RunConfig.from_json(parsed.to_json()) == parsed


def test_the_he_choices_are_the_protocols():
    from protocols.label_he import KEY_BITS, SCHEMES

    assert (tuple(SCHEMES), tuple(KEY_BITS)) == (HE_SCHEMES, HE_KEY_BITS)


def test_the_plan_round_trips_through_config_json():
    plan = dataclasses.replace(JobPlan.of(RunConfig(parties=3, active=1, secure_channels=True)), out="/r",
                               party_files="/r/parties", dataset="breast-cancer", f_star=0.25,
                               job_id="ab", channel_public_keys=("01", "02", "03"))
    assert JobPlan.from_json(plan.to_json()).to_json() == plan.to_json()
    assert JobPlan.from_json(plan.to_json()).channel_public_keys == ("01", "02", "03")


def test_the_accounting_counts_the_training_loops_segments():
    """label_dp_releases sums the quotas of segment_schedule, built from next_segment/segment_quota,
    the functions the training loop calls; a decaying step cuts segments at whole epochs, and those
    cuts add steps (each segment's quota rounds up)."""
    options = RunConfig(parties=3, active=1, batch_size=64, epochs=3.0, eval_every=0.7, gamma_decay=0.5)
    segments = [s for s, _ in segment_schedule(options, 455)]
    assert segments == pytest.approx([0.7, 0.3, 0.7, 0.3, 0.7, 0.3])
    assert segments[1] == pytest.approx(next_segment(options, 0.7))
    steps = sum(segment_quota(options, s, 455) for s in segments)
    assert steps == sum(q for _, q in segment_schedule(options, 455)) == 3 * (5 + 3)
    assert label_dp_releases(options, 455) == math.ceil(steps / (455 // 64))
    # SVRG's snapshots cut segments too
    svrg = RunConfig(epochs=2.0, eval_every=1.0, snapshot_every=0.5)
    assert [s for s, _ in segment_schedule(svrg, 100, snapshots=True)] == pytest.approx([0.5] * 4)


@pytest.mark.mpi
def test_a_run_takes_exactly_the_accounted_steps(tmp_path):
    """The dominated updates of a real run are the schedule's quotas (m dominators each)."""
    from tests.test_runtime import metrics, train

    args = ["-n", "3", "-m", "2", "--dataset", "breast-cancer", "--algorithm", "sgd", "-B", "16",
            "--epochs", "2", "--eval-every", "0.7", "--gamma-decay", "0.5", "--no-reference"]
    train(tmp_path, *args)
    options = RunConfig(parties=3, active=2, algorithm="sgd", batch_size=16, epochs=2.0, eval_every=0.7,
                        gamma_decay=0.5)
    expected = [2 * q for _, q in segment_schedule(options, 455)]
    updates = [r["updates"] for r in metrics(tmp_path)]
    assert np.diff(updates).tolist() == expected


def test_resolve_derives_what_the_data_decides():
    plan = resolve(RunConfig(parties=3, active=1, label_privacy="he", algorithm="sgd", batch_size=64,
                             epsilon=1.0))
    assert plan.noise_multiplier is not None and plan.noise_multiplier > 0
    assert plan.options.out is None and plan.dataset == "breast-cancer"
    with pytest.raises(ConfigError, match="cannot give each of 40 parties"):
        resolve(RunConfig(parties=40, active=1))


def test_a_csv_folder_gets_the_same_he_checks_and_noise_as_other_data(tmp_path):
    """The noise multiplier is derived for every kind of data: a folder of party-<p>.csv files too."""
    from tests.test_csv_party_folders import write_folder

    rows = range(40)
    active = "id,a,label,split\n" + "".join(f"{i},{i / 40},{i % 2},train\n" for i in rows)
    passive = "id,b,split\n" + "".join(f"{i},{(i * 7) % 40 / 40},train\n" for i in rows)
    folder = write_folder(tmp_path / "csv", active, passive, passive.replace(",b,", ",c,"))
    options = RunConfig(parties=3, active=1, party_files=str(folder), label_privacy="he", algorithm="sgd",
                        batch_size=16, epsilon=1.0, epochs=1.0)
    plan = resolve(options)
    assert plan.noise_multiplier is not None and plan.noise_multiplier > 0
    assert plan.party_files == str(folder) and plan.options is options
