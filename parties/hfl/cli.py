"""The ``python -m parties.hfl`` command line: launch a job, ``split`` a dataset into client files, or (with
``--config``, as :func:`parties.hfl.launcher.launch_hfl` starts every rank) run as a rank."""

from __future__ import annotations

import argparse
import dataclasses
import sys
from collections.abc import Sequence

from horizontal import ALGORITHMS, COMPOSITIONAL, LAYERED_METHODS
from parties.config import ConfigError
from parties.hfl.config import MODELS, PARTITIONS, HflConfig, option_names
from parties.hfl.launcher import launch_hfl
from parties.hfl.ranks import run_ranks
from parties.hfl.split import write_client_files


def build_parser(parser: argparse.ArgumentParser | None = None) -> argparse.ArgumentParser:
    """The job options (shared by training and ``split``) on ``parser`` or a new one."""
    p = parser or argparse.ArgumentParser(
        prog="python -m parties.hfl",
        description="Horizontal FL under mpiexec: rank 0 is the server, ranks 1..P host the clients. "
                    "`python -m parties.hfl split ...` writes one data file per client process.")
    d = HflConfig()
    p.add_argument("--algorithm", default=d.algorithm,
                   help=f"{' | '.join(sorted(ALGORITHMS))}; with --model cnn: "
                        f"{' | '.join(sorted(LAYERED_METHODS))}; {' | '.join(sorted(COMPOSITIONAL))}")
    p.add_argument("--compressor", default=None,
                   help="uplink compressor as name[:key=value,...], e.g. top-r:r=0.01, dithering:bits=2")
    for option, about in option_names().items():   # every other field of the options dataclasses
        p.add_argument("--" + option.replace("_", "-"), dest=f"option_{option}", default=None,
                       metavar="VALUE", help=about)
    p.add_argument("--dataset", default=d.dataset, help="registered dataset (see `vfl datasets`)")
    p.add_argument("--data-dir", default=None, help="dataset folder (default: $VFL_DATA_DIR, ../shared/data)")
    p.add_argument("--client-files", default=None,
                   help="folder of clients-<p>.npz from `split` (each process reads only its own file)")
    p.add_argument("--partition", default=d.partition, help=" | ".join(PARTITIONS))
    p.add_argument("--shards-per-client", type=int, default=d.shards_per_client)
    p.add_argument("--dirichlet-alpha", type=float, default=d.dirichlet_alpha)
    p.add_argument("--model", default=d.model, help=" | ".join(MODELS))
    p.add_argument("--hidden", type=_widths, default=d.hidden, help="MLP hidden widths, e.g. 256,128")
    p.add_argument("--widths", type=_widths, default=d.widths,
                   help="--model cnn: channels of its conv stages (one 2x2 pooling each), e.g. 8,16,32")
    p.add_argument("--dtype", default=d.dtype, help="float32 | float64")
    p.add_argument("--clients", type=int, default=d.clients, help="N, logical clients")
    p.add_argument("--per-round", type=int, default=d.per_round, help="S, clients sampled per round")
    p.add_argument("--local-steps", type=int, default=d.local_steps, help="K, local SGD steps (flat models)")
    p.add_argument("--objective", default=d.objective,
                   help="feddro: the DRO objective, kl-dro | chi2-dro | erm (kl-dro)")
    p.add_argument("--dro-lambda", type=float, default=d.dro_lambda, help="feddro: the objective's λ (1.0)")
    p.add_argument("--local-epochs", type=int, default=d.local_epochs,
                   help="E, local epochs over each client's rows (--model cnn)")
    p.add_argument("--lr-local", type=float, default=d.lr_local, help="η_l")
    p.add_argument("--lr-global", type=float, default=d.lr_global, help="η_g")
    p.add_argument("--batch-size", type=int, default=d.batch_size)
    p.add_argument("--rounds", type=int, default=d.rounds)
    p.add_argument("--eval-every", type=int, default=d.eval_every, help="evaluate every this many rounds")
    p.add_argument("-P", "--processes", type=int, default=d.processes,
                   help="client processes (mpiexec starts P + 1 ranks)")
    p.add_argument("--compute-threads", type=int, default=d.compute_threads, metavar="N",
                   help="threads of each rank's torch and BLAS/OpenMP pools; default: the CPUs this process "
                        "may use divided by the P + 1 ranks, at least 1")
    p.add_argument("--seed", type=int, default=d.seed)
    p.add_argument("--out", default=d.out, help="run folder (metrics.jsonl, model.npz), or split's folder")
    p.add_argument("--no-progress", dest="progress", action="store_false")
    p.add_argument("--trajectory", action="store_true",
                   help="also save the server state after every round to <out>/trajectory.npz")
    p.add_argument("--config", action="append", default=None, help=argparse.SUPPRESS)  # set by launch_hfl()
    return p


def _widths(text: str) -> list[int]:
    try:
        return [int(w) for w in text.split(",") if w.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def from_args(args: argparse.Namespace) -> HflConfig:
    names = {f.name for f in dataclasses.fields(HflConfig)}
    given = vars(args)
    chosen = {name: given[f"option_{name}"] for name in option_names() if given[f"option_{name}"] is not None}
    return HflConfig(**{k: v for k, v in given.items() if k in names}, options=chosen)


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    split = bool(argv) and argv[0] == "split"
    args = build_parser().parse_args(argv[1:] if split else argv)
    if args.config:
        run_ranks(args.config)
        return 0
    try:
        if split:
            paths = write_client_files(from_args(args), args.out)
            print(f"wrote {len(paths)} client files and test.npz to {args.out}")
            return 0
        return launch_hfl(from_args(args))
    except ConfigError as err:
        print(f"python -m parties.hfl: error: {err}", file=sys.stderr)
        return 2
