"""The serving options of ``vfl party`` (``--serve`` and its own), added to its parser by
:func:`parties.federation.command.add_arguments`; :mod:`parties.serving.organisation` checks them
with ``--serve``, and training refuses them here. No import of the commands: both import this."""

from __future__ import annotations

import argparse

from parties.config import ConfigError

SERVING_OPTIONS = ("http", "window_ms", "max_batch", "peer_timeout")
DEFAULTS = {"window_ms": 1.0, "max_batch": 1024, "peer_timeout": 10.0}


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The serving options of ``vfl party`` (:func:`parties.federation.command.add_arguments`)."""
    p.add_argument("--serve", action="store_true",
                   help="serve the run this party trained in --folder instead of training "
                        "(docs/serving.md#one-process-per-organisation)")
    # not given: absent from the namespace (argparse.SUPPRESS), so the help shows the real defaults
    p.add_argument("--http", default=argparse.SUPPRESS, metavar="HOST:PORT",
                   help="with --serve, the leader only: where its HTTP endpoint listens")
    p.add_argument("--window-ms", default=argparse.SUPPRESS, type=float,
                   help=f"with --serve: micro-batching window (default {DEFAULTS['window_ms']:g})")
    p.add_argument("--max-batch", default=argparse.SUPPRESS, type=int,
                   help=f"with --serve: most rows of one aggregation (default {DEFAULTS['max_batch']})")
    p.add_argument("--peer-timeout", default=argparse.SUPPRESS, type=float,
                   help=f"with --serve: seconds a round may take (default {DEFAULTS['peer_timeout']:g})")


def refuse_without_serve(args: argparse.Namespace) -> None:
    """Training: the serving options mean nothing without ``--serve``."""
    given = [f"--{n.replace('_', '-')}" for n in SERVING_OPTIONS if getattr(args, n, None) is not None]
    if given:
        raise ConfigError(f"{given[0]} is for --serve (serving a trained run), not for training")
