"""Launching and supervising a VFB² job from one ordinary process (``vfl train``, ``mpirun.sh``).

``launch(options)`` resolves the job plan (:mod:`parties.plan`: the options checked against the data,
so a bad option fails before any rank starts), solves the NonF reference for f* when the data is a
named dataset, writes the plan to ``<out>/config.json``,
starts ``mpiexec -n q python -m mpi4py -m parties.rank`` (see :mod:`parties.rank`) and, when the job
ends, turns its outcome into one line and an exit code (:data:`EXIT_CODES`): which party failed
first, a divergence, a target not reached, an interrupt. ``--resume`` resolves nothing: it takes the
run's saved plan with the user's budget changes (:mod:`parties.resume`).
"""

from __future__ import annotations

import dataclasses
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from parties.checkpoint import MANIFEST, atomic_write, complete_epochs
from parties.config import ConfigError, RunConfig, differing_options
from parties.engine import warm_cache
from parties.orphans import tied_command
from parties.outcomes import EXIT_CODES, decisive_verdict, divergence_advice, find_stop, read_verdicts
from parties.plan import LEADER_ONLY, JobPlan, csv_party_folder, job_dataset, resolve, shared_part
from parties.resume import restored_line, resumed_plan
from parties.threads import launcher_environment, pool_environment, pools_for
from vertical.datasets.csv_parties import is_csv_folder
from vertical.problems import get_problem

# ------------------------------------------------------------------------------------------ launcher


def mpiexec_path() -> str:
    """``mpiexec`` from the ``mpich`` wheel next to this interpreter, else from PATH."""
    here = Path(sys.executable).parent / "mpiexec"
    if here.exists():
        return str(here)
    found = shutil.which("mpiexec")
    if found is None:
        raise FileNotFoundError("mpiexec not found: `pip install mpich` provides it")
    return found


def reference_f_star(config: RunConfig | JobPlan) -> float:
    """f* of the job's problem on its pooled training data (the NonF reference)."""
    from vertical.reference import solve_reference

    ds = job_dataset(config.dataset, config.seed, config.data_dir)
    problem = get_problem(config.problem, lam=config.lam)
    X = ds.X_train
    if config.standardize != "off":  # the problem the parties solve: each column scaled as its party does
        from vertical.standardize import apply_scaling, fit_scaling

        X = apply_scaling(X, fit_scaling(X, config.standardize))
    with pools_for(X.nnz if hasattr(X, "nnz") else X.size):  # small data: one BLAS thread, much faster
        return float(solve_reference(problem, X, ds.y_train).f_star)


def write_party_files(plan: JobPlan, out: Path) -> str:
    """Give each party its own file of a named dataset, so every rank reads only its own block;
    returns their folder.

    A simulation on one machine then runs exactly like a deployment: no rank ever loads the whole
    dataset (it would hold q copies of it at once), and the launcher loads it once for all. The
    folders are the memory-mappable layout: a rank maps its block instead of inflating a copy.
    """
    from vertical.datasets import split_to_party_files
    from vertical.partition import random_blocks

    folder = out / "parties"  # a fresh run's (a resumed run reads the files it wrote: parties.resume)
    ds = job_dataset(plan.dataset, plan.seed, plan.data_dir)
    blocks = random_blocks(ds.n_features, plan.parties, seed=plan.seed)
    split_to_party_files(ds, blocks, list(range(plan.active)), folder, partition_seed=plan.seed,
                         overwrite=True, layout="folder", column_order="auto")
    job_dataset.cache_clear()  # the launcher only waits from now on: let the data go
    return str(folder)


def convert_csv_party_files(plan: JobPlan, out: Path) -> str:
    """Turn a ``--party-files`` folder of ``party-<p>.csv`` files into binary party files in
    ``<out>/party-files`` (checked already, by :func:`parties.plan.resolve`); returns that folder."""
    from vertical.datasets.csv_parties import csv_parties_to_party_files
    from vertical.problems import PROBLEMS

    assert plan.party_files is not None
    source = Path(plan.party_files)
    parties = csv_party_folder(str(source), plan.parties, plan.active, PROBLEMS[plan.problem].task)
    folder = out / "party-files"
    try:
        csv_parties_to_party_files(parties, plan.active, folder, name=source.resolve().name)
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot write the converted party files ({err.strerror})") from None
    csv_party_folder.cache_clear()
    return str(folder)


