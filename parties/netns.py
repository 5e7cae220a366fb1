"""Emulated hosts on one Linux machine: one network namespace per party, joined by a bridge.

A VFB² job whose ranks all run in one network namespace talks over shared memory, so it says nothing
about a deployment where each organisation is its own machine. Here each "host" is a namespace with
its own veth interface and IPv4 address on a private bridge; ``mpiexec`` reaches it through a
launcher script (Hydra's ``ssh`` launcher with ``-launcher-exec``) that runs Hydra's proxy inside the
namespace, under its own host name, on MPICH's OFI netmod with libfabric's ``tcp`` provider. (The
wheel's default UCX netmod sees one kernel, boot id and all, and picks shared memory, which a real
second machine never offers; kept to UCX's TCP transport, the VFB² runtime stalled at its first
epoch, while OFI/tcp runs it.) Recipe and measurements: ``docs/multi-host.md``.

    python -m parties.netns up -n 4          # prints the environment for mpiexec / vfl train
    python -m parties.netns down             # removes what `up` made (safe to repeat)

Needs root, ``ip`` (iproute2) and ``unshare`` (util-linux); :func:`unavailable` says why not.
"""

from __future__ import annotations

import argparse
import contextlib
import ipaddress
import os
import re
import shlex
import shutil
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

DEFAULT_PREFIX = "vfl"
DEFAULT_SUBNET = "10.213.0.0/24"
#: Where each emulation keeps its hostfile, launcher script and launch log.
STATE_ROOT = Path("/run/vfl-netns") if os.access("/run", os.W_OK) else Path("/tmp/vfl-netns")
_PREFIX = re.compile(r"[a-z][a-z0-9]{0,9}")  # interface names: prefix + up to 3 digits + 'h'/'p' ≤ 15
#: The transport of every emulated host's ranks: MPICH's OFI netmod on libfabric's TCP provider.
TCP_TRANSPORT = {"MPIR_CVAR_CH4_NETMOD": "ofi", "FI_PROVIDER": "tcp"}


class NetnsError(RuntimeError):
    """Namespaces cannot be set up here, or a step of the setup failed; the message says which."""


@dataclass(frozen=True)
class EmulatedHosts:
    """The emulated hosts of one prefix: namespace names, addresses, and the files mpiexec needs."""

    prefix: str
    namespaces: tuple[str, ...]
    addresses: tuple[str, ...]
    bridge: str
    gateway: str
    folder: Path

    @property
    def hostfile(self) -> Path:
        return self.folder / "hosts"

    @property
    def launcher(self) -> Path:
        return self.folder / "launcher"

    @property
    def launch_log(self) -> Path:
        """One line ``<address> <namespace>`` per proxy the launcher started."""
        return self.folder / "launched.log"

    def train_options(self) -> list[str]:
        """The same as ``vfl train`` options (:mod:`parties.hosts`)."""
        return ["--hostfile", str(self.hostfile), "--launcher-exec", str(self.launcher),
                "--iface", self.bridge]

    def mpiexec_env(self) -> dict[str, str]:
        """Hydra's environment for a job across these hosts (``launch(config, extra_env=...)``).

        ``HYDRA_IFACE`` makes mpiexec announce the bridge's address to the proxies: its own host
        name resolves to 127.0.0.1, which inside a namespace is that namespace's loopback.
        """
        return {"HYDRA_HOST_FILE": str(self.hostfile), "HYDRA_LAUNCHER": "ssh",
                "HYDRA_LAUNCHER_EXEC": str(self.launcher), "HYDRA_IFACE": self.bridge}


def unavailable() -> str | None:
    """Why namespaces cannot be made here (one line), or None when they can."""
    if not sys.platform.startswith("linux"):
        return f"network namespaces need Linux (this is {sys.platform})"
    if os.geteuid() != 0:
        return "network namespaces need root (`ip netns add` is privileged)"
    for tool, package in (("ip", "iproute2"), ("unshare", "util-linux")):
        if shutil.which(tool) is None:
            return f"`{tool}` not found: install {package} (apt-get install {package})"
    probe = f"vflprobe{os.getpid() % 100000}"
    made = _run(["ip", "netns", "add", probe], check=False)
    if made.returncode != 0:
        return f"`ip netns add` fails here: {made.stderr.strip() or made.returncode}"
    _run(["ip", "netns", "delete", probe], check=False)
    return None


