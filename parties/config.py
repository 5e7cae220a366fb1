"""The configuration of one VFB² training job, validated before any rank starts work.

One dataclass, one argument parser, one validation function: ``vfl train``, ``mpirun.sh`` and the
per-rank entry point (``parties.rank``) all go through them, so a bad option is reported once, in
plain words, before ``mpiexec`` is even started.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path

from vfl.algorithms.registry import ALGORITHMS, MODES, get_algorithm

#: ``--updates auto`` goes lazy from this block width: below it the eager kernels' dense loop is
#: cheaper than the lazy bookkeeping (measured: eager faster per update at d_l ≤ 1e3, lazy at 1e4;
#: experiments/results/update_cost).
LAZY_FROM_COLUMNS = 10_000
UPDATES = ("auto", "lazy", "eager")

#: How the labels are protected: not at all (plain VFB²), ε-label-DP by randomized response, or
#: passive parties see ϑ only under additively homomorphic encryption (protocols/label_he.py).
LABEL_PRIVACY = ("none", "dp", "he")
#: What --label-privacy he can run: steps that need only a batch's summed gradient (SAGA keeps ϑ per row).
HE_ALGORITHMS = ("sgd", "svrg")

#: Largest mini-batch: one step's (ϑ, i) message and aggregation request must fit the runtime's
#: receive buffer (``parties.runtime.MAX_MESSAGE_WORDS``).
MAX_BATCH = 4000


class ConfigError(ValueError):
    """A job configuration that cannot run; the message says which option and why."""


EPOCH_SLACK = 1e-9
"""Epoch counts are sums of segment lengths; rounding may leave them this far below a whole epoch."""


@dataclass
class RunConfig:
    """Everything a rank needs to know to play its part. Field docs double as ``--help`` text."""

    parties: int = 4
    active: int = 2
    dataset: str = "breast-cancer"
    party_files: str | None = None
    data_dir: str | None = None
    problem: str = "logistic"
    lam: float = 1e-4
    algorithm: str = "svrg"
    mode: str = "async"
    batch_size: int = 1
    inflight: int = 1
    piggyback: bool = False
    updates: str = "auto"
    saga_table_budget: float = 2.0
    gamma: float = 0.05
    gamma_decay: float = 0.0
    epochs: float = 10.0
    target_suboptimality: float | None = None
    time_limit: float | None = None
    threads: int | None = None
    eval_every: float = 1.0
    snapshot_every: float = 1.0
    seed: int = 0
    straggler: int | None = None
    slowdown: float = 0.4
    apply_delay_ms: float = 0.0
    peer_timeout: float = 30.0
    link_delay_ms: float = 0.0
    link_jitter_ms: float = 0.0
    out: str | None = None
    party_dir: str | None = None
    overwrite: bool = False
    label_privacy: str = "none"
    epsilon: float | None = None
    delta: float = 1e-5
    #: --label-privacy he --epsilon: σ of the Gaussian noise, derived by validation from (ε, δ, passes)
    noise_multiplier: float | None = None
    #: --label-privacy he --epsilon: each party clips its rows' gradients at this quantile of their norms
    clip_quantile: float = 1.0
    he_scheme: str = "ou"
    he_key_bits: int = 2048
    secure_channels: bool = False
    channel_keys: str | None = None
    channel_public_keys: list[str] | None = None
    job_id: str | None = None
    resume: bool = False
    progress: bool = True
    f_star: float | None = None
    #: solve the NonF reference for f* before training (off: progress reports the loss, not f − f*;
    #: for data with n ≪ d, where L-BFGS would run its whole budget)
    reference: bool = True
    allow_two_parties: bool = False
    audit: bool = False

    def gamma_at(self, epochs: float) -> float:
        """The step size in the epoch that ``epochs`` falls in: γ/(1 + decay·e), e = ⌊epochs⌋ (constant γ,
        the paper's, when ``gamma_decay`` is 0). A decaying step lets constant-step SGD's noise floor
        shrink (the label-DP noise of ``--label-privacy he --epsilon`` included: steps are
        post-processing, so the privacy accounting is unchanged)."""
        return self.gamma / (1.0 + self.gamma_decay * math.floor(epochs + EPOCH_SLACK))

    def party_folder(self, rank: int) -> Path:
        """Where party ``rank`` keeps its block and checkpoints: only that rank writes or reads there."""
        if self.party_dir is not None:
            return Path(self.party_dir.format(rank=rank))
        assert self.out is not None, "the launcher sets out before any rank starts"
        return Path(self.out)

    def channel_key_path(self, rank: int) -> Path:
        """Party ``rank``'s private key for ``--secure-channels``, in its own folder."""
        return self.party_folder(rank) / f"party-{rank}.channel.key"

    def lazy_updates(self, block_columns: int) -> bool:
        """Whether a party with this many columns uses the lazy O(nnz) kernels (``--updates``)."""
        if self.label_privacy == "he":  # passive parties step from a summed gradient: eager kernels
            return False
        if self.updates == "auto":
            return block_columns >= LAZY_FROM_COLUMNS
        return self.updates == "lazy"

    @property
    def worker_threads(self) -> int:
        """k, the collaborative worker threads per party: the paper's k = m unless set."""
        return self.threads if self.threads is not None else self.active

    def label_dp_releases(self, n_train: int) -> int:
        """``--label-privacy he --epsilon``: the most batches any one row can be in. Each pass over the
        rows is one permutation cut into ⌊n/B⌋ batches, dealt to the m dominators in turn
        (``parties.runtime``), so a row is in at most one batch a pass; a dominator takes
        ⌈segment·n/(m·B)⌉ steps per segment of ``eval_every`` epochs (``parties.training``) and gets at
        least ⌊⌊n/B⌋/m⌋ batches a pass; a time limit only cuts the run short."""
        per_pass = (n_train // self.batch_size) // self.active
        if per_pass < 1:
            raise ConfigError(f"--label-privacy he --epsilon needs a batch per dominator in each pass: "
                              f"{n_train} rows make {n_train // self.batch_size} batches of "
                              f"{self.batch_size} for {self.active} dominators")
        steps, done = 0, 0.0
        while done < self.epochs - 1e-9:
            segment = min(self.eval_every, self.epochs - done)
            steps += math.ceil(segment * n_train / (self.active * self.batch_size))
            done += segment
        return math.ceil(steps / per_pass)

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls(**json.loads(text))


def validate(config: RunConfig) -> RunConfig:
    """Raise :class:`ConfigError` for anything that cannot run; return the config unchanged."""
    c = config
    if c.parties < 2:
        raise ConfigError(f"--parties must be at least 2 (got {c.parties}): vertical FL needs "
                          "several parties")
    if c.parties == 2 and not c.allow_two_parties:
        raise ConfigError("with 2 parties the secure aggregation cannot hide anything: the root learns the "
                          "other party's partial product w·x from the sum. Use 3 or more parties, or pass "
                          "--allow-two-parties to accept this leak")
    if not 1 <= c.active <= c.parties:
        raise ConfigError(f"--active must be between 1 and --parties={c.parties} (got {c.active})")
    try:
        algorithm = get_algorithm(c.algorithm)
    except ValueError as err:
        raise ConfigError(str(err)) from None
    if c.mode not in MODES:
        raise ConfigError(f"unknown --mode {c.mode!r}; choose one of {', '.join(MODES)}")
    if c.mode not in algorithm.modes:
        raise ConfigError(f"{c.algorithm} runs only with --mode {' or '.join(algorithm.modes)}")
    for name in ("gamma", "epochs", "eval_every", "snapshot_every"):
        if not getattr(c, name) > 0:
            raise ConfigError(f"--{name.replace('_', '-')} must be positive (got {getattr(c, name)})")
    if c.lam < 0:
        raise ConfigError(f"--lam must be non-negative (got {c.lam})")
    if not 0 <= c.gamma_decay < math.inf:
        raise ConfigError(f"--gamma-decay must be a finite number >= 0 (got {c.gamma_decay})")
    if not 1 <= c.batch_size <= MAX_BATCH:
        raise ConfigError(f"--batch-size must be between 1 and {MAX_BATCH} (got {c.batch_size})")
    if c.updates not in UPDATES:
        raise ConfigError(f"unknown --updates {c.updates!r}; choose one of {', '.join(UPDATES)}")
    if not c.saga_table_budget > 0:
        raise ConfigError(f"--saga-table-budget must be positive (GiB), got {c.saga_table_budget}")
    if c.inflight < 1:
        raise ConfigError(f"--inflight must be at least 1 (got {c.inflight})")
    if c.inflight > 1 and c.mode != "async":
        raise ConfigError(f"--inflight {c.inflight} needs --mode async: a synchronous step waits for the "
                          "previous one")
    if c.piggyback and (c.mode != "async" or c.label_privacy == "he"):
        raise ConfigError("--piggyback needs --mode async and no --label-privacy he: a synchronous step "
                          "waits for its acknowledgements before the next request goes out, and under he "
                          "passive parties get ϑ encrypted in their own messages")
    if c.threads is not None and c.threads < 1:
        raise ConfigError(f"--threads must be at least 1 (got {c.threads})")
    if c.straggler is not None and not 0 <= c.straggler < c.parties:
        raise ConfigError(f"--straggler must be a party rank in 0..{c.parties - 1} (got {c.straggler})")
    if c.slowdown < 0:
        raise ConfigError(f"--slowdown must be non-negative (got {c.slowdown})")
    for name in ("link_delay_ms", "link_jitter_ms"):
        if getattr(c, name) < 0:
            raise ConfigError(f"--{name.replace('_ms', '').replace('_', '-')} must be non-negative (ms)")
    if not c.peer_timeout > 0:
        raise ConfigError(f"--peer-timeout must be positive (got {c.peer_timeout})")
    if c.apply_delay_ms < 0:
        raise ConfigError(f"--apply-delay-ms must be non-negative (got {c.apply_delay_ms})")
    if c.target_suboptimality is not None and not c.reference and c.f_star is None:
        raise ConfigError("--target-suboptimality needs f*: drop --no-reference or give --f-star")
    if c.target_suboptimality is not None and c.target_suboptimality <= 0:
        raise ConfigError("--target-suboptimality must be positive")
    if c.time_limit is not None and c.time_limit <= 0:
        raise ConfigError("--time-limit must be positive (seconds)")
    if c.label_privacy not in LABEL_PRIVACY:
        raise ConfigError(f"unknown --label-privacy {c.label_privacy!r}; "
                          f"choose one of {', '.join(LABEL_PRIVACY)}")
    if c.label_privacy == "dp":
        from vfl.problems import PROBLEMS

        if c.problem in PROBLEMS and PROBLEMS[c.problem].task != "binary":
            raise ConfigError("--label-privacy dp protects binary labels (randomized response): "
                              f"--problem {c.problem} is a regression")
        if c.epsilon is None or not 0 < c.epsilon < float("inf"):
            raise ConfigError("--label-privacy dp needs --epsilon, a positive number (e.g. 1, 4, 16)")
        if c.active != 1:
            raise ConfigError("--label-privacy dp needs -m 1: several active parties would each release "
                              "their own noisy labels, and privacy would compose")
        if c.target_suboptimality is not None or c.f_star is not None:
            raise ConfigError("--label-privacy dp does not use f*: f* of the true labels would leak them; "
                              "drop --target-suboptimality / --f-star")
    elif c.epsilon is not None and c.label_privacy != "he":
        raise ConfigError("--epsilon needs --label-privacy dp or he")
    if c.noise_multiplier is not None and (c.label_privacy != "he" or c.epsilon is None):
        raise ConfigError("noise_multiplier is derived from --label-privacy he --epsilon; it cannot be set "
                          "on its own (the noise would have no accounting)")
    if c.label_privacy == "he":
        _validate_he(c)
    if c.channel_keys is not None and not c.secure_channels:
        raise ConfigError("--channel-keys needs --secure-channels")
    if c.party_dir is not None:
        try:
            distinct = {c.party_dir.format(rank=r) for r in range(c.parties)}
        except (KeyError, IndexError, ValueError):
            distinct = set()
        if "{rank}" not in c.party_dir or len(distinct) != c.parties:
            raise ConfigError(f"--party-dir must contain {{rank}} (one folder per party), "
                              f"got {c.party_dir!r}")
    _validate_data(c)
    return c


def _validate_he(c: RunConfig) -> None:
    """What ``--label-privacy he`` runs: SGD and SVRG mini-batches of at least the minimum B."""
    from protocols.label_he import KEY_BITS, MIN_BATCH, SCHEMES

    if c.algorithm not in HE_ALGORITHMS:
        raise ConfigError(f"--label-privacy he runs --algorithm {' or '.join(HE_ALGORITHMS)}: "
                          f"{c.algorithm}'s per-row ϑ table would need ϑ in clear at every party")
    if c.batch_size < MIN_BATCH:
        raise ConfigError(f"--label-privacy he needs --batch-size of at least {MIN_BATCH} (got "
                          f"{c.batch_size}): a passive party learns its batch gradient X_Bᵀϑ, which gives "
                          "away ϑ when B does not exceed its block's columns (B = 1: ϑ = g_j / x_ij)")
    if c.updates == "lazy":
        raise ConfigError("--label-privacy he uses the eager kernels: drop --updates lazy")
    if c.he_scheme not in SCHEMES:
        raise ConfigError(f"unknown --he-scheme {c.he_scheme!r}; choose one of {', '.join(SCHEMES)}")
    if c.he_key_bits not in KEY_BITS:
        raise ConfigError(f"--he-key-bits must be one of {', '.join(map(str, KEY_BITS))} "
                          f"(got {c.he_key_bits})")
    if not 0 < c.clip_quantile <= 1:
        raise ConfigError(f"--clip-quantile must lie in (0, 1] (got {c.clip_quantile})")
    if c.clip_quantile < 1 and (c.label_privacy != "he" or c.epsilon is None):
        raise ConfigError("--clip-quantile sizes the noise of --label-privacy he --epsilon; without "
                          "that noise it would only bias the steps")
    if c.epsilon is not None:
        if not 0 < c.epsilon < float("inf"):
            raise ConfigError(f"--epsilon must be a positive number (got {c.epsilon})")
        if not 0 < c.delta < 1:
            raise ConfigError(f"--delta must lie between 0 and 1 (got {c.delta})")
        if c.algorithm != "sgd":
            raise ConfigError("--label-privacy he --epsilon runs --algorithm sgd: an SVRG snapshot would "
                              "release a full gradient that the per-batch accounting does not cover")
        if c.resume:
            raise ConfigError("--label-privacy he --epsilon cannot --resume: the batch schedule would start "
                              "over, and rows could be in more batches than the privacy accounting allows")
        if c.target_suboptimality is not None:
            raise ConfigError("--label-privacy he --epsilon stops on the epoch or time budget only: a stop "
                              "at a target loss is a decision made from the labels; drop "
                              "--target-suboptimality")


def check_he_features(c: RunConfig, passive_blocks) -> None:
    """Features must fit the fixed point of ``--label-privacy he`` (|x| < 2^VALUE_BITS)."""
    from protocols.label_he import VALUE_BITS

    if c.label_privacy != "he":
        return
    largest = max((float(abs(X).max()) if X.shape[0] * X.shape[1] else 0.0 for X in passive_blocks),
                  default=0.0)
    if not largest < 2.0**VALUE_BITS:  # NaN too
        raise ConfigError(f"--label-privacy he encodes features in fixed point below 2^{VALUE_BITS}; a "
                          f"passive party has |x| = {largest:g}: scale the features first")


def check_he_batch(c: RunConfig, widest_passive_block: int, n_train: int) -> None:
    """B must exceed every passive block's width, or its batch gradient determines ϑ (label_he); so
    must n for SVRG, whose snapshot gives a passive party X_lᵀϑ_0 over all n rows."""
    from protocols.label_he import min_batch

    if c.label_privacy == "he" and c.algorithm == "svrg" and n_train < min_batch(widest_passive_block):
        raise ConfigError(f"--label-privacy he with svrg needs more training rows than a passive block "
                          f"has columns ({n_train} rows, {widest_passive_block} columns): the snapshot's "
                          "X_lᵀϑ_0 would determine ϑ_0; use --algorithm sgd")
    if c.label_privacy == "he" and c.batch_size < min_batch(widest_passive_block):
        raise ConfigError(f"--label-privacy he needs --batch-size of at least "
                          f"{min_batch(widest_passive_block)} here (got {c.batch_size}): a passive block "
                          f"has {widest_passive_block} columns, and with B ≤ that its batch gradient "
                          "X_Bᵀϑ determines ϑ")
    if c.label_privacy == "he" and c.epsilon is not None:  # always derived: never a stale value
        from vfl.label_privacy import gaussian_noise_multiplier

        c.noise_multiplier = gaussian_noise_multiplier(c.epsilon, c.delta, c.label_dp_releases(n_train))


def _validate_data(c: RunConfig) -> None:
    from vfl.problems import PROBLEMS

    if c.problem not in PROBLEMS:
        raise ConfigError(f"unknown --problem {c.problem!r}; choose one of {', '.join(sorted(PROBLEMS))}")
    if c.party_files is not None:
        from vfl.datasets.party_files import find_party_file

        folder = Path(c.party_files)
        from vfl.datasets.csv_parties import is_csv_folder

        if is_csv_folder(folder):
            csv_party_folder.cache_clear()  # read the files as they are now, not as an earlier job saw them
            parties = csv_party_folder(str(folder), c.parties, c.active, PROBLEMS[c.problem].task)
            _check_saga_table(c, parties[0].X_train.shape[0], max(p.n_features for p in parties))
            return
        missing = []
        for p in range(c.parties):
            try:
                find_party_file(folder, p)
            except FileNotFoundError:
                missing.append(f"party-{p}/")
        if missing:
            raise ConfigError(f"--party-files {folder}: missing {', '.join(missing)} (or .npz) "
                              f"(write them with `vfl split`)")
        _check_party_files(c, folder)
        return
    from vfl.datasets import DatasetNotFoundError, get_spec
    from vfl.datasets.registry import resolve_name

    try:
        c.dataset = resolve_name(c.dataset, c.data_dir)  # news20 -> news20-standin without the real file
        spec = get_spec(c.dataset)
    except DatasetNotFoundError as err:
        raise ConfigError(str(err)) from None
    except ValueError as err:
        raise ConfigError(str(err)) from None
    want = PROBLEMS[c.problem].task
    if spec.task != want:
        raise ConfigError(f"--problem {c.problem} is a {want} problem but dataset {c.dataset!r} "
                          f"is {spec.task}")
    try:
        ds = job_dataset(c.dataset, c.seed, c.data_dir)
    except DatasetNotFoundError as err:
        raise ConfigError(str(err)) from None
    if ds.n_features < c.parties:
        raise ConfigError(f"dataset {c.dataset!r} has {ds.n_features} features: cannot give each of "
                          f"{c.parties} parties at least one")
    _check_saga_table(c, ds.n_train, -(-ds.n_features // c.parties))
    if c.active < c.parties:  # random_blocks: near-equal blocks, the widest has ⌈d / q⌉ columns
        check_he_batch(c, -(-ds.n_features // c.parties), ds.n_train)
        check_he_features(c, [ds.X_train])  # which columns go to passive parties is drawn later


@functools.lru_cache(maxsize=1)
def job_dataset(name: str, seed: int, data_dir: str | None):
    """The job's named dataset, loaded once per launcher process (validation, the NonF reference and
    the per-party files all use this one copy; ``job_dataset.cache_clear()`` lets it go)."""
    from vfl.datasets import load

    return load(name, seed=seed, data_dir=data_dir)


@functools.lru_cache(maxsize=1)
def csv_party_folder(folder: str, parties: int, active: int, task: str):
    """A folder of ``party-<p>.csv`` files, loaded and checked once per launcher process (validation and
    the conversion to binary party files share it; ``csv_party_folder.cache_clear()`` lets it go)."""
    from vfl.datasets.csv_parties import load_csv_parties

    try:
        return load_csv_parties(folder, parties, active, task)
    except ValueError as err:
        raise ConfigError(f"--party-files {folder}: {err}") from None


def _check_saga_table(c: RunConfig, n_rows: int, widest_block: int) -> None:
    """Exact SAGA's n × d_l table must fit its budget: refused here rather than by every rank."""
    if c.algorithm != "saga":
        return
    from vfl.algorithms.vfb2 import check_saga_table_budget

    try:
        check_saga_table_budget(n_rows, widest_block, int(c.saga_table_budget * 2**30))
    except ValueError as err:
        raise ConfigError(str(err)) from None


def _check_party_files(c: RunConfig, folder: Path) -> None:
    """Each file loads, labels are where ``--active`` says, and the rows line up across the parties.

    Checked here, before ``mpiexec``, when the files are all on this machine; each rank checks again
    (the ids by digest) in a deployment across hosts.
    """
    from vfl.datasets.party_files import check_aligned, find_party_file, load_party_file
    from vfl.problems import PROBLEMS

    task = PROBLEMS[c.problem].task
    try:
        parties = [load_party_file(find_party_file(folder, p), expect_labels=p < c.active, task=task)
                   for p in range(c.parties)]
        check_aligned(parties)
    except ValueError as err:
        raise ConfigError(f"--party-files {folder}: {err}") from None
    _check_saga_table(c, parties[0].X_train.shape[0], max(p.n_features for p in parties))
    if c.active < c.parties:
        check_he_batch(c, max(p.n_features for p in parties[c.active:]), parties[0].X_train.shape[0])
        check_he_features(c, [p.X_train for p in parties[c.active:]])


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """Add the training options to ``parser`` (or a new one)."""
    p = parser or argparse.ArgumentParser(description="Train a VFB² model over q MPI parties.",
                                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    d = RunConfig()
    p.add_argument("-n", "--parties", type=int, default=d.parties, help="q, number of parties (MPI ranks)")
    p.add_argument("-m", "--active", type=int, default=d.active,
                   help="m, active parties (ranks 0..m-1 hold the labels)")
    p.add_argument("--dataset", default=d.dataset, help="registered dataset name (see `vfl datasets`)")
    p.add_argument("--party-files", default=None,
                   help="folder of per-party files: from `vfl split`, or party-<p>.csv files (e.g. from "
                        "`vfl align`), converted once into the run folder (replaces --dataset)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: $VFL_DATA_DIR, ../shared/data)")
    p.add_argument("--problem", default=d.problem,
                   help="logistic | nonconvex-logistic | least-squares | robust")
    p.add_argument("--lam", type=float, default=d.lam, help="regularisation λ (paper: 1e-4)")
    p.add_argument("--algorithm", "--algo", default=d.algorithm, choices=list(ALGORITHMS),
                   help="; ".join(f"{a.name}: {a.summary}" for a in ALGORITHMS.values()))
    p.add_argument("--mode", default=d.mode, choices=MODES,
                   help="async (VFB²); sync (VFB baseline: each dominator waits for every party's "
                        "acknowledgement); sync-global (also all dominators in lockstep)")
    p.add_argument("-B", "--batch-size", type=int, default=d.batch_size,
                   help="rows per dominated update (1 = the paper's algorithm)")
    p.add_argument("--updates", default=d.updates, choices=UPDATES,
                   help="lazy: O(nnz) per update, dense terms caught up per coordinate when read; eager: "
                        "the paper's O(d_l) loop; auto: lazy from 10,000 columns per party")
    p.add_argument("--saga-table-budget", type=float, default=d.saga_table_budget, metavar="GiB",
                   help="largest n × d_l table exact SAGA may allocate per party (else use saga-scalar)")
    p.add_argument("-P", "--inflight", type=int, default=d.inflight,
                   help="aggregation requests a dominator keeps outstanding (async mode)")
    p.add_argument("--piggyback", action="store_true",
                   help="send each step's (ϑ, i) inside the next step's aggregation request: 3(q − 1) "
                        "messages per update instead of 4(q − 1); the broadcast waits for the next request "
                        "(async mode)")
    p.add_argument("--gamma", type=float, default=d.gamma, help="learning rate γ")
    p.add_argument("--gamma-decay", type=float, default=d.gamma_decay,
                   help="step size γ/(1 + decay·e) in epoch e = 0, 1, ... (0: constant, the paper's)")
    p.add_argument("--epochs", type=float, default=d.epochs, help="stop after this many passes over the data")
    p.add_argument("--target-suboptimality", type=float, default=None,
                   help="stop when f(w) − f* falls below this (f* from the NonF reference)")
    p.add_argument("--time-limit", type=float, default=None, help="stop after this much training time (s)")
    p.add_argument("-k", "--threads", type=int, default=None, help="worker threads per party (default: m)")
    p.add_argument("--eval-every", type=float, default=d.eval_every, help="evaluate every this many epochs")
    p.add_argument("--snapshot-every", type=float, default=d.snapshot_every,
                   help="svrg: a new snapshot (ϑ_0, μ) every this many epochs, the inner loop's length; "
                        "independent of --eval-every (1 = one pass, as run_serial)")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--straggler", type=int, default=None, help="rank of an injected straggler party")
    p.add_argument("--slowdown", type=float, default=d.slowdown, help="straggler's extra time fraction")
    p.add_argument("--apply-delay-ms", type=float, default=d.apply_delay_ms,
                   help="the straggler's workers wait this long before applying each batch of (ϑ, i)")
    p.add_argument("--link-delay", dest="link_delay_ms", type=float, default=d.link_delay_ms, metavar="MS",
                   help="emulated one-way latency: every message between parties is held this long")
    p.add_argument("--link-jitter", dest="link_jitter_ms", type=float, default=d.link_jitter_ms,
                   metavar="MS", help="plus a uniform random extra delay of up to this much")
    p.add_argument("--peer-timeout", type=float, default=d.peer_timeout,
                   help="end the job when a party has been silent this many seconds")
    p.add_argument("--out", default=None,
                   help="folder of this run: metrics, each party's block (default: a new "
                        "runs/<time>-<dataset>, with runs/latest pointing to it)")
    p.add_argument("--party-dir", default=None, metavar="TEMPLATE",
                   help="each party's own folder for its block and checkpoints, e.g. /srv/org{rank}/model "
                        "(default: --out)")
    p.add_argument("--label-privacy", default=d.label_privacy, choices=LABEL_PRIVACY,
                   help="none: passive parties can infer the labels from ϑ; dp: ε-label-DP by randomized "
                        "response on the training labels (needs --epsilon, -m 1); he: passive parties get "
                        "ϑ only encrypted and learn their batch gradients (sgd, -B above every passive "
                        "block's width)")
    p.add_argument("--he-scheme", default=d.he_scheme, choices=("ou", "paillier"),
                   help="additively homomorphic scheme of --label-privacy he (Okamoto–Uchiyama: ~10x faster)")
    p.add_argument("--he-key-bits", type=int, default=d.he_key_bits, choices=(2048, 3072, 4096),
                   help="modulus size of --label-privacy he (2048: 112-bit security, 3072: 128-bit)")
    p.add_argument("--epsilon", type=float, default=None,
                   help="ε of --label-privacy dp (randomized response), or of he: Gaussian noise on every "
                        "batch gradient, calibrated by an RDP accountant (sgd, budget-only stops)")
    p.add_argument("--delta", type=float, default=d.delta, help="δ of --label-privacy he --epsilon")
    p.add_argument("--clip-quantile", type=float, default=d.clip_quantile, metavar="Q",
                   help="--label-privacy he --epsilon: each party computes its gradients from rows clipped "
                        "to the Q-quantile of its rows' norms, and the noise is sized for that bound "
                        "(default 1: the largest row, no clipping; e.g. 0.95 when a few rows are outliers)")
    p.add_argument("--secure-channels", action="store_true",
                   help="seal every message between parties (X25519 + ChaCha20-Poly1305)")
    p.add_argument("--channel-keys", default=None, metavar="FILE",
                   help="JSON list of the parties' public keys (hex, rank order; from `vfl keygen`); "
                        "default: fresh keys in each party's folder")
    p.add_argument("--overwrite", action="store_true", help="reuse an --out folder that holds another run")
    p.add_argument("--resume", action="store_true",
                   help="continue from the newest complete checkpoint in --out (default: runs/latest)")
    p.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    p.add_argument("--f-star", type=float, default=None, help="known optimum f* (skips the NonF solve)")
    p.add_argument("--no-reference", dest="reference", action="store_false",
                   help="skip the NonF solve for f* (progress shows the loss instead of f − f*)")
    p.add_argument("--allow-two-parties", action="store_true",
                   help="accept q = 2, where the aggregate reveals the other party's partial products")
    p.add_argument("--audit", action="store_true",
                   help="each party records every message it receives to <out>/audit-<rank>.npz")
    return p


def from_args(args: argparse.Namespace) -> RunConfig:
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{k: v for k, v in vars(args).items() if k in fields})