def launch(config: RunConfig, *, given: frozenset[str] | None = None, extra_env: dict[str, str] | None = None,
           echo: bool = True) -> int:
    """Validate, prepare and run a job under ``mpiexec``; returns the exit code (:data:`EXIT_CODES`).

    ``given``: the options the user set explicitly (what ``--resume`` checks against the run's, see
    :func:`prepare`). ``echo=False`` keeps the job's own output (progress, summary) off the terminal;
    the launcher's one-line verdict on a failure is printed either way. A caller that needs the plan
    (the party files trained on, the run folder) calls :func:`prepare` and :func:`run_plan` itself.
    """
    return run_plan(prepare(config, given=given, echo=echo), extra_env=extra_env, echo=echo)


def prepare(options: RunConfig, *, given: frozenset[str] | None = None, echo: bool = True) -> JobPlan:
    """Resolve the job plan and make its run folder: the party files, f*, the channel keys, and
    ``<out>/config.json`` (the plan every rank reads). Raises :class:`ConfigError` before ``mpiexec``.

    With ``--resume`` the plan is the run's own (:mod:`parties.resume`): ``given`` names the options
    the user set (default: those that differ from the defaults), and only budget options may differ."""
    if options.resume:
        return _prepare_resume(options, differing_options(options) if given is None else given, echo)
    plan = resolve(options)
    if echo and plan.noise_multiplier:
        what = ("every ϑ is encrypted with Gaussian noise of" if plan.label_privacy != "dp-theta" else
                "each row's ϑ is clipped to norm 1 (an identity top: unclipped, at its exact "
                "sensitivity) and released with Gaussian noise of noise multiplier"
                if plan.options.theta_noise == "fresh" else
                "each row gets one Gaussian draw, added to its every ϑ, of noise multiplier")
        print(f"vfl train: label-DP ε = {plan.epsilon:g}, δ = {plan.delta:g}: {what} σ = "
              f"{plan.noise_multiplier:.3g}", flush=True)
    chosen_for_the_user = options.out is None
    out = run_folder(plan)  # named after the resolved dataset (news20-standin, not news20)
    plan = dataclasses.replace(plan, out=str(out))
    if (options.reference and options.f_star is None and options.party_files is None
            and options.label_privacy == "none"  # dp|he: a deployment's launcher has no pooled labels
            and options.model == "linear"):  # a network has no convex optimum to compare with
        plan = dataclasses.replace(plan, f_star=reference_f_star(plan))
    try:
        out.mkdir(parents=True, exist_ok=True)
        config_path = out / "config.json"
        config_path.write_text("{}\n")  # written whole below, once the job is prepared
    except OSError as err:
        raise ConfigError(f"--out {out}: cannot write there ({err.strerror})") from None
    if plan.party_files is None:
        plan = dataclasses.replace(plan, party_files=write_party_files(plan, out))
    elif is_csv_folder(plan.party_files):
        plan = dataclasses.replace(plan, party_files=convert_csv_party_files(plan, out))
    if options.secure_channels:
        plan = pin_channel_keys(plan)
    write_plan(plan)
    _clear_stale(out, resume=False)
    if chosen_for_the_user:
        _point_latest_to(out)
    return plan


def _prepare_resume(options: RunConfig, given: frozenset[str], echo: bool) -> JobPlan:
    """``--resume``: the run's saved plan with the user's budget changes; every check comes before the
    first write, so a refused resume leaves the folder as it was."""
    out = run_folder(options)
    plan = resumed_plan(options, given, out)
    if echo:
        print(restored_line(plan), flush=True)
    if plan.secure_channels:
        plan = pin_channel_keys(plan)  # a fresh job id: messages of the interrupted job are not this one's
    write_plan(plan)
    _clear_stale(out, resume=True)
    return plan


def write_plan(plan: JobPlan) -> None:
    """``<out>/config.json``, the plan every rank reads, and the leader's own file with what the others
    must not read (:func:`parties.plan.shared_part`)."""
    shared, leader_only = shared_part(plan)
    assert shared.out is not None
    config_path = Path(shared.out) / "config.json"
    atomic_write(config_path, lambda fh: fh.write((shared.to_json() + "\n").encode()))
    config_path.chmod(0o644)  # every rank reads it, as before (atomic_write makes owner-only files)
    path = plan.party_folder(0) / LEADER_ONLY
    if leader_only:
        path.parent.mkdir(parents=True, exist_ok=True)
        atomic_write(path, lambda fh: fh.write(json.dumps(leader_only).encode()))
    else:
        path.unlink(missing_ok=True)