def setup(n_hosts: int, *, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET) -> EmulatedHosts:
    """Make ``n_hosts`` namespaces on a bridge; leftovers of the same prefix are removed first.

    On any failure everything made so far is removed and :class:`NetnsError` names the step.
    """
    reason = unavailable()
    if reason is not None:
        raise NetnsError(reason)
    hosts = plan(n_hosts, prefix=prefix, subnet=subnet)
    teardown(prefix)
    try:
        _build(hosts, ipaddress.ip_network(subnet).prefixlen)
    except BaseException:
        teardown(prefix)
        raise
    return hosts


def plan(n_hosts: int, *, prefix: str = DEFAULT_PREFIX, subnet: str = DEFAULT_SUBNET) -> EmulatedHosts:
    """Names and addresses of an emulation, checked, without touching the system."""
    if not _PREFIX.fullmatch(prefix):
        raise NetnsError(f"prefix {prefix!r}: 1-10 lower-case letters and digits, starting with a letter")
    try:
        network = ipaddress.ip_network(subnet)
    except ValueError as err:
        raise NetnsError(f"subnet {subnet!r}: {err}") from None
    usable = list(network.hosts())
    if not 1 <= n_hosts <= min(len(usable) - 1, 999):
        raise NetnsError(f"{n_hosts} hosts do not fit subnet {subnet} (one address is the bridge's)")
    return EmulatedHosts(prefix=prefix, namespaces=tuple(f"{prefix}-h{i}" for i in range(n_hosts)),
                         addresses=tuple(str(a) for a in usable[:n_hosts]), bridge=f"{prefix}br",
                         gateway=str(usable[-1]), folder=STATE_ROOT / prefix)


def teardown(prefix: str = DEFAULT_PREFIX) -> list[str]:
    """Remove the namespaces, bridge and files of ``prefix``; returns what was removed (idempotent).

    The host-side veth ends are deleted first, explicitly: deleting a namespace destroys its end (and
    so the pair) only when the kernel's asynchronous namespace cleanup runs, and a setup right after a
    teardown then found the old pair still there ("File exists").
    """
    if not _PREFIX.fullmatch(prefix):
        raise NetnsError(f"prefix {prefix!r}: 1-10 lower-case letters and digits, starting with a letter")
    removed = []
    links = _run(["ip", "-o", "link", "show"], check=False).stdout.splitlines()
    for line in links:
        fields = line.split(":")
        name = fields[1].strip().split("@")[0] if len(fields) > 1 else ""
        if re.fullmatch(rf"{prefix}\d+h", name):
            _run(["ip", "link", "delete", name], check=False)
    listed = _run(["ip", "netns", "list"], check=False).stdout.split()
    for name in listed:
        if re.fullmatch(rf"{prefix}-h\d+", name):
            _run(["ip", "netns", "delete", name], check=False)
            removed.append(name)
    if _run(["ip", "link", "show", f"{prefix}br"], check=False).returncode == 0:
        _run(["ip", "link", "delete", f"{prefix}br"], check=False)
        removed.append(f"{prefix}br")
    shutil.rmtree(STATE_ROOT / prefix, ignore_errors=True)
    return removed


@contextlib.contextmanager
def emulated_hosts(n_hosts: int, *, prefix: str = DEFAULT_PREFIX,
                   subnet: str = DEFAULT_SUBNET) -> Iterator[EmulatedHosts]:
    """:func:`setup` for the duration of a ``with`` block, then :func:`teardown`, whatever happens."""
    hosts = setup(n_hosts, prefix=prefix, subnet=subnet)
    try:
        yield hosts
    finally:
        teardown(prefix)


