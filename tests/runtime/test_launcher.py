"""RankGroup failure isolation (docs/design.md invariant 9), with real rank processes over gloo.

A command that raises on some rank while every rank answers fails that command only; the group
goes on serving. Ranks left inside a collective that a failed peer never joined break the group
(after error_grace_s), and so does a dead rank; `unhealthy()` then says why.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass

import pytest

from pdserve.runtime.launcher import CommandFailed, LaunchConfig, RankError, RankGroup
from tests.reference import free_port
from tests.servers import pid_alive


@dataclass(frozen=True)
class Cmd:
    value: int
    fail_rank: int = -1  # this rank raises ...
    before_collective: bool = False  # ... before the all-reduce (its peers block in it) or after it


class SumWorker:
    """Each command: all-reduce the value over the group, return the sum."""

    def __init__(self, rank: int, world: int, payload):
        self.rank = rank

    def handle(self, cmd: Cmd):
        import torch
        import torch.distributed as dist

        if cmd.fail_rank == self.rank and cmd.before_collective:
            raise ValueError(f"bad input {cmd.value}")
        t = torch.tensor([cmd.value])
        dist.all_reduce(t)
        if cmd.fail_rank == self.rank:
            raise ValueError(f"bad input {cmd.value}")
        return int(t)


class EnvWorker:
    """Each command: the value of the environment variable it names, in this rank."""

    def __init__(self, rank: int, world: int, payload):
        pass

    def handle(self, name: str):
        if name == "sleep":  # busy in a command, not waiting on its launcher's pipe
            time.sleep(600)
        return os.environ.get(name)


class FailsToStart:
    """Rank 0 raises while starting; rank 1 is still starting when rank 0 has exited, and stays so
    until the launcher, having noticed, stops it (30 s at most: on a busy machine the launcher may
    take more than a moment to notice, and rank 1 must not finish starting first)."""

    def __init__(self, rank: int, world: int, payload):
        if rank == 0:
            with open(payload, "w") as f:
                f.write(str(os.getpid()))
            raise ValueError("no checkpoint at /nowhere")
        time.sleep(30)


def test_a_rank_that_fails_to_start_says_why(tmp_path):
    """A rank that fails sends its traceback and exits (code 0) while its peer still starts: the
    error names the dead rank AND carries that traceback, not only "exited with code 0"."""
    g = RankGroup(FailsToStart, str(tmp_path / "rank0.pid"), LaunchConfig(2, free_port(), ready_timeout_s=60))
    # rank 1 may notice first (rank 0 served the rendezvous store it was still reading): then both
    # ranks sent a traceback and the error is rank 0's, as a failed start; else rank 0 is seen dead
    with pytest.raises(
        RankError,
        match=r"(?s)rank 0 (failed to start|\(pid \d+\) exited).*ValueError: no checkpoint at /nowhere",
    ):
        g.start()
    assert not any(p.is_alive() for p in g.procs)


@pytest.fixture
def group():
    g = RankGroup(SumWorker, None, LaunchConfig(2, free_port(), error_grace_s=3.0, collective_timeout_s=60))
    g.start()
    yield g
    g.shutdown()


def test_a_failed_command_leaves_the_group_usable(group):
    assert group.call(Cmd(2)) == [4, 4]
    for rank in (0, 1):
        with pytest.raises(CommandFailed, match=f"rank {rank}: ValueError: bad input 7") as e:
            group.call(Cmd(7, fail_rank=rank))
        assert "Traceback" in e.value.traceback and "Traceback" not in str(e.value)
        assert group.unhealthy() is None and group.broken is None
        assert group.call(Cmd(3)) == [6, 6]  # replies are in step with the commands


def test_ranks_stuck_after_a_failed_peer_break_the_group(group):
    start = time.monotonic()
    with pytest.raises(RankError, match=r"ranks \[1\] did not finish the command after rank 0 failed"):
        group.call(Cmd(5, fail_rank=0, before_collective=True))  # rank 1 waits in the all-reduce forever
    assert time.monotonic() - start < 30  # the error grace (3 s), not the collective timeout (60 s)
    assert "broken" in group.unhealthy()
    with pytest.raises(RankError, match="broken"):
        group.call(Cmd(1))


def test_a_dead_rank_breaks_the_group(group):
    os.kill(group.pids[1], signal.SIGKILL)
    with pytest.raises(RankError, match="rank 1"):
        group.call(Cmd(1))
    assert "rank 1" in group.unhealthy()


def listening_addresses(pid: int) -> list[str]:
    """Local addresses of the TCP sockets `pid` listens on (from /proc, IPv4 and IPv6)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:["):
            inodes.add(target[8:-1])
    found = []
    for table in ("tcp", "tcp6"):
        with open(f"/proc/{pid}/net/{table}") as f:
            for line in f.readlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and cols[9] in inodes:  # LISTEN
                    found.append(cols[1].split(":")[0])
    return found


def test_rank_processes_listen_on_loopback_only(group):
    loopback = {"0100007F", "00000000000000000000000001000000"}  # 127.0.0.1 and ::1 as /proc writes them
    addresses = [a for pid in group.pids for a in listening_addresses(pid)]
    assert addresses, "the rendezvous store and gloo listen somewhere"
    assert set(addresses) <= loopback, addresses


def test_each_group_sees_the_launchers_environment_at_its_start(monkeypatch):
    """Ranks fork from a forkserver started with the first group; they still see the environment of
    the launcher when their own group starts, changes since included."""
    for value in ("first", "second"):
        monkeypatch.setenv("PDSERVE_TEST_VALUE", value)
        g = RankGroup(EnvWorker, None, LaunchConfig(2, free_port()))
        g.start()
        try:
            assert g.call("PDSERVE_TEST_VALUE") == [value, value]
        finally:
            g.shutdown()


LAUNCHER = """
import sys, time
from pdserve.runtime.launcher import LaunchConfig, RankGroup, prestart
from tests.runtime.test_launcher import EnvWorker
if sys.argv[2:] == ["prestart"]:
    assert prestart("cpu")
    import torch  # what a server does between prestart and its ranks' start
g = RankGroup(EnvWorker, None, LaunchConfig(2, int(sys.argv[1])))
g.start()
for conn in g.conns:
    conn.send("sleep")
print(*g.pids, flush=True)
time.sleep(600)
"""


@pytest.mark.parametrize("start", ["with the group", "prestart"])
def test_ranks_die_with_a_killed_launcher(start):
    """SIGKILL the process that started a group while its ranks are inside a command: the ranks
    (children of the forkserver) follow it, also when the forkserver was started before the group."""
    proc = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(free_port()), start], stdout=subprocess.PIPE, text=True
    )
    try:
        pids = [int(p) for p in proc.stdout.readline().split()]
        assert len(pids) == 2 and all(pid_alive(p) for p in pids)
    finally:
        proc.kill()
        proc.wait(10)
    deadline = time.monotonic() + 15
    while any(pid_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.1)
    left = [p for p in pids if pid_alive(p)]
    for pid in left:  # leave nothing behind when it fails
        os.kill(pid, signal.SIGKILL)
    assert not left, "ranks outlived their launcher"


class ParentWorker:
    """Each command: this rank's parent process id."""

    def __init__(self, rank: int, world: int, payload):
        pass

    def handle(self, _):
        return os.getppid()


PRESTART = """
import sys
from multiprocessing import forkserver
from pdserve.runtime.launcher import LaunchConfig, RankGroup, prestart
from tests.runtime.test_launcher import ParentWorker
assert not prestart("cuda") and forkserver._forkserver._forkserver_pid is None  # cuda ranks are spawned
assert prestart("cpu")
server = forkserver._forkserver._forkserver_pid
import torch  # the server's own import, while the forkserver imports torch
g = RankGroup(ParentWorker, None, LaunchConfig(2, int(sys.argv[1])))
g.start()
print(server, *g.call(None), flush=True)
g.shutdown()
"""


def test_prestart_starts_the_forkserver_the_ranks_then_fork_from():
    out = subprocess.run(
        [sys.executable, "-c", PRESTART, str(free_port())], capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    server, *parents = (int(x) for x in out.stdout.split())
    assert server > 0 and parents == [server, server]