def _clear_stale(out: Path, resume: bool) -> None:
    stale = [*out.glob("party-*.pid"), *out.glob("verdict-*.txt"), out / "result.json"]
    if not resume:  # a fresh run (--overwrite): nothing of the old one may survive
        stale += [out / MANIFEST, out / "metrics.jsonl", *out.glob("party-*.ckpt.npz"),
                  *out.glob("predictions-*.csv"), *out.glob("audit-*.npz")]
    for path in stale:
        path.unlink(missing_ok=True)


def run_plan(plan: JobPlan, *, extra_env: dict[str, str] | None = None, echo: bool = True) -> int:
    """Run a prepared job (:func:`prepare`) under ``mpiexec``; returns the exit code (:data:`EXIT_CODES`)."""
    assert plan.out is not None, "prepare() made the run folder"
    out = Path(plan.out)
    try:
        warm_cache(plan.options)
    except RuntimeError as err:
        print(f"vfl train: {err}", file=sys.stderr)
        return EXIT_CODES["failed"]
    watch = FirstDeath(out, plan.parties)
    env = {**rank_threads(plan.parties, plan.compute_threads, extra_env), **(extra_env or {})}
    try:
        code, output = run_mpi_module(plan.parties, "parties.rank", ["--config", str(out / "config.json")],
                                      extra_env=env, echo=echo)
    except KeyboardInterrupt:
        return _interrupted(out)
    if code == -signal.SIGINT or code == 128 + signal.SIGINT:
        return _interrupted(out)
    # the ranks' verdict files first: a line printed just before an abort may not survive mpiexec
    verdict = decisive_verdict(read_verdicts(out, plan.parties)) if code != 0 else None
    basis = output if verdict is None else verdict
    stopped = find_stop(basis) if code != 0 else None
    if stopped:
        outcome, reason = stopped
        advice = f"; {divergence_advice(plan.gamma)}" if outcome == "diverged" else ""
        print(f"vfl train: {reason}{advice}", file=sys.stderr)
        return EXIT_CODES[outcome]
    if code != 0 and not echo:  # the verdict below points to the ranks' own messages
        sys.stderr.write(output[-8000:])
    if code != 0:
        culprit = _failed_party(basis, watch.first())
        print(f"vfl train: the job failed (exit code {code}){culprit}. Checkpoints, if any, are in "
              f"{out} (--resume continues from them).", file=sys.stderr)
        return EXIT_CODES["failed"]
    return _outcome(plan, out)


def rank_threads(ranks: int, override: int | None, extra_env: dict[str, str] | None = None) -> dict[str, str]:
    """The pool sizes of the ``ranks`` ranks (:mod:`parties.threads`), as their environment. On this host
    alone: this host's share, or ``--compute-threads``. Across hosts (``HYDRA_HOST_FILE``) only an explicit
    ``--compute-threads``: the other hosts' CPUs are not seen from here, so each rank takes its own host's
    share when it starts (:func:`parties.threads.configure_rank`)."""
    if extra_env and "HYDRA_HOST_FILE" in extra_env:
        return {} if override is None else pool_environment(override)
    return launcher_environment(ranks, override)


RUNS, LATEST = "runs", "latest"
def pin_channel_keys(plan: JobPlan) -> JobPlan:
    """The plan with every party's public key and a fresh job id pinned, as the ranks receive it.

    With ``--channel-keys`` the public keys come from that file (each organisation made its key pair
    with ``vfl keygen`` in its own folder); otherwise each party gets a fresh pair in its folder
    (``--party-dir``, by default the run folder), as a simulation on one machine can.
    """
    import secrets

    from protocols.channels import generate_key_pair

    job_id = secrets.token_hex(16)
    if plan.channel_keys is not None:
        try:
            keys = json.loads(Path(plan.channel_keys).read_text())
            publics = [bytes.fromhex(k) for k in keys]
        except (OSError, ValueError, TypeError) as err:
            raise ConfigError(f"--channel-keys {plan.channel_keys}: not a JSON list of hex keys ({err})") \
                from None
        if len(publics) != plan.parties or any(len(k) != 32 for k in publics):
            raise ConfigError(f"--channel-keys {plan.channel_keys}: need {plan.parties} keys of 32 bytes")
        return dataclasses.replace(plan, job_id=job_id, channel_public_keys=tuple(k.hex() for k in publics))
    fresh = []
    for rank in range(plan.parties):
        private, public = generate_key_pair()
        write_private_key(plan.channel_key_path(rank), private)
        fresh.append(public.hex())
    return dataclasses.replace(plan, job_id=job_id, channel_public_keys=tuple(fresh))