def _build(hosts: EmulatedHosts, prefixlen: int) -> None:
    br = hosts.bridge
    _run(["ip", "link", "add", br, "type", "bridge"])
    _run(["ip", "addr", "add", f"{hosts.gateway}/{prefixlen}", "dev", br])
    _run(["ip", "link", "set", br, "up"])
    for i, (ns, address) in enumerate(zip(hosts.namespaces, hosts.addresses, strict=True)):
        outer, inner = f"{hosts.prefix}{i}h", f"{hosts.prefix}{i}p"
        _run(["ip", "netns", "add", ns])
        _run(["ip", "link", "add", outer, "type", "veth", "peer", "name", inner])
        _run(["ip", "link", "set", outer, "master", br, "up"])
        _run(["ip", "link", "set", inner, "netns", ns])
        _run(["ip", "-n", ns, "addr", "add", f"{address}/{prefixlen}", "dev", inner])
        _run(["ip", "-n", ns, "link", "set", inner, "up"])
        _run(["ip", "-n", ns, "link", "set", "lo", "up"])
    hosts.folder.mkdir(parents=True, exist_ok=True)
    hosts.hostfile.write_text("".join(f"{a}\n" for a in hosts.addresses))
    hosts.launcher.write_text(_launcher_script(hosts))
    hosts.launcher.chmod(0o755)


def _launcher_script(hosts: EmulatedHosts) -> str:
    """Hydra calls ``<launcher> [ssh options] HOST COMMAND...``, and ssh would run COMMAND in a shell on
    HOST; this runs it in HOST's namespace (own UTS namespace too, so MPICH sees a distinct node)."""
    cases = "".join(f"  {a}) ns={ns} ;;\n" for a, ns in zip(hosts.addresses, hosts.namespaces, strict=True))
    log = shlex.quote(str(hosts.launch_log))
    return (
        "#!/bin/sh\n"
        "# Hydra's ssh launcher for emulated hosts, written by `python -m parties.netns up`.\n"
        'while [ "${1#-}" != "$1" ]; do shift; done  # ssh options Hydra adds (-x)\n'
        'host=$1; shift\n'
        'case "$host" in\n'
        f"{cases}"
        '  *) echo "$0: $host is not one of the emulated hosts" >&2; exit 255 ;;\n'
        "esac\n"
        f'echo "$host $ns" >> {log}\n'
        + "".join(f"export {k}={v}\n" for k, v in TCP_TRANSPORT.items()) +
        'exec ip netns exec "$ns" unshare --uts sh -c \'hostname "$0" && exec sh -c "$1"\' "$ns" "$*"\n'
    )


def _run(cmd: list[str], *, check: bool = True) -> subprocess.CompletedProcess[str]:
    done = subprocess.run(cmd, capture_output=True, text=True)
    if check and done.returncode != 0:
        raise NetnsError(f"`{shlex.join(cmd)}` failed: {done.stderr.strip() or done.returncode}")
    return done


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m parties.netns", description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    up = sub.add_parser("up", help="make N namespaces on a bridge; print the environment for mpiexec")
    up.add_argument("-n", "--hosts", type=int, required=True, help="number of emulated hosts (one a party)")
    up.add_argument("--subnet", default=DEFAULT_SUBNET, help="their IPv4 subnet (the last address: bridge)")
    for p in (up, sub.add_parser("down", help="remove the namespaces, bridge and files of a prefix")):
        p.add_argument("--prefix", default=DEFAULT_PREFIX, help="names: <prefix>-h<i>, bridge <prefix>br")
    args = parser.parse_args(argv)
    try:
        if args.command == "down":
            removed = teardown(args.prefix)
            print(f"removed: {' '.join(removed)}" if removed else f"nothing of prefix {args.prefix!r} left")
            return 0
        hosts = setup(args.hosts, prefix=args.prefix, subnet=args.subnet)
    except NetnsError as err:
        print(f"python -m parties.netns {args.command}: error: {err}", file=sys.stderr)
        return 2
    print(f"# {args.hosts} hosts: " + ", ".join(f"{ns}={a}" for ns, a in zip(hosts.namespaces,
                                                                             hosts.addresses, strict=True)))
    print(f"# vfl train -n {args.hosts} ... {shlex.join(hosts.train_options())}\n# or, for any mpiexec:")
    for key, value in hosts.mpiexec_env().items():
        print(f"export {key}={shlex.quote(value)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
