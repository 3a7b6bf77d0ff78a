"""Several hosts on one Linux machine, to try pipeflow across hosts without a cluster (root only).

Each host is a network namespace with its own address on a veth pair into a bridge (the bridge
in a namespace of its own), its own hostname (``unshare --uts``), ``lo`` up, its own
``/etc/hosts`` and an empty ``/etc/resolv.conf`` (``ip netns exec`` mounts ``/etc/netns/<ns>/``
over ``/etc``), and optionally a bandwidth limit on its link (``tc ... tbf``, both directions).
Addresses come from a private /24 that exists only inside these namespaces: no default route,
nothing reaches the outside.  A host is lost by killing every process of its namespace, and
partitioned (no reset: packets just stop) by setting its bridge port down.

    python examples/emulated_hosts.py --hosts 2 --nproc 2 -- parallel.dp=2 parallel.pp=2

runs ``examples/multinode.sh`` on each host (the endpoint on host 0) and removes everything after.
Tests use :class:`EmulatedHosts` through ``tests/hosts.py``.
"""
from __future__ import annotations

import argparse
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Literal

ROOT = Path(__file__).resolve().parents[1]
NAMES = Literal["resolve", "missing", "loopback"]


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check)


def unavailable() -> str | None:
    """Why emulated hosts cannot be made here (not root, no ``ip``, namespaces refused), or None."""
    if shutil.which("ip") is None or shutil.which("unshare") is None:
        return "emulated hosts need iproute2's `ip` and util-linux's `unshare`"
    if os.geteuid() != 0:
        return "emulated hosts need root (network namespaces)"
    probe = f"pfprobe{secrets.token_hex(3)}"
    made = _ip("netns", "add", probe, check=False)
    if made.returncode != 0:
        return f"`ip netns add` was refused here: {made.stderr.strip()}"
    _ip("netns", "del", probe, check=False)
    return None


