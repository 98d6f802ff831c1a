"""Hosts made of Linux network namespaces (root only): each host namespace has one veth, `eth0`,
whose peer sits on a bridge in a namespace of its own, like machines on one switch. Addresses are
10.200.0.0/24 inside namespaces this module creates; nothing is added to the root namespace, and
everything is reached from inside the namespaces (processes started with `ip netns exec`, or a
thread of this process moved into a namespace with setns(2)).

    with Hosts(["a", "b", "c"]) as hosts:        # namespaces pdsv-<pid>-a ... and pdsv-<pid>-br
        hosts.addr("a")                          # "10.200.0.1"
        proc = hosts.popen("a", [...], env)      # a process on host a
        hosts.call("c", fn, *args)               # fn(*args) in a thread whose sockets are on host c
"""

from __future__ import annotations

import ctypes
import os
import subprocess
import threading

CLONE_NEWNET = 0x40000000
PREFIX = "pdsv-"
DEVICE = "eth0"  # the veth of every host namespace: UCX_NET_DEVICES names it


def ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], check=check, capture_output=True, text=True)


def netns_list() -> list[str]:
    """Every network namespace `ip netns` knows, by name."""
    return [line.split()[0] for line in ip("netns", "list").stdout.splitlines() if line.strip()]


def leftovers() -> list[str]:
    """Namespaces this module made that still exist (any run's)."""
    return [name for name in netns_list() if name.startswith(PREFIX)]


class Hosts:
    """Namespaces `<PREFIX><pid>-<host>` on one bridge; `delete()` (or leaving the `with`) removes
    them all, with every process still running inside them."""

    def __init__(self, hosts: list[str], subnet: str = "10.200.0"):
        self.tag = f"{PREFIX}{os.getpid()}-"
        self.hosts = list(hosts)
        self.subnet = subnet
        self.procs: list[subprocess.Popen] = []

    def ns(self, host: str) -> str:
        return self.tag + host

    def addr(self, host: str) -> str:
        return f"{self.subnet}.{self.hosts.index(host) + 1}"

    def __enter__(self) -> Hosts:
        try:
            self.create()
        except BaseException:
            self.delete()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.delete()

    def create(self) -> None:
        bridge = self.ns("br")
        ip("netns", "add", bridge)
        ip("-n", bridge, "link", "add", "br0", "type", "bridge")
        ip("-n", bridge, "link", "set", "br0", "up")
        for i, host in enumerate(self.hosts):
            ns = self.ns(host)
            ip("netns", "add", ns)
            # created inside the namespaces: no name of the root namespace is ever taken
            ip("link", "add", DEVICE, "netns", ns, "type", "veth", "peer", "name", f"p{i}", "netns", bridge)
            ip("-n", bridge, "link", "set", f"p{i}", "master", "br0", "up")
            ip("-n", ns, "addr", "add", f"{self.addr(host)}/24", "dev", DEVICE)
            ip("-n", ns, "link", "set", DEVICE, "up")
            ip("-n", ns, "link", "set", "lo", "up")

    def delete(self) -> None:
        for proc in self.procs:
            if proc.poll() is None:
                proc.kill()
        for proc in self.procs:
            try:
                proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
        for name in netns_list():
            if name.startswith(self.tag):
                # processes still inside (ranks a killed parent left behind) would keep it alive
                for pid in ip("netns", "pids", name, check=False).stdout.split():
                    try:
                        os.kill(int(pid), 9)
                    except ProcessLookupError:
                        pass
                ip("netns", "delete", name, check=False)

    def exec(
        self, host: str, *cmd: str, check: bool = True, stdin: str | None = None
    ) -> subprocess.CompletedProcess:
        """A command on `host`, run to its end (e.g. `nft`, `tc`); `stdin`: its input."""
        return subprocess.run(
            ["ip", "netns", "exec", self.ns(host), *cmd],
            check=check,
            capture_output=True,
            text=True,
            input=stdin,
        )

    def popen(self, host: str, cmd: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        """A process on `host`, killed by delete() if still running. It runs in IPC and PID
        namespaces of its own too, like a process of another machine: shared-memory transports
        (UCX's posix, sysv and cma) see a peer on another host as unreachable and go through the
        NIC, as between machines. /proc is the PID namespace's own, as on another machine (UCX reads
        /proc/<its pid>, which in the root namespace's /proc is another process or none). Killing the
        returned process kills everything it started (its PID namespace ends with it)."""
        unshare = ["unshare", "--ipc", "--pid", "--mount-proc", "--fork", "--kill-child"]
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(host), *unshare, *cmd], env=env, **kw)
        self.procs.append(proc)
        return proc

    def call(self, host: str, fn, *args, **kw):
        """fn(*args, **kw) with its sockets on `host` (in_netns)."""
        return in_netns(self.ns(host), fn, *args, **kw)


def join_netns(name: str) -> None:
    """Moves the calling thread into network namespace `name` (setns(2))."""
    fd = os.open(f"/var/run/netns/{name}", os.O_RDONLY)
    try:
        if ctypes.CDLL(None, use_errno=True).setns(fd, CLONE_NEWNET) != 0:
            raise OSError(ctypes.get_errno(), "setns")
    finally:
        os.close(fd)


def in_netns(name: str, fn, *args, **kw):
    """fn(*args, **kw) in a new thread that first joins network namespace `name` (setns(2) changes
    the calling thread only): every socket it opens is in that namespace. Returns fn's result or
    raises its exception."""
    out: dict = {}

    def run() -> None:
        try:
            join_netns(name)
            out["value"] = fn(*args, **kw)
        except BaseException as e:  # handed to the caller
            out["error"] = e

    thread = threading.Thread(target=run, name=f"netns-{name}")
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]
