"""The options of one VFB² training job: what the user asked for, checked before any rank starts.

:class:`RunConfig` is the declarative table of the options: each field is one row that says the
option's name, type, default, flags, help text and allowed values (:func:`option`). The argument
parser (:func:`build_parser`, hence ``vfl train --help``) and the per-option range checks of
:func:`validate` are generated from it, so a new option is one row. The options are frozen: what the
launcher derives from them and from the data (f*, the party files, the run folder, the DP noise) is
the job plan of :mod:`parties.plan`, never written back here. :func:`validate` looks at the options
alone (no file is read) and returns them as they were. A row marked ``budget`` may change when a run
is resumed; every other row defines the model and ``--resume`` keeps the run's (:mod:`parties.resume`).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import typing
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

from parties.engine import ENGINES, engine_refusal
from vertical.algorithms.registry import ALGORITHMS, MODES, get_algorithm
from vertical.standardize import MODES as STANDARDIZE_MODES

#: ``--updates auto`` goes lazy from this block width: below it the eager kernels' dense loop is
#: cheaper than the lazy bookkeeping (measured: eager faster per update at d_l ≤ 1e3, lazy at 1e4;
#: experiments/results/update_cost).
LAZY_FROM_COLUMNS = 10_000
UPDATES = ("auto", "lazy", "eager")

#: How the labels are protected: not at all (plain VFB²), ε-label-DP by randomized response, or
#: passive parties see ϑ only under additively homomorphic encryption (protocols/label_he.py); for
#: networks (--model mlp), each row's vector ϑ clipped and noised (vertical/nn/protection.py).
LABEL_PRIVACY = ("none", "dp", "he", "dp-theta")
#: What --label-privacy he can run: steps that need only a batch's summed gradient (SAGA keeps ϑ per row).
HE_ALGORITHMS = ("sgd", "svrg")
#: protocols.label_he's SCHEMES and KEY_BITS (tests/test_options.py checks that they agree).
HE_SCHEMES = ("ou", "paillier")
HE_KEY_BITS = (2048, 3072, 4096)

#: --standardize: scale each column by its root mean square, centre and scale it, or neither.
STANDARDIZE = STANDARDIZE_MODES

#: --model: VFB²'s linear model, or a network per party (vertical/nn, parties/party_model.py).
MODELS = ("linear", "mlp")
#: --model mlp's networks by default: two layers per party to a cut layer of 16, one hidden top layer.
DEFAULT_BOTTOM = "*-64-16"
DEFAULT_TOP = "*-*"

#: Largest mini-batch: one step's (ϑ, i) message and aggregation request must fit the runtime's
#: receive buffer (``parties.runtime.MAX_MESSAGE_WORDS``).
MAX_BATCH = 4000


class ConfigError(ValueError):
    """A job configuration that cannot run; the message says which option and why."""


EPOCH_SLACK = 1e-9
"""Epoch counts are sums of segment lengths; rounding may leave them this far below a whole epoch."""


# ------------------------------------------------------------------------------------- the table


@dataclass(frozen=True)
class Check:
    """An option's allowed values: ``ok(value)`` must hold; ``message`` is formatted with ``flag`` and
    ``value`` (an unset option, None, is not checked)."""

    ok: Callable[[Any], bool]
    message: str


def positive(suffix: str = " (got {value})") -> Check:
    return Check(lambda v: v > 0, "{flag} must be positive" + suffix)


def non_negative(suffix: str = " (got {value})") -> Check:
    return Check(lambda v: v >= 0, "{flag} must be non-negative" + suffix)


#: Most aggregation requests a dominator may keep open (``--inflight``): every other party holds the
#: partial sums of that many requests per dominator, and refuses more (``parties/data_plane.py``).
MAX_INFLIGHT = 256


def at_least(low: int, suffix: str = "") -> Check:
    return Check(lambda v: v >= low, f"{{flag}} must be at least {low} (got {{value}}){suffix}")


def between(low: float, high: float) -> Check:
    return Check(lambda v: low <= v <= high, f"{{flag}} must be between {low} and {high} (got {{value}})")


def one_of(choices: tuple) -> Check:
    return Check(lambda v: v in choices, "unknown {flag} {value!r}; choose one of " + ", ".join(choices))


def _step_or_auto(text: str) -> float | None:
    """``--gamma``: a number, or ``auto`` (None: derived from the data at start, ``parties.step``)."""
    return None if text.strip().lower() == "auto" else float(text)


def option(default: Any, *flags: str, help: str | None = None, check: Check | None = None,
           parse: Callable[[str], Any] | None = None,
           choices: tuple | None = None, metavar: str | None = None, budget: bool = False,
           spelled: str | None = None) -> Any:
    """One row of the table: the field's default plus how the command line spells and checks it.
    ``choices`` restrict the parser; validation checks them too unless ``check`` says otherwise.
    ``budget``: the option may change when a run is resumed (how long it trains, what it shows, where
    it is); every other option defines the model, and ``--resume`` keeps the run's (parties.resume).
    ``parse``: how the command line's text becomes the value (default: the field's type).
    ``spelled``: the default as the command line spells it (``--help`` shows it; ``parse`` reads it)."""
    if choices is not None and check is None:
        check = one_of(choices)
    return field(default=default, metadata={"flags": flags, "help": help, "check": check, "parse": parse,
                                            "choices": choices, "metavar": metavar, "budget": budget,
                                            "spelled": spelled})


def _algorithm_help() -> str:
    return "; ".join(f"{a.name}: {a.summary}" for a in ALGORITHMS.values())


def _known_algorithm(name: str) -> bool:
    return name in ALGORITHMS


_ALGORITHM_CHECK = Check(_known_algorithm, "unknown {flag} {value!r}; choose one of " + ", ".join(ALGORITHMS))


@dataclass(frozen=True)
class RunConfig:
    """What the user asked for, one option a row; the rows generate ``--help`` and the range checks."""

    parties: int = option(4, "-n", "--parties", help="q, number of parties (MPI ranks)",
                          check=at_least(2, ": vertical FL needs several parties"))
    active: int = option(2, "-m", "--active", help="m, active parties (ranks 0..m-1 hold the labels)")
    dataset: str = option("breast-cancer", "--dataset", help="registered dataset name (see `vfl datasets`)")
    party_files: str | None = option(
        None, "--party-files",
        help="folder of per-party files: from `vfl split`, or party-<p>.csv files (e.g. from "
             "`vfl align`), converted once into the run folder (replaces --dataset)")
    data_dir: str | None = option(None, "--data-dir",
                                  help="dataset folder (default: $VFL_DATA_DIR, ../shared/data)",
                                  budget=True)
    problem: str = option("logistic", "--problem",
                          help="logistic | nonconvex-logistic | least-squares | robust")
    lam: float = option(1e-4, "--lam", help="regularisation λ (paper: 1e-4)", check=non_negative())
    algorithm: str = option("svrg", "--algorithm", "--algo", help=_algorithm_help(),
                            choices=tuple(ALGORITHMS), check=_ALGORITHM_CHECK)
    mode: str = option("async", "--mode", choices=MODES,
                       help="async (VFB²); sync (VFB baseline: each dominator waits for every party's "
                            "acknowledgement); sync-global (also all dominators in lockstep)")
    batch_size: int = option(1, "-B", "--batch-size", check=between(1, MAX_BATCH),
                             help="rows per dominated update (1 = the paper's algorithm)")
    updates: str = option("auto", "--updates", choices=UPDATES,
                          help="lazy: O(nnz) per update, dense terms caught up per coordinate when read; "
                               "eager: the paper's O(d_l) loop; auto: lazy from 10,000 columns per party")
    saga_table_budget: float = option(
        2.0, "--saga-table-budget", metavar="GiB", check=positive(" (GiB), got {value}"),
        help="largest n × d_l table exact SAGA may allocate per party (else use saga-scalar)")
    inflight: int = option(1, "-P", "--inflight", check=between(1, MAX_INFLIGHT),
                           help="aggregation requests a dominator keeps outstanding (async mode)")
    piggyback: bool = option(
        False, "--piggyback",
        help="send each step's (ϑ, i) inside the next step's aggregation request: 3(q − 1) messages per "
             "update instead of 4(q − 1); the broadcast waits for the next request (async mode)")
    gamma: float | None = option(
        None, "--gamma", check=positive(), parse=_step_or_auto, metavar="GAMMA|auto", spelled="auto",
        help="learning rate γ; default (or auto): derived from the data at start, 1/(L(B) + λ) with L(B) "
             "the expected smoothness of B-row batches, from each party's row norms and Gram eigenvalue "
             "(docs/usage.md); the run prints the γ it chose. 0.05: the paper's grid")
    standardize: str = option(
        "on", "--standardize", choices=STANDARDIZE,
        help="each party scales its own columns by its training rows' statistics, kept in its folder for "
             "--resume and predict: on: divide by the root mean square of its non-zero values (zeros "
             "and 0/1 indicators stay as they are); center: "
             "subtract the mean, divide by the standard deviation (dense data); off: as given (the "
             "paper's runs)")
    gamma_decay: float = option(0.0, "--gamma-decay",
                                help="step size γ/(1 + decay·e) in epoch e = 0, 1, ... "
                                     "(0: constant, the paper's)",
                                check=Check(lambda v: 0 <= v < math.inf,
                                            "{flag} must be a finite number >= 0 (got {value})"))
    epochs: float = option(10.0, "--epochs", help="stop after this many passes over the data",
                           check=positive(), budget=True)
    target_suboptimality: float | None = option(
        None, "--target-suboptimality", check=positive(""),
        help="stop when f(w) − f* falls below this (f* from the NonF reference)", budget=True)
    time_limit: float | None = option(None, "--time-limit", help="stop after this much training time (s)",
                                      check=positive(" (seconds)"), budget=True)
    threads: int | None = option(None, "-k", "--threads", help="worker threads per party (default: m)",
                                 check=at_least(1))
    compute_threads: int | None = option(
        None, "--compute-threads", metavar="N", check=at_least(1), budget=True,
        help="threads of each rank's numerical pools (BLAS/OpenMP, numba, torch); default: the CPUs this "
             "process may use (affinity, cgroup quota) divided by the ranks on this host, at least 1")
    eval_every: float = option(1.0, "--eval-every", help="evaluate every this many epochs", check=positive())
    snapshot_every: float = option(
        1.0, "--snapshot-every", check=positive(),
        help="svrg: a new snapshot (ϑ_0, μ) every this many epochs, the inner loop's length; "
             "independent of --eval-every (1 = one pass, as run_serial)")
    seed: int = option(0, "--seed")
    engine: str = option("auto", "--engine", choices=ENGINES,
                         help="python: the reference runtime; compiled: the B = 1 hot path in one numba loop "
                              "per rank (async sgd, linear model; docs/runtime.md, \"The compiled loop\"); "
                              "auto: compiled for the jobs it serves, else python")
    straggler: int | None = option(None, "--straggler", help="rank of an injected straggler party")
    slowdown: float = option(0.4, "--slowdown", help="straggler's extra time fraction", check=non_negative())
    apply_delay_ms: float = option(
        0.0, "--apply-delay-ms", check=non_negative(),
        help="the straggler's workers wait this long before applying each batch of (ϑ, i)")
    link_delay_ms: float = option(
        0.0, "--link-delay", metavar="MS", check=non_negative(" (ms)"),
        help="emulated one-way latency: every message between parties is held this long")
    link_jitter_ms: float = option(0.0, "--link-jitter", metavar="MS", check=non_negative(" (ms)"),
                                   help="plus a uniform random extra delay of up to this much")
    peer_timeout: float = option(30.0, "--peer-timeout", check=positive(),
                                 help="end the job when a party has been silent this many seconds",
                                 budget=True)
    out: str | None = option(None, "--out",
                             help="folder of this run: metrics, each party's block (default: a new "
                                  "runs/<time>-<dataset>, with runs/latest pointing to it)",
                             budget=True)
    party_dir: str | None = option(
        None, "--party-dir", metavar="TEMPLATE",
        help="each party's own folder for its block and checkpoints, e.g. /srv/org{rank}/model "
             "(default: --out)")
    label_privacy: str = option(
        "none", "--label-privacy", choices=LABEL_PRIVACY,
        help="none: passive parties can infer the labels from ϑ; dp: ε-label-DP by randomized response on "
             "the training labels (needs --epsilon, -m 1); he: passive parties get ϑ only encrypted and "
             "learn their batch gradients (sgd, -B above every passive block's width); dp-theta (--model "
             "mlp): each row's ϑ clipped to norm 1 with Gaussian noise for --epsilon/--delta over the "
             "run's passes, the top stepping by DP-SGD")
    he_scheme: str = option("ou", "--he-scheme", choices=HE_SCHEMES,
                            help="additively homomorphic scheme of --label-privacy he (ou: ~20x faster, "
                                 "for a dominator that follows the protocol; paillier: also for one that "
                                 "does not, docs/label-privacy.md)")
    he_key_bits: int = option(2048, "--he-key-bits", choices=HE_KEY_BITS,
                              check=Check(lambda v: v in HE_KEY_BITS, "{flag} must be one of "
                                          + ", ".join(map(str, HE_KEY_BITS)) + " (got {value})"),
                              help="modulus size of --label-privacy he "
                                   "(2048: 112-bit security, 3072: 128-bit)")
    he_pack: bool = option(False, "--he-pack",
                           help="--label-privacy he with ou: 4 masked gradient values per decryption "
                                "(2048-bit keys), for a dominator that follows the protocol; refused with "
                                "paillier (docs/label-privacy.md, \"Packed decryption\")")
    epsilon: float | None = option(
        None, "--epsilon",
        help="ε of --label-privacy dp (randomized response), or of he: Gaussian noise on every ϑ before "
             "it is encrypted, calibrated by an RDP accountant (sgd, budget-only stops)")
    delta: float = option(1e-5, "--delta", help="δ of --label-privacy he --epsilon",
                          check=Check(lambda v: 0 < v < 1, "{flag} must lie between 0 and 1 (got {value})"))
    #: kept so that old command lines get a reason, not "unrecognized arguments": only 1 is accepted
    clip_quantile: float = option(
        1.0, "--clip-quantile", metavar="Q",
        check=Check(lambda v: v == 1, "{flag} is gone: --label-privacy he --epsilon now adds its noise to "
                    "ϑ, which one label moves by 1 whatever the rows' norms, so no row bound sizes it "
                    "(got {value}; drop the option)"),
        help="obsolete (only 1 is accepted): --label-privacy he --epsilon no longer clips rows")
    secure_channels: bool = option(False, "--secure-channels",
                                   help="seal every message between parties (X25519 + ChaCha20-Poly1305)")
    channel_keys: str | None = option(
        None, "--channel-keys", metavar="FILE",
        help="JSON list of the parties' public keys (hex, rank order; from `vfl keygen`); default: fresh "
             "keys in each party's folder")
    overwrite: bool = option(False, "--overwrite", help="reuse an --out folder that holds another run",
                             budget=True)
    resume: bool = option(False, "--resume",
                          help="continue the run in --out (default: runs/latest) from its newest complete "
                               "checkpoint, with its saved options; only the budget options (epochs, time "
                               "limit, target, progress, peer timeout, audit) may change", budget=True)
    progress: bool = option(True, "--no-progress", help="no progress bar", budget=True)
    f_star: float | None = option(None, "--f-star", help="known optimum f* (skips the NonF solve)")
    #: solve the NonF reference for f* before training (off: progress reports the loss, not f − f*;
    #: for data with n ≪ d, where L-BFGS would run its whole budget)
    reference: bool = option(True, "--no-reference",
                             help="skip the NonF solve for f* (progress shows the loss instead of f − f*)")
    allow_two_parties: bool = option(
        False, "--allow-two-parties",
        help="accept q = 2, where the aggregate reveals the other party's partial products")
    model: str = option("linear", "--model", choices=MODELS,
                        help="linear: VFB²'s linear model (the paper's); mlp: each party's own network "
                             "(--bottom), summed by the secure aggregation, and a top network with the "
                             "loss at the label holder (docs/vertical-networks.md; torch, -m 1, sgd)")
    bottom: str = option(DEFAULT_BOTTOM, "--bottom", metavar="SPEC[,SPEC...]",
                         help="--model mlp: each party's network as layer widths, '*' first for its "
                              "columns, the last (k, the cut layer) the same at every party; one spec "
                              "for all or one per party, comma-separated in rank order")
    top: str = option(DEFAULT_TOP, "--top", metavar="SPEC",
                      help="--model mlp: the label holder's top network from k to the logit ('*' "
                           "stands for either end); one width (e.g. '1' with k = 1) is the identity")
    theta_noise: str = option(
        "fresh", "--theta-noise", choices=("fresh", "per-row"),
        help="--label-privacy dp-theta: fresh (each release of a row's ϑ with new noise, clipped to 1 "
             "under a top with parameters, composed over the passes; any top) or per-row (one noise draw "
             "per row for the whole run, one release's ε; identity top only: docs/vertical-networks.md)")
    label_noise_correction: str = option(
        "none", "--label-noise-correction", choices=("none", "forward"),
        help="--label-privacy dp with --model mlp: forward trains the top's loss on the randomized labels "
             "through their known flip rate, so the network predicts the true label's probability (none: "
             "the noisy labels as if clean, Ghazi et al.'s baseline; docs/vertical-networks.md)")
    audit: bool = option(False, "--audit", budget=True,
                         help="each party records every message it receives to audit-<rank>.npz in its "
                              "own folder (--party-dir, default --out)")

    def gamma_at(self, epochs: float, gamma: float | None = None) -> float:
        """The step size in the epoch that ``epochs`` falls in: γ/(1 + decay·e), e = ⌊epochs⌋ (constant γ,
        the paper's, when ``gamma_decay`` is 0). A decaying step lets constant-step SGD's noise floor
        shrink (the label-DP noise of ``--label-privacy he --epsilon`` included: steps are
        post-processing, so the privacy accounting is unchanged). ``gamma``: the base step when
        ``--gamma auto`` (derived from the data at start, ``parties.step``)."""
        base = self.gamma if gamma is None else gamma
        if base is None:
            raise ValueError("no --gamma: the base step is derived from the data (parties.step.choose_gamma)")
        return base / (1.0 + self.gamma_decay * math.floor(epochs + EPOCH_SLACK))

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

    def to_json(self) -> str:
        return json.dumps(dataclasses.asdict(self), sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> RunConfig:
        return cls(**json.loads(text))


@functools.cache
def _rows() -> tuple[tuple[dataclasses.Field, type], ...]:
    """Each option's field and its argparse type (the annotation without ``| None``)."""
    hints = typing.get_type_hints(RunConfig)
    rows = []
    for f in dataclasses.fields(RunConfig):
        kinds = [t for t in typing.get_args(hints[f.name]) if t is not type(None)] or [hints[f.name]]
        rows.append((f, kinds[0]))
    return tuple(rows)


def long_flag(name: str) -> str:
    """The option's ``--long-flag``, as messages name it."""
    meta = next(f.metadata for f, _ in _rows() if f.name == name)
    return next(flag for flag in meta["flags"] if flag.startswith("--"))


# ------------------------------------------------------------------------------------- validation


def validate(config: RunConfig) -> RunConfig:
    """Raise :class:`ConfigError` for options that cannot run together; return ``config`` itself.

    Only the options are looked at: no file is read and nothing is derived (what needs the data is
    checked where the launcher resolves the job plan, :func:`parties.plan.resolve`).
    """
    for f, _ in _rows():
        check, value = f.metadata["check"], getattr(config, f.name)
        if check is not None and value is not None and not check.ok(value):
            raise ConfigError(check.message.format(flag=long_flag(f.name), value=value))
    _check_parties(config)
    _check_algorithm(config)
    _check_stopping(config)
    _check_label_privacy(config)
    if config.model != "linear":
        from parties.model_options import network_refusal

        refusal = network_refusal(config)
        if refusal is not None:
            raise ConfigError(refusal)
    if config.channel_keys is not None and not config.secure_channels:
        raise ConfigError("--channel-keys needs --secure-channels")
    if (refusal := engine_refusal(config)) is not None:
        raise ConfigError(refusal)
    return config


def _check_parties(c: RunConfig) -> None:
    if c.parties == 2 and not c.allow_two_parties:
        raise ConfigError("with 2 parties the secure aggregation cannot hide anything: the root learns the "
                          "other party's partial product w·x from the sum. Use 3 or more parties, or pass "
                          "--allow-two-parties to accept this leak")
    if not 1 <= c.active <= c.parties:
        raise ConfigError(f"--active must be between 1 and --parties={c.parties} (got {c.active})")
    if c.straggler is not None and not 0 <= c.straggler < c.parties:
        raise ConfigError(f"--straggler must be a party rank in 0..{c.parties - 1} (got {c.straggler})")
    if c.party_dir is not None:
        try:
            distinct = {c.party_dir.format(rank=r) for r in range(c.parties)}
        except (KeyError, IndexError, ValueError):
            distinct = set()
        if "{rank}" not in c.party_dir or len(distinct) != c.parties:
            raise ConfigError(f"--party-dir must contain {{rank}} (one folder per party), "
                              f"got {c.party_dir!r}")


def _check_algorithm(c: RunConfig) -> None:
    from vertical.problems import PROBLEMS

    algorithm = get_algorithm(c.algorithm)  # known: the table checked it
    if c.mode not in algorithm.modes:
        raise ConfigError(f"{c.algorithm} runs only with --mode {' or '.join(algorithm.modes)}")
    if c.inflight > 1 and c.mode != "async":
        raise ConfigError(f"--inflight {c.inflight} needs --mode async: a synchronous step waits for the "
                          "previous one")
    if c.piggyback and (c.mode != "async" or c.label_privacy == "he"):
        raise ConfigError("--piggyback needs --mode async and no --label-privacy he: a synchronous step "
                          "waits for its acknowledgements before the next request goes out, and under he "
                          "passive parties get ϑ encrypted in their own messages")
    if c.problem not in PROBLEMS:
        raise ConfigError(f"unknown --problem {c.problem!r}; choose one of {', '.join(sorted(PROBLEMS))}")


def _check_stopping(c: RunConfig) -> None:
    if c.target_suboptimality is not None and not c.reference and c.f_star is None:
        raise ConfigError("--target-suboptimality needs f*: drop --no-reference or give --f-star")


def _check_label_privacy(c: RunConfig) -> None:
    if c.label_privacy == "dp":
        from vertical.problems import PROBLEMS

        if PROBLEMS[c.problem].task != "binary":
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
    elif c.epsilon is not None and c.label_privacy not in ("he", "dp-theta"):
        raise ConfigError("--epsilon needs --label-privacy dp, he or dp-theta")
    if c.label_privacy == "he":
        _check_he(c)
    elif c.label_privacy == "dp-theta":
        _check_dp_theta(c)
    if c.label_noise_correction != "none" and (c.label_privacy != "dp" or c.model != "mlp"):
        raise ConfigError("--label-noise-correction corrects the loss of a network (--model mlp) for the "
                          "randomized labels of --label-privacy dp: it needs both")
    if c.theta_noise != "fresh" and c.label_privacy != "dp-theta":
        raise ConfigError("--theta-noise chooses how --label-privacy dp-theta noises ϑ: it needs "
                          "--label-privacy dp-theta")
    if c.he_pack and c.label_privacy != "he":
        raise ConfigError("--he-pack packs --label-privacy he's decryptions: it needs --label-privacy he")


def _check_dp_theta(c: RunConfig) -> None:
    """``--label-privacy dp-theta``: a network's ϑ noised over a fixed number of passes."""
    if c.model == "linear":
        raise ConfigError("--label-privacy dp-theta protects a network's vector ϑ (--model mlp); the linear "
                          "model's ϑ is noised by --label-privacy he --epsilon")
    if c.epsilon is None or not 0 < c.epsilon < float("inf"):
        raise ConfigError("--label-privacy dp-theta needs --epsilon, a positive number (e.g. 1, 4, 16)")
    if c.theta_noise == "per-row" and "-" in c.top:
        raise ConfigError(f"--theta-noise per-row needs an identity top (one width, e.g. --top 1 with k = 1; "
                          f"got --top {c.top}): a top with parameters changes between releases, and two "
                          "releases of a row would then give its label away without noise")
    if c.resume:
        raise ConfigError("--label-privacy dp-theta cannot --resume: the batch schedule would start over, "
                          "and rows could be in more batches than the privacy accounting allows")


def _check_he(c: RunConfig) -> None:
    """What ``--label-privacy he`` runs: SGD and SVRG mini-batches of at least the minimum B."""
    from protocols.label_he import MIN_BATCH

    if c.algorithm not in HE_ALGORITHMS:
        raise ConfigError(f"--label-privacy he runs --algorithm {' or '.join(HE_ALGORITHMS)}: "
                          f"{c.algorithm}'s per-row ϑ table would need ϑ in clear at every party")
    if c.batch_size < MIN_BATCH:
        raise ConfigError(f"--label-privacy he needs --batch-size of at least {MIN_BATCH} (got "
                          f"{c.batch_size}): a passive party learns its batch gradient X_Bᵀϑ, which gives "
                          "away ϑ when B does not exceed its block's columns (B = 1: ϑ = g_j / x_ij)")
    if c.updates == "lazy":
        raise ConfigError("--label-privacy he uses the eager kernels: drop --updates lazy")
    if c.he_pack and c.he_scheme != "ou":
        raise ConfigError("--he-pack is for --he-scheme ou: Paillier's masks fill its whole plaintext to "
                          "hide the features from a dominator that encrypts what it likes, leaving no "
                          "room for a second value")
    if c.epsilon is None:
        return
    if not 0 < c.epsilon < float("inf"):
        raise ConfigError(f"--epsilon must be a positive number (got {c.epsilon})")
    if c.algorithm != "sgd":
        raise ConfigError("--label-privacy he --epsilon runs --algorithm sgd: an SVRG snapshot would "
                          "release a full gradient that the per-batch accounting does not cover")
    if not _logistic(c.problem):
        raise ConfigError(f"--label-privacy he --epsilon needs a logistic loss, not --problem {c.problem}: "
                          "the noise is sized for one label moving ϑ by exactly 1, which holds for the "
                          "logistic loss only (least squares: unbounded)")
    if c.f_star is not None:
        raise ConfigError("--label-privacy he --epsilon does not take --f-star: f* is computed from all "
                          "the labels, and config.json, which every party reads, would carry it")
    if c.resume:
        raise ConfigError("--label-privacy he --epsilon cannot --resume: the batch schedule would start "
                          "over, and rows could be in more batches than the privacy accounting allows")
    if c.target_suboptimality is not None:
        raise ConfigError("--label-privacy he --epsilon stops on the epoch or time budget only: a stop "
                          "at a target loss is a decision made from the labels; drop "
                          "--target-suboptimality")


def _logistic(problem: str) -> bool:
    from vertical.problems import PROBLEMS, LogisticLoss

    return isinstance(PROBLEMS[problem].loss, LogisticLoss)


# ------------------------------------------------------------------------------- the command line


def build_parser(parser: argparse.ArgumentParser | None = None, *, defaults: bool = True
                 ) -> argparse.ArgumentParser:
    """Add the training options to ``parser`` (or a new one), one argument per row of the table.
    ``defaults=False``: an option not on the command line stays out of the namespace
    (:func:`given_options`)."""
    p = parser or argparse.ArgumentParser(description="Train a VFB² model over q MPI parties.",
                                          formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    for f, kind in _rows():
        meta = f.metadata
        default = f.default if meta["spelled"] is None else meta["spelled"]  # argparse parses a str default
        extra: dict[str, Any] = {"dest": f.name, "default": default if defaults else argparse.SUPPRESS}
        if kind is bool:  # a switch: its flag turns the default over
            extra["action"] = "store_false" if f.default else "store_true"
        else:
            if meta["parse"] is not None:
                extra["type"] = meta["parse"]
            elif kind is not str:
                extra["type"] = kind
            if meta["choices"] is not None:
                extra["choices"] = list(meta["choices"])
            if meta["metavar"] is not None:
                extra["metavar"] = meta["metavar"]
        if meta["help"] is not None:
            extra["help"] = meta["help"]
        p.add_argument(*meta["flags"], **extra)
    return p


def from_args(args: argparse.Namespace) -> RunConfig:
    fields = {f.name for f in dataclasses.fields(RunConfig)}
    return RunConfig(**{k: v for k, v in vars(args).items() if k in fields})


def given_options(argv: Sequence[str], more: Callable[[argparse.ArgumentParser], None] | None = None
                  ) -> frozenset[str]:
    """The options ``argv`` (the ``vfl train`` arguments) sets itself, whatever their values: an
    explicit ``--epochs 10`` is given although 10 is the default. ``more`` adds the command's other
    arguments (the host options), so that every flag is parsed exactly as the real parser does."""
    p = argparse.ArgumentParser(add_help=False, allow_abbrev=True)
    build_parser(p, defaults=False)
    if more is not None:
        more(p)
    names = {f.name for f, _ in _rows()}
    return frozenset(k for k in vars(p.parse_known_args(list(argv))[0]) if k in names)


def differing_options(options: RunConfig) -> frozenset[str]:
    """The options that differ from their defaults: what a caller of the Python API asked for."""
    return frozenset(f.name for f, _ in _rows() if getattr(options, f.name) != f.default)


def budget_options() -> frozenset[str]:
    """The rows marked ``budget``: what ``--resume`` lets the user change."""
    return frozenset(f.name for f, _ in _rows() if f.metadata["budget"])
