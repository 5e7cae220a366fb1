"""``python -m experiments <name> [options]``: run one benchmark or reproduction.

Each experiment is a module of this package with a ``main(argv)`` function; its outputs (CSV/JSON,
a Markdown table, PNG plots) go to ``experiments/results/<name>/``. ``python -m experiments`` lists
them.
"""

from __future__ import annotations

import importlib
import sys

#: name → (module, one-line description)
EXPERIMENTS: dict[str, tuple[str, str]] = {
    "fedbat_table1": ("experiments.fedbat_table1",
                      "FedBAT paper Table 1 (FMNIST) + rho/phi ablations, reduced; --quick for a smoke run"),
    "secure_aggregation": ("experiments.bench_secure_aggregation",
                           "secure aggregation vs a plain MPI Reduce (issue 3 benchmark)"),
    "psi": ("experiments.bench_psi", "vfl align PSI: time and bytes at 10k-1M ids (issue 17)"),
    "channels": ("experiments.bench_channels", "--secure-channels: seal/open cost, per-update time vs plain"),
    "against_commit": ("experiments.bench_against_commit",
                       "this tree against an earlier commit, alternating: a9a ms per update, HFL round time"),
    "startup": ("experiments.bench_startup",
                "start-up of the quickstart's q = 4 job (wall - training) and where it goes, vs a commit"),
    "threads": ("experiments.bench_threads",
                "threads per rank: an HFL job over MPI, this host's share per rank vs every core"),
    "hfl_busy": ("experiments.bench_hfl_busy",
                 "an HFL round idle and beside a 4-party job: torch thread settings, parties.hfl 4 ranks"),
    "piggyback": ("experiments.bench_piggyback",
                  "--piggyback vs plain dispatch: time per dominated update, with a serial run beside"),
    "hot_path_floor": ("experiments.bench_hot_path_floor",
                       "the B = 1 exchange in one compiled loop per rank vs vfl train, alone and beside"),
    "hot_path": ("experiments.bench_hot_path",
                 "the B = 1 hot path vs an earlier commit, alternating: alone and beside a second job"),
    "update_profile": ("experiments.bench_update_profile",
                       "where a B = 1 update's time goes: q ranks on the cores, CPU per thread role"),
    "compression": ("experiments.bench_compression", "compressor round-trip cost and payload sizes"),
    "update_cost": ("experiments.bench_update_cost", "time per update vs block width: lazy vs eager kernels"),
    "update_width": ("experiments.bench_update_width",
                     "time per dominated update in whole vfl train jobs vs block width (1e2-4e6)"),
    "join": ("experiments.bench_join",
             "vfl party: the join of q parties, and time per update joined vs one mpiexec (issue 27)"),
    "multihost": ("experiments.bench_multihost",
                  "parties on one host vs one network namespace each (TCP): time per update, round trip"),
    "webspam_shape": ("experiments.bench_webspam_shape",
                      "webspam's 16.6M features (rows reduced) vs 10k: time per epoch, peak RSS per rank"),
    "dead_peer": ("experiments.bench_dead_peer",
                  "MPICH (OFI/tcp): do MPI calls to a joined peer that died return, fail or hang"),
    "workers": ("experiments.bench_workers", "k = 1 vs k = 2 worker threads on one shared block (issue 4)"),
    "hfl_quick": ("experiments.hfl_quick", "horizontal FL smoke run on Fashion-MNIST + round timing"),
    "hfl_scafcom": ("experiments.hfl_scafcom",
                    "SCAFCOM/SCALLION paper Figs 2-4 on Fashion-MNIST (Top-r, dithering, beta/alpha sweeps)"),
    "hfl_isca": ("experiments.hfl_isca",
                 "ISCA paper Figs 1-6 on Fashion-MNIST: ISCA/ISCAM vs SCALLION/FedCOMGATE, IID vs non-IID"),
    "vnn_runtime": ("experiments.vnn_runtime",
                    "vfl train --model mlp: async vs lock-step with a straggler; vs the centralised net"),
    "vnn_privacy_summary": ("experiments.vnn_privacy_summary",
                            "dp-theta: every protected run's accuracy cost against the attack's AUC"),
    "vfb2_runtime": ("experiments.vfb2_runtime",
                     "VFB² runtime benchmarks: async vs sync, cost of federation, k threads (issue 4)"),
    "vfb2_batches": ("experiments.vfb2_batches",
                     "batch size x in-flight x link delay: updates/s, time to 1e-3, federation cost"),
    "vfb2_table2": ("experiments.vfb2_table2", "VFB² paper Table 2: losslessness, classification accuracy"),
    "vfb2_table3": ("experiments.vfb2_table3", "VFB² paper Table 3: losslessness, regression RMSE"),
    "vfb2_async": ("experiments.vfb2_async", "VFB² paper Figs 3-4: async VFB² vs sync VFB with a straggler"),
    "vfb2_scalability": ("experiments.vfb2_scalability",
                         "VFB² paper Fig 2: q-parties speedup, async vs sync"),
    "vfb2_lr_sweep": ("experiments.vfb2_lr_sweep", "learning-rate sweep over the VFB² paper's γ grid"),
    "feddro": ("experiments.feddro_fmnist",
               "FedDRO paper Section 6 design on Fashion-MNIST-ST: baselines, period I, number of clients"),
    "label_he": ("experiments.bench_label_he",
                 "--label-privacy he: cost of one encrypted batch, and the HE libraries compared"),
    "label_he_jobs": ("experiments.bench_label_he_jobs",
                      "--label-privacy he on a9a: OU vs Paillier, ε-noise on ϑ vs on decrypted gradients"),
    "label_he_pack": ("experiments.bench_label_he_pack",
                      "--label-privacy he on a9a: packed against unpacked decryption, B = 256 and 1,024"),
    "label_he_floor": ("experiments.bench_label_he_floor",
                       "--label-privacy he on a9a: the CPU an epoch needs per operation, and its floor"),
    "label_he_overlap": ("experiments.bench_label_he_overlap",
                         "--label-privacy he on a9a: an epoch per stage and rank, this tree vs a commit"),
    "label_dp_sim": ("experiments.label_dp_sim",
                     "he --epsilon's noise (on ϑ, on the gradient, RR labels) in one process, no HE"),
    "label_dp_limit": ("experiments.label_dp_limit",
                       "what label-DP's per-row AUC cap costs a central logistic regression (a reference)"),
    "label_attacks": ("experiments.label_attacks",
                      "label inference by a curious passive party from its own transcript, per mode"),
    "default_step": ("experiments.bench_default_step",
                     "test accuracy without --gamma (the step derived from the data) vs NonF, B = 1 and 64"),
    "default_step_scan": ("experiments.default_step_scan",
                          "candidate default steps simulated in one process: accuracy vs NonF in seconds"),
    "vnn": ("experiments.vnn",
            "split networks by simulated VFB² vs the centralised network (FMNIST, D1, a9a); label attacks"),
    "control_plane": ("experiments.bench_control_plane",
                      "barrier-time exchanges: polled point to point (deadlines) vs blocking collectives"),
    "serve_latency": ("experiments.bench_serve_latency",
                      "vfl serve, q = 4: p50/p99 of one-row requests, rows/s with 64 concurrent clients"),
    "feddro_toy": ("experiments.feddro_toy", "FedDRO vs FedAvg-CO on closed-form problems (Thm 4.1, Fig. 6)"),
}


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if not args or args[0] in ("-h", "--help", "list"):
        print("usage: python -m experiments <name> [options]   (each name takes --help)\n")
        for name, (_, about) in EXPERIMENTS.items():
            print(f"  {name:<22} {about}")
        return 0
    name, rest = args[0], args[1:]
    if name not in EXPERIMENTS:
        print(f"unknown experiment {name!r}; known: {', '.join(EXPERIMENTS)}", file=sys.stderr)
        return 2
    from vertical.datasets import DatasetNotFoundError

    try:
        module = importlib.import_module(EXPERIMENTS[name][0])
        module.main(rest)
    except DatasetNotFoundError as err:  # a missing data file is the user's to fix: one line, exit 2
        print(f"python -m experiments {name}: {err}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as err:
        if err.name != "torch":
            raise
        print(f"python -m experiments {name} needs torch: pip install torch==2.13.0 (the CPU build), "
              "or pip install -e '.[hfl]'", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