def write_private_key(path: Path, private: bytes) -> None:
    """A private key readable by its owner only."""
    import os

    path.parent.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "wb") as fh:
        fh.write(private)


def run_folder(config: RunConfig | JobPlan) -> Path:
    """The run's folder: ``--out``, or a new ``runs/<time>-<dataset>`` (``--resume``: ``runs/latest``).

    A folder holding another run is never reused silently: that takes ``--resume`` or ``--overwrite``.
    """
    if config.out is None:
        if config.resume:
            return Path(RUNS, LATEST).resolve()
        name = "party-files" if config.party_files is not None else config.dataset
        stamp = time.strftime("%Y%m%d-%H%M%S")
        out = Path(RUNS, f"{stamp}-{name}")
        suffix = 1
        while out.exists():
            suffix += 1
            out = Path(RUNS, f"{stamp}-{name}-{suffix}")
        return out
    out = Path(config.out)
    if (out / "config.json").exists() and not (config.resume or config.overwrite):
        raise ConfigError(f"--out {out} holds another run: pass --resume to continue it, --overwrite to "
                          "replace it, or another --out")
    return out


def _point_latest_to(out: Path) -> None:
    """``runs/latest`` → this run (a symlink, replaced atomically); a real folder there is left alone."""
    import os

    latest = Path(RUNS, LATEST)
    try:
        latest.parent.mkdir(parents=True, exist_ok=True)
        tmp = latest.with_name(f".latest-{os.getpid()}")
        tmp.unlink(missing_ok=True)
        tmp.symlink_to(out.resolve(), target_is_directory=True)
        os.replace(tmp, latest)
    except OSError:
        pass  # a convenience only: the run itself is in `out`


def _interrupted(out: Path) -> int:
    try:
        where = (f"the last complete epoch is {complete_epochs(out):g}; resume with --resume --out {out} "
                 "(the run's options come from its config.json)")
    except (FileNotFoundError, ValueError):
        where = "no epoch was complete yet"
    print(f"vfl train: interrupted; {where}.", file=sys.stderr)
    return EXIT_CODES["interrupted"]


def _outcome(config: JobPlan, out: Path) -> int:
    """The leader's ``result.json`` as an exit code, with one line of advice where it failed."""
    try:
        result = json.loads((out / "result.json").read_text())
    except (OSError, ValueError):
        print(f"vfl train: the job ended without writing {out / 'result.json'}", file=sys.stderr)
        return EXIT_CODES["failed"]
    record = result.get("record", {})
    if result["outcome"] == "diverged":
        print(f"vfl train: diverged at epoch {record.get('epoch', 0):g} (loss {record.get('loss')}): "
              f"{divergence_advice(result.get('gamma', config.gamma))}", file=sys.stderr)
        return EXIT_CODES["diverged"]
    target = config.target_suboptimality
    if target is not None and result["outcome"] != "target":
        print(f"vfl train: --target-suboptimality {target:g} not reached: f − f* = "
              f"{record.get('suboptimality', float('nan')):.3g} after {result['epochs']:g} epochs "
              f"(raise --epochs or tune --gamma)", file=sys.stderr)
        return EXIT_CODES["target_missed"]
    return EXIT_CODES["ok"]


