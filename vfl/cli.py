"""The ``vfl`` command: ``datasets``, ``synth``, ``split``, ``align``, ``reference``, ``train``, ``party``,
``predict``, ``serve``, ``export``, ``plot``, ``keygen``, ``hfl-train``, ``hfl-split``.

Each subcommand validates its options here, at the edge, and turns library errors into one readable
line and exit code 2 (never a traceback for a user mistake). ``train`` imports ``parties`` lazily, so
``vfl datasets`` or ``vfl split`` start without MPI.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence


def _cmd_datasets(args: argparse.Namespace) -> int:
    from vertical.datasets import list_datasets

    rows = list_datasets(args.data_dir)
    name_w = max(len(r.name) for r in rows)
    print(f"{'dataset':<{name_w}}  {'task':<10}  {'rows x features':>22}  status")
    for r in rows:
        shape = f"{r.shape[0]:,} x {r.shape[1]:,}" if r.shape else "?"
        where = f"present ({r.where})" if r.present else "missing"
        if r.present and r.where is None:
            where = "embedded"
        aliases = f" [{', '.join(r.aliases)}]" if r.aliases else ""
        print(f"{r.name:<{name_w}}  {r.task:<10}  {shape:>22}  {where}{aliases}")
    return 0


def _is_file_argument(text: str) -> bool:
    """``vfl split`` takes a registered name or a LIBSVM file: a path that exists, or looks like one."""
    from pathlib import Path

    return Path(text).is_file() or "/" in text or text.endswith((".svm", ".libsvm", ".bz2", ".gz", ".txt"))


def _image_strips(n_features: int, parties: int) -> list:
    """``vfl split --strips``: square row-major images cut into q vertical strips (each party a band of
    pixel columns: the usual image VFL benchmark, e.g. Fashion-MNIST in 4 strips of 28 × 7)."""
    import math

    from vertical.partition import image_strips

    side = math.isqrt(n_features)
    if side * side != n_features or not 1 <= parties <= side:
        raise ValueError(f"--strips cuts square images into at most one strip per pixel column: "
                         f"{n_features} features are not {parties} strips of a square image")
    return image_strips(side, side, parties)


def _cmd_split(args: argparse.Namespace) -> int:
    from vertical.datasets import load, split_to_party_files
    from vertical.partition import contiguous_blocks, random_blocks

    active = _parse_active(args.active, args.parties)
    partition_seed = args.seed if args.partition_seed is None else args.partition_seed
    if args.strips and (args.contiguous or args.dataset.lower().endswith(".csv")
                        or _is_file_argument(args.dataset)):
        raise ValueError("--strips cuts a registered image dataset into strips (not with --contiguous, "
                         "nor for a file)")
    if args.dataset.lower().endswith(".csv"):
        from vertical.datasets.csv_parties import csv_file_dataset

        ds = csv_file_dataset(args.dataset, args.task or "binary", args.seed)
        blocks = (contiguous_blocks(ds.n_features, args.parties) if args.contiguous
                  else random_blocks(ds.n_features, args.parties, seed=partition_seed))
        paths = split_to_party_files(ds, blocks, active, args.out, partition_seed=partition_seed,
                                     overwrite=args.overwrite, layout=args.format,
                                     column_order=args.column_order)
    elif _is_file_argument(args.dataset):
        from vertical.datasets.stream_split import split_libsvm_file

        if args.format != "folder":
            raise ValueError("a LIBSVM file is split in streaming into party folders: --format npz is for "
                             "registered datasets only")
        if args.chunk_mb <= 0:
            raise ValueError(f"--chunk-mb must be positive, got {args.chunk_mb:g}")
        paths = split_libsvm_file(args.dataset, args.parties, active, args.out, seed=args.seed,
                                  partition_seed=partition_seed, contiguous=args.contiguous,
                                  n_features=args.n_features, task=args.task, overwrite=args.overwrite,
                                  chunk_bytes=int(args.chunk_mb * 2**20), column_order=args.column_order)
    else:
        ds = load(args.dataset, seed=args.seed, data_dir=args.data_dir)
        blocks = (_image_strips(ds.n_features, args.parties) if args.strips
                  else contiguous_blocks(ds.n_features, args.parties) if args.contiguous
                  else random_blocks(ds.n_features, args.parties, seed=partition_seed))
        paths = split_to_party_files(ds, blocks, active, args.out, partition_seed=partition_seed,
                                     overwrite=args.overwrite, layout=args.format,
                                     column_order=args.column_order)
    from vertical.datasets.party_files import read_manifest

    manifest = read_manifest(args.out)
    for p, path in enumerate(paths):
        role = "active (features + labels)" if p in active else "passive (features only)"
        print(f"party {p}: {path}  {role}, {manifest.block_sizes[p]:,} features")
    print(f"{manifest.dataset}: {manifest.n_train:,} train / {manifest.n_test:,} test rows, "
          f"{manifest.n_features:,} features")
    return 0


def _cmd_synth(args: argparse.Namespace) -> int:
    from pathlib import Path

    from vertical.datasets.synth import standin_file_name, write_standin

    out = Path(args.out)
    if out.is_dir():
        out = out / standin_file_name(args.shape)
    info = write_standin(out, args.shape, n_rows=args.rows, seed=args.seed, mean_nnz=args.mean_nnz,
                         label_noise=args.label_noise, overwrite=args.overwrite)
    print(f"wrote {out} (STAND-IN for {info['stand_in_for']}, not the real data): {info['n_rows']:,} rows x "
          f"{info['n_features']:,} features, {info['mean_nnz']:.1f} nonzeros a row, "
          f"{100 * info['positive_fraction']:.1f} % positive; parameters in {out.name}.stand-in.json")
    if out.name == standin_file_name(args.shape):
        print(f"in a data folder (--data-dir, $VFL_DATA_DIR) it is --dataset {info['name']}, and --dataset "
              f"{info['stand_in_for']} falls back to it while the real file is absent")
    return 0


def _parse_active(text: str, q: int) -> list[int]:
    """``"2"`` means parties 0 and 1; ``"0,3"`` lists them."""
    if "," not in text and text.strip().isdigit():
        m = int(text)
        if not 1 <= m <= q:
            raise ValueError(f"--active must be between 1 and --parties={q} (got {m})")
        return list(range(m))
    try:
        return sorted({int(t) for t in text.split(",")})
    except ValueError:
        raise ValueError(f"--active must be a count or a comma-separated list of ranks, "
                         f"got {text!r}") from None


def _cmd_reference(args: argparse.Namespace) -> int:
    from vertical.datasets import load
    from vertical.problems import get_problem
    from vertical.reference import evaluate, solve_reference

    problem = get_problem(args.problem, lam=args.lam)
    if args.party_files is None:
        ds = load(args.dataset, seed=args.seed, data_dir=args.data_dir)
        name, X_train, y_train, X_test, y_test = ds.name, ds.X_train, ds.y_train, ds.X_test, ds.y_test
    else:
        name, X_train, y_train, X_test, y_test = _pooled_party_files(args, problem.task)
    if args.standardize != "off":  # the problem `vfl train --standardize` solves: each column scaled alike
        from vertical.standardize import apply_scaling, fit_scaling

        scaling = fit_scaling(X_train, args.standardize)
        X_train, X_test = apply_scaling(X_train, scaling), apply_scaling(X_test, scaling)
    sol = solve_reference(problem, X_train, y_train)
    scores = evaluate(problem, sol.w, X_test, y_test) if X_test.shape[0] else {}
    print(f"NonF {problem.name} on {name} (λ={args.lam:g}, {X_train.shape[0]:,} train / {X_test.shape[0]:,} "
          f"test, {X_train.shape[1]} features, --standardize {args.standardize})")
    print(f"  f* = {sol.f_star:.12g}   ‖∇f‖ = {sol.grad_norm:.2e}   {sol.n_iter} iterations, "
          f"{sol.seconds:.2f} s")
    for key, value in scores.items():
        shown = f"{100 * value:.2f} %" if key == "accuracy" else f"{value:.4f}"
        print(f"  test {key}: {shown}")
    return 0


def _pooled_party_files(args: argparse.Namespace, task: str):
    """Every party's file of one folder pooled into one table (a reference needs all the columns in one
    place: this is for party files that sit on one machine, a simulation or a test of a deployment)."""
    import numpy as np

    from vertical.datasets.csv_parties import is_csv_folder, load_csv_parties
    from vertical.datasets.party_files import (
        assemble_features,
        find_party_file,
        load_party_file,
        read_manifest,
    )

    folder = args.party_files
    if is_csv_folder(folder):
        if args.parties is None:
            raise ValueError(f"--party-files {folder}: a folder of party-<p>.csv files needs -n (and -m)")
        parties = load_csv_parties(folder, args.parties, args.active, task)
        X_train, X_test = (np.hstack([getattr(p, f"X_{s}") for p in parties]) for s in ("train", "test"))
    else:
        manifest = read_manifest(folder)
        parties = [load_party_file(find_party_file(folder, p)) for p in range(manifest.q)]
        X_train, X_test = assemble_features(parties)
    labelled = next(p for p in parties if p.has_labels)
    return str(folder), X_train, labelled.y_train, X_test, labelled.y_test


def _cmd_train(args: argparse.Namespace) -> int:
    from parties.config import from_args, given_options
    from parties.hosts import add_arguments, mpiexec_env
    from parties.launch import launch

    given = given_options(args.argv[1:], add_arguments)  # what --resume checks against the run's options
    return launch(from_args(args), given=given, extra_env=mpiexec_env(args))


def _cmd_party(args: argparse.Namespace) -> int:
    if args.serve:  # serving the run this party trained (docs/serving.md)
        from parties.serving.party import serve_command

        return serve_command(args)
    from parties.federation.command import run_command

    return run_command(args, args.argv[1:])


def _cmd_keygen(args: argparse.Namespace) -> int:
    from pathlib import Path

    from parties.launch import write_private_key
    from protocols.channels import generate_key_pair

    path = Path(args.party_dir) / f"party-{args.rank}.channel.key"
    if path.exists() and not args.overwrite:
        raise ValueError(f"{path} exists: pass --overwrite to replace this party's key")
    private, public = generate_key_pair()
    write_private_key(path, private)
    print(f"private key: {path} (keep it there; readable by you only)\npublic key (share it; it goes "
          f"at index {args.rank} of the --channel-keys list): {public.hex()}")
    return 0


def _cmd_predict(args: argparse.Namespace) -> int:
    from parties.predict import predict

    return predict(args.run, split=args.split, output=args.output)


def _cmd_serve(args: argparse.Namespace) -> int:
    from parties.serving.launch import serve

    return serve(args.run, port=args.port, host=args.host, window_ms=args.window_ms, max_batch=args.max_batch,
                 peer_timeout=args.peer_timeout)


def _cmd_export(args: argparse.Namespace) -> int:
    from parties.export import export_party, part_paths

    part = export_party(args.run, args.party, args.out, overwrite=args.overwrite, data=args.data)
    json_path, npz_path = part_paths(args.out, args.party)
    network = f"network {'-'.join(map(str, part.widths))}, " if part.model == "mlp" else ""
    print(f"party {args.party}: wrote {json_path} and {npz_path} ({part.n_features:,} columns, {network}"
          f"{part.problem}, --standardize {part.standardize}, epoch {part.epochs:g})")
    return 0


def _cmd_align(args: argparse.Namespace) -> int:
    from parties.align import launch_alignment

    return launch_alignment(args.parties, args.ids, args.id_column, args.out, args.peer_timeout)

def _cmd_plot(args: argparse.Namespace) -> int:
    from vfl.plotting import plot_runs

    out = plot_runs(args.runs, args.out, x=args.x)
    print(f"wrote {out} and metrics.csv in {len(args.runs)} run folder(s)")
    return 0


def _run_hfl(command: str, rest: list[str]) -> int:
    """Horizontal FL lives in ``parties.hfl``, which parses its own options (it imports torch, so only
    when asked for)."""
    import importlib.util

    if importlib.util.find_spec("torch") is None:
        print(f"vfl {command}: horizontal FL needs torch: pip install torch==2.13.0 (the CPU build), or "
              "pip install -e '.[hfl]'", file=sys.stderr)
        return 2
    from parties.hfl import main as hfl_main

    return hfl_main((["split"] if command == "hfl-split" else []) + rest)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vfl", description="Vertical federated learning (VFB²) on MPI.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("datasets", help="list the registered datasets and whether their files are present")
    p.add_argument("--data-dir", default=None)
    p.set_defaults(func=_cmd_datasets)

    p = sub.add_parser("split", help="write one file per party (features; labels only for active parties)")
    p.add_argument("dataset", help="a registered dataset name, a LIBSVM file (split in streaming, "
                                   "in bounded memory), or one CSV file with id, label and feature columns")
    p.add_argument("-n", "--parties", type=int, required=True, help="q, number of parties")
    p.add_argument("-m", "--active", default="1", help="count m (parties 0..m-1) or list like 0,2")
    p.add_argument("--out", required=True, help="folder for party-<p>/ (or party-<p>.npz) and manifest.json")
    p.add_argument("--format", choices=("folder", "npz"), default="folder",
                   help="folder: party-<p>/ of .npy arrays the ranks memory-map; npz: one compressed file "
                        "per party (registered datasets only)")
    p.add_argument("--n-features", type=int, default=None,
                   help="LIBSVM file: its width (default: a stand-in's sidecar, else the largest index)")
    p.add_argument("--task", choices=("binary", "regression", "multiclass"), default="binary",
                   help="LIBSVM or CSV file: how its labels are read")
    p.add_argument("--chunk-mb", type=float, default=8.0, help="LIBSVM file: text read per chunk (MiB)")
    p.add_argument("--seed", type=int, default=0, help="train/test split seed")
    p.add_argument("--partition-seed", type=int, default=None,
                   help="feature partition seed (default: --seed)")
    p.add_argument("--contiguous", action="store_true", help="contiguous blocks instead of random ones")
    p.add_argument("--strips", action="store_true",
                   help="registered square-image datasets (Fashion-MNIST): q vertical strips of the image")
    p.add_argument("--column-order", choices=("auto", "index", "frequency"), default="auto",
                   help="how each party numbers its columns: by global index, or by how many rows use them "
                        "(faster updates on wide, heavy-tailed data: the busy columns share cache lines); "
                        "auto: by frequency for blocks over 65,536 columns")
    p.add_argument("--overwrite", action="store_true")
    p.add_argument("--data-dir", default=None)
    p.set_defaults(func=_cmd_split)

    p = sub.add_parser("synth", help="write a synthetic STAND-IN LIBSVM file of news20's or webspam's shape")
    p.add_argument("shape", choices=("news20", "webspam"))
    p.add_argument("--rows", type=int, default=None, help="rows (default: the real file's)")
    p.add_argument("--out", default=".", help="file, or folder for <shape>-standin.svm (default: here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--mean-nnz", type=float, default=None,
                   help="mean nonzeros a row (default: the real file's, 455 / 3,728)")
    p.add_argument("--label-noise", type=float, default=0.05, help="probability of flipping a label")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_synth)

    from vertical.standardize import MODES as STANDARDIZE

    p = sub.add_parser("reference", help="train the non-federated (NonF) reference on pooled data")
    p.add_argument("--dataset", default="breast-cancer")
    p.add_argument("--party-files", default=None, metavar="FOLDER",
                   help="pool the party files of one folder instead (from `vfl split`, or party-<p>.csv "
                        "files with -n and -m): for data held on one machine")
    p.add_argument("-n", "--parties", type=int, default=None, help="with a CSV --party-files folder")
    p.add_argument("-m", "--active", type=int, default=1, help="with a CSV --party-files folder")
    p.add_argument("--problem", default="logistic")
    p.add_argument("--lam", type=float, default=1e-4)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-dir", default=None)
    p.add_argument("--standardize", default="on", choices=STANDARDIZE,
                   help="scale each column as `vfl train --standardize` does (the same default), so that "
                        "f* is the one of the problem training solves")
    p.set_defaults(func=_cmd_reference)

    from parties.config import build_parser as training_options

    p = sub.add_parser("train", help="train VFB² over q MPI parties (starts mpiexec)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    training_options(p)
    from parties.hosts import add_arguments as host_options

    host_options(p)
    p.set_defaults(func=_cmd_train)

    from parties.federation.command import add_arguments as party_options

    p = sub.add_parser("party", help="start this organisation's party of a job file (no launcher, SSH or "
                                     "shared folder; docs/deployment.md)",
                       formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    party_options(p)
    p.set_defaults(func=_cmd_party)

    p = sub.add_parser("keygen", help="make this party's key pair for --secure-channels")
    p.add_argument("--party-dir", required=True, help="this party's own folder (its --party-dir)")
    p.add_argument("--rank", type=int, required=True, help="this party's rank")
    p.add_argument("--overwrite", action="store_true")
    p.set_defaults(func=_cmd_keygen)

    p = sub.add_parser("predict", help="score rows with a trained model, through secure aggregation")
    p.add_argument("run", help="the --out folder of a `vfl train` run")
    p.add_argument("--split", default="test", help="train or test rows of the parties' data")
    p.add_argument("--output", default=None, help="CSV file (default: <run>/predictions-<split>.csv)")
    p.set_defaults(func=_cmd_predict)

    p = sub.add_parser("serve", help="keep a trained run's parties up and score ids over HTTP "
                                     "(docs/serving.md)")
    p.add_argument("run", help="the --out folder of a `vfl train` run")
    p.add_argument("--port", type=int, required=True, help="the leader's HTTP port (0: any free port)")
    p.add_argument("--host", default="127.0.0.1", help="the address the leader listens on")
    p.add_argument("--window-ms", type=float, default=1.0,
                   help="concurrent requests within this many ms of the first share one aggregation")
    p.add_argument("--max-batch", type=int, default=1024, help="most rows of one aggregation (and request)")
    p.add_argument("--peer-timeout", type=float, default=10.0,
                   help="seconds the leader waits for a party's answer before it answers 503 and ends")
    p.set_defaults(func=_cmd_serve)

    p = sub.add_parser("export", help="write one party's part of a trained model (its block, scaling and "
                                      "column schema; docs/serving.md#export)")
    p.add_argument("run", help="the --out folder of a `vfl train` run, or this party's `vfl party` --folder")
    p.add_argument("--party", type=int, required=True, help="the rank whose part is written (its own folder)")
    p.add_argument("--out", required=True, help="folder for party-<rank>.export.json and .export.npz")
    p.add_argument("--overwrite", action="store_true", help="replace this party's part if it is there")
    p.add_argument("--data", help="a `vfl party` folder only: the party's --data it trained from (its "
                                  "party file or folder, for the column schema)")
    p.set_defaults(func=_cmd_export)

    p = sub.add_parser("align", help="private set intersection of the parties' id columns (starts mpiexec)")
    p.add_argument("-n", "--parties", type=int, required=True, help="q, number of parties")
    p.add_argument("--ids", nargs="+", required=True,
                   help="one CSV file per party in rank order, or one folder of q .csv files")
    p.add_argument("--id-column", default="id", help="the column holding the ids")
    p.add_argument("--out", required=True, help="folder for party-<p>.csv, the aligned files")
    p.add_argument("--peer-timeout", type=float, default=30.0,
                   help="seconds a party waits for a peer that delivers nothing (default 30)")
    p.set_defaults(func=_cmd_align)

    p = sub.add_parser("plot", help="plot loss, sub-optimality and test metric of runs; write metrics.csv")
    p.add_argument("runs", nargs="+", metavar="RUN",
                   help="--out folders of `vfl train` runs (e.g. runs/latest)")
    p.add_argument("--out", default=None, help="PNG file (default: <first run>/metrics.png)")
    p.add_argument("--x", choices=("time", "epoch", "round"), default=None,
                   help="x axis: training time in seconds, epochs, or rounds (horizontal runs); "
                        "default: time where the runs record it, else rounds")
    p.set_defaults(func=_cmd_plot)

    for name, about in (("hfl-train", "horizontal FL: a server rank and client ranks (starts mpiexec)"),
                        ("hfl-split", "write one data file per client process for `vfl hfl-train`")):
        sub.add_parser(name, help=about)  # listed here, parsed by parties.hfl (see main)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] in ("hfl-train", "hfl-split"):
        return _run_hfl(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    args.argv = argv  # the words themselves: which options were given, not only their values
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except ValueError as err:  # ConfigError, DatasetNotFoundError, PlotError too
        print(f"vfl {args.command}: error: {err}", file=sys.stderr)
        return 2
    except OSError as err:  # an --out that cannot be written, a file that is not there: the user's to fix
        where = f"{err.filename}: " if err.filename else ""
        print(f"vfl {args.command}: error: {where}{err.strerror or err}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
