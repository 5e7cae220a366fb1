"""The job plan: the user's options plus what the launcher resolved from them and from the data.

:func:`resolve` checks what needs the data (shapes, SAGA's table, the ``--label-privacy he`` feature
and batch limits, the per-party files), resolves the dataset's name and derives the DP noise
multiplier; the launcher then adds the run folder, the party files it wrote, f* and the channel keys
(``dataclasses.replace``). The plan is written once to ``<out>/config.json`` and is what every rank
reads (:mod:`parties.rank`, :mod:`parties.predict`): nothing changes it after that.

The segment schedule (:func:`next_segment`, :func:`segment_quota`) lives here too, read by both the
training loop (:mod:`parties.training`) and the label-DP accounting (:func:`label_dp_releases`), so the
number of batches a row can be in is counted from the very steps the loop takes.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from parties.config import EPOCH_SLACK, ConfigError, RunConfig, validate

if TYPE_CHECKING:
    from protocols.channels import ChannelKeys

_OPTION_NAMES = frozenset(f.name for f in dataclasses.fields(RunConfig))


@dataclass(frozen=True)
class JobPlan:
    """The options and what was resolved for this job; an option's name reads the option.

    ``out``, ``party_files``, ``dataset`` and ``f_star`` are the resolved values (the run folder, the
    files the ranks read, the dataset's real name, the reference f*); every other option name
    (``plan.batch_size``, ``plan.gamma_at(e)``) reads :attr:`options`, so the ranks see one object
    with the names they always used.
    """

    options: RunConfig
    out: str | None = None
    party_files: str | None = None
    dataset: str = ""
    f_star: float | None = None
    #: --label-privacy he --epsilon: σ of the Gaussian noise on every ϑ, from (ε, δ, releases); else None
    noise_multiplier: float | None = None
    job_id: str | None = None
    channel_public_keys: tuple[str, ...] | None = None
    #: this party's private channel key when it is not in its folder (``vfl party --key``)
    channel_key_file: str | None = None

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__") or name == "options":  # copy/pickle probe before __init__ ran
            raise AttributeError(name)
        return getattr(self.options, name)

    @classmethod
    def of(cls, options: RunConfig) -> JobPlan:
        """A plan that resolves nothing: the options' own out, party files, dataset and f*."""
        return cls(options, out=options.out, party_files=options.party_files, dataset=options.dataset,
                   f_star=options.f_star)

    def party_folder(self, rank: int) -> Path:
        """Where party ``rank`` keeps its block and checkpoints: only that rank writes or reads there."""
        if self.options.party_dir is not None:
            return Path(self.options.party_dir.format(rank=rank))
        assert self.out is not None, "the launcher sets out before any rank starts"
        return Path(self.out)

    def channel_key_path(self, rank: int) -> Path:
        """Party ``rank``'s private key for ``--secure-channels``, in its own folder (or where
        ``vfl party --key`` says: a plan of one party, :mod:`parties.federation.member`)."""
        if self.channel_key_file is not None:
            return Path(self.channel_key_file)
        return self.party_folder(rank) / f"party-{rank}.channel.key"

    def sealing_keys(self, rank: int) -> ChannelKeys | None:
        """Party ``rank``'s keys for sealed channels (``--secure-channels``), its private key read from
        its own folder; None for a run in clear. Training and ``vfl serve`` both open channels with it."""
        if not self.secure_channels:
            return None
        from protocols.channels import ChannelKeys

        assert self.channel_public_keys is not None and self.job_id is not None, "set by the launcher"
        path = self.channel_key_path(rank)
        try:
            private = path.read_bytes()
        except OSError as err:
            raise FileNotFoundError(f"party {rank}: no private channel key at {path} ({err.strerror}); "
                                    "make one with `vfl keygen`") from None
        return ChannelKeys(private, tuple(bytes.fromhex(k) for k in self.channel_public_keys),
                           bytes.fromhex(self.job_id))

    def to_json(self) -> str:
        """One flat object: the options, with the resolved values in place of the requested ones, and
        under ``"options"`` the options as the user gave them (what ``--resume`` compares with)."""
        record = dataclasses.asdict(self.options)
        record.update({f.name: getattr(self, f.name) for f in dataclasses.fields(self)
                       if f.name != "options"})
        if self.channel_public_keys is not None:
            record["channel_public_keys"] = list(self.channel_public_keys)
        record["options"] = dataclasses.asdict(self.options)
        return json.dumps(record, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> JobPlan:
        record = json.loads(text)
        given = record.get("options", record) if isinstance(record, dict) else None  # flat: an older plan
        if not isinstance(given, dict):
            raise ValueError("not a JSON object of a plan's options")
        fields = {k: v for k, v in given.items() if k in _OPTION_NAMES}
        fields.setdefault("standardize", "off")  # a run from before --standardize: its data as given
        options = RunConfig(**fields)
        keys = record.get("channel_public_keys")
        return cls(options, out=record.get("out"), party_files=record.get("party_files"),
                   dataset=record["dataset"], f_star=record.get("f_star"),
                   noise_multiplier=record.get("noise_multiplier"), job_id=record.get("job_id"),
                   channel_public_keys=None if keys is None else tuple(keys),
                   channel_key_file=record.get("channel_key_file"))


# ------------------------------------------------------------------------- what only the leader reads

#: The leader's own file, in its party folder: what the job needs but the shared config.json must not
#: carry under ``--label-privacy dp|he`` (f*, a function of all the labels).
LEADER_ONLY = "leader-only.json"


def shared_part(plan: JobPlan) -> tuple[JobPlan, dict[str, Any]]:
    """The plan every rank reads, and what goes to the leader's own file instead (:data:`LEADER_ONLY`).

    Under ``--label-privacy dp|he`` a passive party must learn nothing computed from the labels, and
    f* (given with ``--f-star``) is: it stays out of ``config.json`` and only the leader reads it. With
    no label privacy a passive party learns the labels from ϑ anyway, so f* stays in the plan."""
    if plan.label_privacy == "none" or plan.f_star is None:
        return plan, {}
    shared = dataclasses.replace(plan, f_star=None, options=dataclasses.replace(plan.options, f_star=None))
    return shared, {"f_star": plan.f_star}


def leader_view(plan: JobPlan, rank: int) -> JobPlan:
    """The plan as party ``rank`` uses it: the leader (rank 0) adds its own file's values."""
    path = plan.party_folder(0) / LEADER_ONLY
    if rank != 0 or not path.exists():
        return plan
    f_star = json.loads(path.read_text()).get("f_star")  # only ever --f-star: no reference under dp|he
    return dataclasses.replace(plan, f_star=f_star, options=dataclasses.replace(plan.options, f_star=f_star))


def resolve(options: RunConfig) -> JobPlan:
    """Validate the options, check them against the data, and derive what the data decides.

    Raises :class:`ConfigError` (one line) for anything that cannot run. The run folder, written party
    files, f* and channel keys are the launcher's to add (:func:`parties.launch.prepare`).
    """
    validate(options)
    if options.party_files is not None:
        n_train = _check_party_files(options, Path(options.party_files))
        dataset = options.dataset
    else:
        dataset, n_train = _check_dataset(options)
    return dataclasses.replace(JobPlan.of(options), dataset=dataset,
                               noise_multiplier=noise_multiplier(options, n_train))


# --------------------------------------------------------------------------- the segment schedule


def next_segment(options: RunConfig, done: float, next_snapshot: float | None = None) -> float:
    """The length in epochs of the segment that starts after ``done`` epochs: ``eval_every``, cut at
    the end of the run, at the next whole epoch when the step decays (the step changes only there),
    and at the next SVRG snapshot (``next_snapshot``, when the rule takes snapshots)."""
    segment = min(options.eval_every, options.epochs - done)
    if options.gamma_decay:
        segment = min(segment, math.floor(done + EPOCH_SLACK) + 1 - done)
    if next_snapshot is not None:
        segment = min(segment, next_snapshot - done)
    return segment


def segment_quota(options: RunConfig, segment: float, n_train: int) -> int:
    """Steps each dominator takes in a segment: ⌈segment·n/(m·B)⌉ (all m together cover the segment)."""
    return math.ceil(segment * n_train / (options.active * options.batch_size))


def segment_schedule(options: RunConfig, n_train: int, *, snapshots: bool = False
                     ) -> Iterator[tuple[float, int]]:
    """(segment, quota) of a whole run from epoch 0 that no time limit cuts short, as the training
    loop takes them (``snapshots``: an SVRG snapshot every ``snapshot_every`` epochs)."""
    done, next_snapshot = 0.0, 0.0
    while done < options.epochs - EPOCH_SLACK:
        if snapshots and done >= next_snapshot - EPOCH_SLACK:
            next_snapshot = done + options.snapshot_every
        segment = next_segment(options, done, next_snapshot if snapshots else None)
        yield segment, segment_quota(options, segment, n_train)
        done += segment


def label_dp_releases(options: RunConfig, n_train: int) -> int:
    """``--label-privacy he --epsilon``: the most batches any one row can be in. Each pass over the
    rows is one permutation cut into ⌊n/B⌋ batches, dealt to the m dominators in turn
    (``parties.runtime``), so a row is in at most one batch a pass; a dominator takes the quotas of
    :func:`segment_schedule` and gets at least ⌊⌊n/B⌋/m⌋ batches a pass; a time limit only cuts the run
    short."""
    per_pass = (n_train // options.batch_size) // options.active
    if per_pass < 1:
        raise ConfigError(f"--label-privacy {options.label_privacy} --epsilon needs a batch per dominator in "
                          f"each pass: "
                          f"{n_train} rows make {n_train // options.batch_size} batches of "
                          f"{options.batch_size} for {options.active} dominators")
    steps = sum(quota for _, quota in segment_schedule(options, n_train))
    return math.ceil(steps / per_pass)


def noise_multiplier(options: RunConfig, n_train: int) -> float | None:
    """σ of ``--label-privacy he --epsilon`` or ``dp-theta`` (None without it): the smallest that meets
    (ε, δ) over the job's :func:`label_dp_releases`. Always derived, never read from a file: no stale
    value."""
    if options.label_privacy == "dp-theta" and options.epsilon is not None:
        from vertical.label_privacy import gaussian_noise_multiplier

        releases = label_dp_releases(options, n_train)  # checks every dominator has a batch a pass
        if options.theta_noise == "per-row":  # one draw per row: one release (vertical/nn/protection.py)
            releases = 1
        return gaussian_noise_multiplier(options.epsilon, options.delta, releases)
    if options.label_privacy != "he" or options.epsilon is None or options.active == options.parties:
        return None  # the noise hides ϑ's labels from passive parties: without them there is none
    from protocols.label_he import VALUE_BITS
    from vertical.label_privacy import gaussian_noise_multiplier

    sigma = gaussian_noise_multiplier(options.epsilon, options.delta, label_dp_releases(options, n_train))
    if sigma > 2.0**VALUE_BITS / 16:  # a draw of 16σ (probability 1e-57) still fits the fixed point
        raise ConfigError(f"--epsilon {options.epsilon:g} needs noise of σ = {sigma:.3g} on every ϑ, beyond "
                          f"what the encryption's fixed point holds (2^{VALUE_BITS}/16); raise ε or δ")
    return sigma


# ------------------------------------------------------------------------------ checks of the data


def _check_dataset(c: RunConfig) -> tuple[str, int]:
    """A named dataset: its real name (``news20`` -> ``news20-standin`` without the real file), and
    its training rows, once it is known to fit the job."""
    from vertical.datasets import DatasetNotFoundError, get_spec
    from vertical.datasets.registry import resolve_name
    from vertical.problems import PROBLEMS

    try:
        name = resolve_name(c.dataset, c.data_dir)
        spec = get_spec(name)
    except (DatasetNotFoundError, ValueError) as err:
        raise ConfigError(str(err)) from None
    want = PROBLEMS[c.problem].task
    if spec.task != want and not (c.model != "linear" and spec.task == "multiclass"):
        raise ConfigError(f"--problem {c.problem} is a {want} problem but dataset {name!r} is {spec.task}")
    if spec.task == "multiclass" and c.label_privacy == "dp":
        raise ConfigError(f"--label-privacy dp flips binary labels (randomized response): dataset {name!r} "
                          "has more classes")
    try:
        ds = job_dataset(name, c.seed, c.data_dir)
    except DatasetNotFoundError as err:
        raise ConfigError(str(err)) from None
    if ds.n_features < c.parties:
        raise ConfigError(f"dataset {name!r} has {ds.n_features} features: cannot give each of "
                          f"{c.parties} parties at least one")
    widest = -(-ds.n_features // c.parties)  # random_blocks: near-equal blocks of at most ⌈d / q⌉ columns
    _check_saga_table(c, ds.n_train, widest)
    if c.active < c.parties:
        check_he_batch(c, widest, ds.n_train)
        check_he_features(c, [ds.X_train])  # which columns go to passive parties is drawn later
    return name, ds.n_train


def _check_party_files(c: RunConfig, folder: Path) -> int:
    """Each file (or ``party-<p>.csv``) loads, labels are where ``--active`` says, and the rows line up
    across the parties; returns the training rows.

    Checked here, before ``mpiexec``, when the files are all on this machine; each rank checks again
    (the ids by digest) in a deployment across hosts.
    """
    from vertical.datasets.csv_parties import is_csv_folder
    from vertical.problems import PROBLEMS

    task = PROBLEMS[c.problem].task
    if is_csv_folder(folder):
        csv_party_folder.cache_clear()  # read the files as they are now, not as an earlier job saw them
        parties = csv_party_folder(str(folder), c.parties, c.active, task)
    else:  # a network classifies binary or multiclass labels (parties/party_model.py)
        parties = _load_party_files(c, folder, task if c.model == "linear" else None)
        if c.model != "linear" and parties[0].task not in ("binary", "multiclass"):
            raise ConfigError(f"--party-files {folder}: --model mlp classifies, and the files hold "
                              f"{parties[0].task} labels")
        if parties[0].task == "multiclass" and c.label_privacy == "dp":
            raise ConfigError(f"--party-files {folder}: --label-privacy dp flips binary labels "
                              "(randomized response), and these have more classes")
    n_train = parties[0].X_train.shape[0]
    _check_saga_table(c, n_train, max(p.n_features for p in parties))
    if c.active < c.parties:
        check_he_batch(c, max(p.n_features for p in parties[c.active:]), n_train)
        check_he_features(c, [p.X_train for p in parties[c.active:]])
    return n_train


def _load_party_files(c: RunConfig, folder: Path, task: str | None) -> list:
    from vertical.datasets.party_files import check_aligned, find_party_file, load_party_file

    missing = []
    for p in range(c.parties):
        try:
            find_party_file(folder, p)
        except FileNotFoundError:
            missing.append(f"party-{p}/")
    if missing:
        raise ConfigError(f"--party-files {folder}: missing {', '.join(missing)} (or .npz) "
                          f"(write them with `vfl split`)")
    try:
        parties = [load_party_file(find_party_file(folder, p), expect_labels=p < c.active, task=task)
                   for p in range(c.parties)]
        check_aligned(parties)
    except ValueError as err:
        raise ConfigError(f"--party-files {folder}: {err}") from None
    return parties


def _check_saga_table(c: RunConfig, n_rows: int, widest_block: int) -> None:
    """Exact SAGA's n × d_l table must fit its budget: refused here rather than by every rank."""
    if c.algorithm != "saga":
        return
    from vertical.algorithms.vfb2 import check_saga_table_budget

    try:
        check_saga_table_budget(n_rows, widest_block, int(c.saga_table_budget * 2**30))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def check_he_features(c: RunConfig, passive_blocks) -> None:
    """Features must fit the fixed point of ``--label-privacy he`` (|x| < 2^VALUE_BITS)."""
    if c.label_privacy != "he" or c.standardize != "off":
        # scaled (non-zero values' root mean square, or spread), no training value exceeds √n; and before
        # the import: protocols brings mpi4py.MPI, which a launcher must not load
        return
    from protocols.label_he import VALUE_BITS

    largest = max((float(abs(X).max()) if X.shape[0] * X.shape[1] else 0.0 for X in passive_blocks),
                  default=0.0)
    if not largest < 2.0**VALUE_BITS:  # NaN too
        raise ConfigError(f"--label-privacy he encodes features in fixed point below 2^{VALUE_BITS}; a "
                          f"passive party has |x| = {largest:g}: scale the features first")


def check_he_batch(c: RunConfig, widest_passive_block: int, n_train: int) -> None:
    """B must exceed every passive block's width, or its batch gradient determines ϑ (label_he); so
    must n for SVRG, whose snapshot gives a passive party X_lᵀϑ_0 over all n rows."""
    if c.label_privacy != "he":
        return  # before the import, as above
    from protocols.label_he import min_batch

    if c.algorithm == "svrg" and n_train < min_batch(widest_passive_block):
        raise ConfigError(f"--label-privacy he with svrg needs more training rows than a passive block "
                          f"has columns ({n_train} rows, {widest_passive_block} columns): the snapshot's "
                          "X_lᵀϑ_0 would determine ϑ_0; use --algorithm sgd")
    if c.batch_size < min_batch(widest_passive_block):
        raise ConfigError(f"--label-privacy he needs --batch-size of at least "
                          f"{min_batch(widest_passive_block)} here (got {c.batch_size}): a passive block "
                          f"has {widest_passive_block} columns, and with B ≤ that its batch gradient "
                          "X_Bᵀϑ determines ϑ")


@functools.lru_cache(maxsize=1)
def job_dataset(name: str, seed: int, data_dir: str | None):
    """The job's named dataset, loaded once per launcher process (the checks, the NonF reference and
    the per-party files all use this one copy; ``job_dataset.cache_clear()`` lets it go)."""
    from vertical.datasets import load

    return load(name, seed=seed, data_dir=data_dir)


@functools.lru_cache(maxsize=1)
def csv_party_folder(folder: str, parties: int, active: int, task: str):
    """A folder of ``party-<p>.csv`` files, loaded and checked once per launcher process (the checks and
    the conversion to binary party files share it; ``csv_party_folder.cache_clear()`` lets it go)."""
    from vertical.datasets.csv_parties import load_csv_parties

    try:
        return load_csv_parties(folder, parties, active, task)
    except ValueError as err:
        raise ConfigError(f"--party-files {folder}: {err}") from None
