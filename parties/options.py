"""What a party's runtime is told to do: one frozen :class:`RuntimeOptions`, built from the run config.

The runtime (``parties/runtime.py``) reads nothing else of the configuration;
:meth:`RuntimeOptions.from_config` is the one place that turns the user's options (milliseconds, the
algorithm's name) into the runtime's (seconds, whether to dispatch).
"""

from __future__ import annotations

from dataclasses import dataclass

from protocols.channels import ChannelKeys


@dataclass(frozen=True)
class RuntimeOptions:
    """Options of :class:`~parties.runtime.PartyRuntime`; times in seconds."""

    #: the dominators (label holders), ranks of the job's communicator
    active_ranks: tuple[int, ...]
    #: worker threads applying other dominators' (ϑ, i)
    threads: int
    seed: int
    #: ``async``, ``sync`` or ``sync-global``
    mode: str = "async"
    #: whether dominators broadcast (ϑ, i) (off: only their own blocks move)
    dispatch: bool = True
    batch_size: int = 1
    #: aggregation requests a dominator keeps outstanding (async mode)
    inflight: int = 1
    #: hold each step's (ϑ, i) back and send it inside the next step's request
    piggyback: bool = False
    #: the rank made slow (``slowdown`` times longer for each piece of work, ``apply_delay`` before
    #: each batch its workers apply)
    straggler: int | None = None
    slowdown: float = 0.0
    apply_delay: float = 0.0
    #: a party silent this long ends the job
    peer_timeout: float = 30.0
    #: emulated one-way latency of every received data-plane message, and its jitter
    link_delay: float = 0.0
    link_jitter: float = 0.0
    #: with keys, every message between parties is sealed (``--secure-channels``)
    keys: ChannelKeys | None = None
    allow_two_parties: bool = False
    #: record everything received (``save_transcript``)
    audit: bool = False
    #: ``none`` or ``he`` (the runtime's part of ``dp`` is nothing)
    label_privacy: str = "none"
    he_scheme: str = "ou"
    he_key_bits: int = 2048
    #: --he-pack: several masked gradient values per OU decryption (protocols/label_he_pack.py)
    he_pack: bool = False
    #: --label-privacy he --epsilon: σ of the noise on every ϑ (one label moves ϑ by 1)
    noise_multiplier: float | None = None
    #: --theta-noise: fresh noise on each release of a row's ϑ, or one draw per row (``per-row``)
    theta_noise: str = "fresh"
    #: ``--engine``: ``compiled`` serves the B = 1 hot path in one numba pump (parties/compiled_pump.py)
    engine: str = "python"

    def __post_init__(self) -> None:
        object.__setattr__(self, "active_ranks", tuple(self.active_ranks))

    @property
    def synchronous(self) -> bool:
        return self.mode != "async"

    @classmethod
    def from_config(cls, config, *, keys: ChannelKeys | None = None) -> RuntimeOptions:
        """The options of a ``vfl train`` run (:class:`~parties.config.RunConfig`); ``keys``: this
        party's channel keys under ``--secure-channels``."""
        from parties.engine import engine_for
        from vertical.algorithms.registry import get_algorithm

        return cls(
            active_ranks=tuple(range(config.active)), threads=config.worker_threads, seed=config.seed,
            mode=config.mode, dispatch=get_algorithm(config.algorithm).dispatch,
            batch_size=config.batch_size, inflight=config.inflight, piggyback=config.piggyback,
            straggler=config.straggler, slowdown=config.slowdown, apply_delay=config.apply_delay_ms / 1e3,
            peer_timeout=config.peer_timeout, link_delay=config.link_delay_ms / 1e3,
            link_jitter=config.link_jitter_ms / 1e3, keys=keys, allow_two_parties=config.allow_two_parties,
            audit=config.audit, label_privacy=config.label_privacy, he_scheme=config.he_scheme,
            he_key_bits=config.he_key_bits, he_pack=config.he_pack, noise_multiplier=config.noise_multiplier,
            theta_noise=config.theta_noise, engine=engine_for(config))