class EmulatedHosts:
    """`count` emulated hosts named ``host0``, ``host1``, ... (a context manager: made on enter,
    every process, namespace, link and file removed on exit).

    Args:
        count: how many hosts.
        names: what each host's name table says: ``resolve`` (every host's name to its address),
            ``missing`` (no host's name: they do not resolve anywhere), ``loopback`` (each host's
            own name to 127.0.0.1, as many cloud images and containers have it; the others to
            their addresses).
        rate_mbit: a bandwidth limit on each host's link (tbf), or None.
        private: folders that each host sees as its own disk: a host's processes find, at each of
            these paths, a folder of their host alone (``disk(host, path)``, bound over the path in
            a mount namespace of the host's), as nodes with local disks do.
    """

    def __init__(self, count: int = 2, names: NAMES = "resolve", rate_mbit: float | None = None,
                 private: tuple[str, ...] = ()) -> None:
        self.count, self.names, self.rate_mbit, self.private = count, names, rate_mbit, tuple(private)
        tag = secrets.token_hex(2)
        self.bridge_ns = f"pf{tag}br"
        self.namespaces = [f"pf{tag}h{i}" for i in range(count)]
        self.hostnames = [f"host{i}" for i in range(count)]
        subnet = 16 + secrets.randbelow(200)
        self.addresses = [f"10.213.{subnet}.{i + 1}" for i in range(count)]
        self._procs: list[subprocess.Popen] = []
        self._disks = Path(f"/tmp/pipeflow-hosts-{tag}")

    def __enter__(self) -> EmulatedHosts:
        try:
            self._make()
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _make(self) -> None:
        _ip("netns", "add", self.bridge_ns)
        _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
        _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
        for i, ns in enumerate(self.namespaces):
            _ip("netns", "add", ns)
            _ip("link", "add", "eth0", "netns", ns, "type", "veth", "peer", "name", f"port{i}", "netns", self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "set", f"port{i}", "master", "br0", "up")
            _ip("-n", ns, "addr", "add", f"{self.addresses[i]}/24", "dev", "eth0")
            _ip("-n", ns, "link", "set", "eth0", "up")
            _ip("-n", ns, "link", "set", "lo", "up")
            if self.rate_mbit:
                for where, dev in ((ns, "eth0"), (self.bridge_ns, f"port{i}")):
                    _ip("netns", "exec", where, "tc", "qdisc", "add", "dev", dev, "root", "tbf", "rate",
                        f"{self.rate_mbit}mbit", "burst", "256kb", "latency", "50ms")
            for path in self.private:
                self.disk(i, path).mkdir(parents=True, exist_ok=True)
                Path(path).mkdir(parents=True, exist_ok=True)
            etc = Path("/etc/netns") / ns
            etc.mkdir(parents=True, exist_ok=True)
            (etc / "hosts").write_text(self._hosts_file(i))
            (etc / "resolv.conf").write_text("# emulated host: no DNS\n")

    def _hosts_file(self, i: int) -> str:
        lines = ["127.0.0.1 localhost"]
        if self.names == "loopback":
            lines[0] += f" {self.hostnames[i]}"
        if self.names != "missing":
            lines += [f"{a} {n}" for j, (a, n) in enumerate(zip(self.addresses, self.hostnames))
                      if self.names == "resolve" or j != i]
        return "\n".join(lines) + "\n"

    def disk(self, host: int, path: str) -> Path:
        """The folder that `host` sees at `path` (one of ``private``), as this machine sees it."""
        return self._disks / f"host{host}" / str(Path(path).resolve()).strip("/").replace("/", "__")

    def endpoint(self, port: int = 29500) -> str:
        """``host0``'s address and `port`: where the rendezvous is hosted."""
        return f"{self.addresses[0]}:{port}"

    def run(self, host: int, argv: list[str], env: dict[str, str] | None = None, timeout_s: float = 240,
            **popen: object) -> subprocess.Popen:
        """Start `argv` on `host` (its namespace and hostname, cwd the repository) under
        ``timeout -k 5 timeout_s``; stdout and stderr merged into a text pipe unless given."""
        binds = "".join(f'mount --bind "{self.disk(host, path)}" "{path}" && ' for path in self.private)
        command = ["timeout", "-k", "5", str(timeout_s), "ip", "netns", "exec", self.namespaces[host],
                   "unshare", "--uts", "--mount", "sh", "-c", f'hostname "$0" && {binds}exec "$@"',
                   self.hostnames[host], *argv]
        popen = {"cwd": ROOT, "stdout": subprocess.PIPE, "stderr": subprocess.STDOUT, "text": True, **popen}
        proc = subprocess.Popen(command, env={**os.environ, **(env or {})}, **popen)  # type: ignore[call-overload]
        self._procs.append(proc)
        return proc

    def pids(self, host: int) -> list[int]:
        """Every process running in `host`'s namespace."""
        out = _ip("netns", "pids", self.namespaces[host], check=False).stdout
        return [int(p) for p in out.split()]

    def kill(self, host: int) -> None:
        """Lose `host`: SIGKILL every process of its namespace (until none is left)."""
        for _ in range(50):
            pids = self.pids(host)
            if not pids:
                return
            for pid in pids:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            time.sleep(0.05)

    def limit(self, host: int, rate_mbit: float | None) -> None:
        """Limit `host`'s link to `rate_mbit` both ways (tbf with a small burst: a slow link, not a
        fast one with a long pause), or lift the limit (None)."""
        for where, dev in ((self.namespaces[host], "eth0"), (self.bridge_ns, f"port{host}")):
            if rate_mbit is None:
                _ip("netns", "exec", where, "tc", "qdisc", "del", "dev", dev, "root", check=False)
            else:
                _ip("netns", "exec", where, "tc", "qdisc", "replace", "dev", dev, "root", "tbf", "rate",
                    f"{rate_mbit}mbit", "burst", "16kb", "latency", "5s")

    def partition(self, host: int, cut: bool = True) -> None:
        """Cut `host` off (its bridge port down: no reset, packets just stop), or join it again."""
        _ip("-n", self.bridge_ns, "link", "set", f"port{host}", "down" if cut else "up")

    def close(self) -> None:
        """Kill every process of every host, then remove the namespaces and their files."""
        for i, ns in enumerate(self.namespaces):
            if Path(f"/var/run/netns/{ns}").exists():
                self.kill(i)
        for proc in self._procs:
            if proc.poll() is None:
                proc.kill()
            try:
                proc.communicate(timeout=10)
            except (subprocess.TimeoutExpired, ValueError):
                pass
        for ns in [*self.namespaces, self.bridge_ns]:
            _ip("netns", "del", ns, check=False)
            shutil.rmtree(Path("/etc/netns") / ns, ignore_errors=True)
        shutil.rmtree(self._disks, ignore_errors=True)


def main(argv: list[str] | None = None) -> int:
    """Train across emulated hosts: ``examples/multinode.sh`` on each, the endpoint on host 0."""
    parser = argparse.ArgumentParser(description=main.__doc__, epilog="Hydra overrides follow '--'.")
    parser.add_argument("--hosts", type=int, default=2, help="how many hosts (default 2)")
    parser.add_argument("--nproc", type=int, default=2, help="processes per host (default 2)")
    parser.add_argument("--names", choices=["resolve", "missing", "loopback"], default="missing",
                        help="what the hosts' name tables say (default missing: names resolve nowhere)")
    parser.add_argument("--rate-mbit", type=float, default=None, help="a bandwidth limit per host link")
    parser.add_argument("--timeout", type=float, default=600, help="seconds before every host is stopped")
    parser.add_argument("overrides", nargs="*", help="Hydra overrides for train.py")
    args = parser.parse_args(argv)
    reason = unavailable()
    if reason:
        print(f"error: {reason}", file=sys.stderr)
        return 2
    env = {"NNODES": str(args.hosts), "NPROC": str(args.nproc), "PYTHON": sys.executable, "OMP_NUM_THREADS": "1"}
    with EmulatedHosts(args.hosts, args.names, args.rate_mbit) as hosts:
        env["ENDPOINT"] = hosts.endpoint()
        procs = [hosts.run(i, [str(ROOT / "examples" / "multinode.sh"), *args.overrides], env, args.timeout,
                           stdout=None, stderr=None) for i in range(args.hosts)]
        codes = [p.wait() for p in procs]
    print(f"exit status per host: {codes}")
    return max(codes, key=abs)


if __name__ == "__main__":
    raise SystemExit(main())