def run_mpi_module(ranks: int, module: str, args: list[str], *, extra_env: dict[str, str] | None = None,
                   echo: bool = True, keep: str = "output") -> tuple[int, str]:
    """``mpiexec -n ranks python -m mpi4py -m module args``, with this checkout importable.

    The job's output passes through unchanged (progress bars included); the last 64 KiB of it are
    returned with the exit code to explain a failure. ``keep="output"``: standard error is merged
    into standard output; ``keep="stderr"``: standard output goes straight to this process's and
    only standard error passes through here and is kept (``vfl party``, whose stop line is there).
    ``python -m mpi4py`` makes an uncaught exception in any rank abort the whole job instead of
    hanging it. ``mpiexec`` and the ranks die with this process, however it ends
    (:mod:`parties.orphans`). On Ctrl-C the job is stopped (SIGINT to ``mpiexec``, which forwards
    it; SIGKILL after 10 s), the ranks' interrupted tracebacks are not shown, and
    ``KeyboardInterrupt`` propagates once the job is gone.
    """
    import os

    cmd = [mpiexec_path(), "-n", str(ranks), sys.executable, "-m", "mpi4py", "-m", module, *args]
    env = {**os.environ, **(extra_env or {})}
    root = str(Path(__file__).resolve().parents[1])
    env["PYTHONPATH"] = root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
    # tied: if this process dies, even by SIGKILL, mpiexec does too, and with it the ranks (orphans.py)
    if keep == "stderr":
        proc = subprocess.Popen(tied_command(cmd), env=env, stderr=subprocess.PIPE)
        pipe, sink = proc.stderr, sys.stderr.buffer
    else:
        proc = subprocess.Popen(tied_command(cmd), env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        pipe, sink = proc.stdout, sys.stdout.buffer
    assert pipe is not None
    tail = bytearray()
    fd = pipe.fileno()
    try:
        while chunk := os.read(fd, 65536):
            if echo:
                sink.write(chunk)
                sink.flush()
            tail += chunk
            del tail[:-65536]
    except KeyboardInterrupt:
        proc.send_signal(signal.SIGINT)
        try:
            proc.communicate(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.communicate()
        raise
    return proc.wait(), tail.decode(errors="replace")


class FirstDeath:
    """Which party's process ended first, seen from outside the job.

    Each rank writes ``<out>/party-<rank>.pid`` at start, and a thread waits on Linux pidfds for the
    first exit. When one rank dies, Hydra kills the others within milliseconds, so on a loaded machine
    the thread may wake to find several ranks gone at once. Then the first cannot be told, and the
    launcher says so, naming them all: Hydra's banner and its exit codes are no tie-breaker, as they
    name a rank Hydra itself killed about one time in three (measured: docs/runtime.md,
    "Killed ranks").
    """

    def __init__(self, out: Path, parties: int) -> None:
        import threading

        self._out, self._parties = out, parties
        self._pids: dict[int, int] = {}
        self._gone_first: set[int] = set()
        self._thread = threading.Thread(target=self._watch, daemon=True, name="first-death")
        self._thread.start()

    def _watch(self) -> None:
        import os
        import select

        deadline = time.monotonic() + 600
        while len(self._pids) < self._parties:  # ranks write their pid files as they start
            if time.monotonic() > deadline:
                return
            for rank in range(self._parties):
                path = self._out / f"party-{rank}.pid"
                if rank not in self._pids and path.exists() and path.read_text().strip():
                    self._pids[rank] = int(path.read_text())
            time.sleep(0.05)
        fds: dict[int, int] = {}
        for rank, pid in self._pids.items():
            try:
                fds[os.pidfd_open(pid)] = rank
            except (ProcessLookupError, OSError):
                self._gone_first.add(rank)
        if not self._gone_first:
            poller = select.poll()
            for fd in fds:
                poller.register(fd, select.POLLIN)
            self._gone_first = {fds[fd] for fd, _ in poller.poll()}
        for fd in fds:
            os.close(fd)

    def first(self) -> tuple[int, ...]:
        """The ranks the watcher found gone when it first woke, in order: one rank is the first to die;
        several were gone together (a tie); none: unknown."""
        self._thread.join(timeout=2.0)  # the job has ended: the watcher is waking, if not yet done
        return tuple(sorted(self._gone_first))


def died_first(gone: tuple[int, ...], name=lambda rank: f"party {rank}") -> str | None:
    """"party 2 died first", or for a tie "party 0 or party 2 died first (…)"; None if unknown."""
    if not gone:
        return None
    if len(gone) == 1:
        return f"{name(gone[0])} died first"
    names = [name(rank) for rank in gone]
    return (f"{', '.join(names[:-1])} or {names[-1]} died first (all were gone when the launcher "
            "looked: the machine was too busy to tell which)")


def _failed_party(output: str, first_dead: tuple[int, ...]) -> str:
    """", party N ..." for a party another one caught sending an invalid message, else the party that
    reported a fatal error, else the first one that died."""
    offender = re.search(r"\] (party \d+ sent an invalid [^\n]*)", output)
    if offender:
        return f": {offender.group(1)}"
    named = re.search(r"\[party (\d+)\]", output)
    if named:
        return f": party {named.group(1)} failed (see its message above)"
    if first_dead:
        return f": {died_first(first_dead)}, and the others were stopped"
    return ""
