"""``vfl train --hostfile FILE [--launcher-exec PROG] [--iface NAME]``: one job across several hosts.

These are launch options, not part of the job's configuration: they become Hydra's own environment
variables for ``mpiexec`` (``HYDRA_HOST_FILE``, ``HYDRA_LAUNCHER_EXEC``, ``HYDRA_IFACE``), so the
ranks' ``config.json`` is the same on one host and on many. Without ``--hostfile`` nothing changes.
Across hosts MPICH is put on its OFI netmod unless ``MPIR_CVAR_CH4_NETMOD`` says otherwise: on the
wheel's default UCX netmod over TCP the VFB² runtime stalled (``docs/multi-host.md``).
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Mapping
from pathlib import Path

#: MPICH's netmod for jobs across hosts, unless the environment names one.
NETMOD = "ofi"


def add_arguments(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("across hosts (docs/multi-host.md)")
    group.add_argument("--hostfile", default=None, metavar="FILE",
                       help="Hydra host file: one host (name or address) a line, optionally `host:slots`; "
                            "ranks are placed round-robin, rank p on the p-th host")
    group.add_argument("--launcher-exec", default=None, metavar="PROG",
                       help="program Hydra's ssh launcher runs as `PROG HOST COMMAND` to start its proxy "
                            "on HOST; without it, ssh")
    group.add_argument("--iface", default=None, metavar="NAME",
                       help="network interface whose address mpiexec gives the hosts to call it back on "
                            "(when this host's name resolves to a loopback address)")


def mpiexec_env(args: argparse.Namespace, environ: Mapping[str, str] = os.environ) -> dict[str, str]:
    """Hydra's environment for ``args`` (empty without ``--hostfile``); ValueError for bad input."""
    if args.launcher_exec is not None and args.hostfile is None:
        raise ValueError("--launcher-exec needs --hostfile (which hosts to launch on)")
    if args.iface is not None and args.hostfile is None:
        raise ValueError("--iface needs --hostfile")
    if args.hostfile is None:
        return {}
    hostfile = Path(args.hostfile)
    try:
        hosts = [line.split("#")[0].strip() for line in hostfile.read_text().splitlines()]
    except OSError as err:
        raise ValueError(f"--hostfile {hostfile}: cannot read it ({err.strerror})") from None
    if not any(hosts):
        raise ValueError(f"--hostfile {hostfile}: no host in it (one host name or address a line)")
    env = {"HYDRA_HOST_FILE": str(hostfile.resolve())}
    if args.launcher_exec is not None:
        launcher = Path(args.launcher_exec)
        if not (launcher.is_file() and os.access(launcher, os.X_OK)):
            raise ValueError(f"--launcher-exec {launcher}: not an executable file")
        env |= {"HYDRA_LAUNCHER": "ssh", "HYDRA_LAUNCHER_EXEC": str(launcher.resolve())}
    if args.iface is not None:
        if not Path("/sys/class/net", args.iface).exists():
            raise ValueError(f"--iface {args.iface}: no such network interface on this host")
        env["HYDRA_IFACE"] = args.iface
    if "MPIR_CVAR_CH4_NETMOD" not in environ:
        env["MPIR_CVAR_CH4_NETMOD"] = NETMOD
    return env
