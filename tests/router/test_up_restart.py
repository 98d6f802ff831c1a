"""`pdserve up` supervises: one dead process never takes down more than itself (issue 12).

A rank of the decode instance killed with SIGKILL makes the instance exit (its watchdog, as
designed); `up` says so in one line, keeps the router up (its /health turns 503 while no decode
instance is usable), starts the instance again on the same port with a fresh log section, and a
greedy request through the router gives the same tokens as before. The router dying stops the
stack (exit 1, every process gone). With `--restart never` a dead instance stops the stack, as
before (exit 1).
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
from types import SimpleNamespace

import pytest

from pdserve.router.supervise import Backoff
from tests.reference import free_port
from tests.router.helpers import wait_until
from tests.servers import http, pid_alive


def stop_up(proc: subprocess.Popen) -> None:
    """SIGTERM, then SIGKILL if `up` has not stopped within 60 s."""
    proc.send_signal(signal.SIGTERM)
    try:
        proc.wait(60)
    except Exception:
        proc.kill()


def launch_up(model_dir, log_dir, *args: str) -> tuple[subprocess.Popen, list[str], str]:
    """Starts `pdserve up` and waits for its "ready:" line; returns (process, output lines so far and to
    come, router URL)."""
    port = free_port()
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            str(model_dir),
            "--port",
            str(port),
            "--log-dir",
            str(log_dir),
            "--ready-timeout",
            "120",
            "--shutdown-grace",
            "5",
            *args,
        ],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    lines: list[str] = []
    threading.Thread(target=lambda: lines.extend(proc.stdout), daemon=True).start()
    try:
        wait_until(
            lambda: proc.poll() is not None or any(line.startswith("ready: ") for line in lines),
            "`pdserve up` to be ready",
            150,
        )
        assert proc.poll() is None, "".join(lines)
    except BaseException:
        proc.kill()
        raise
    return proc, lines, f"http://127.0.0.1:{port}"


def all_pids(out: str, d_url: str) -> list[int]:
    """The launcher's children (from its output) and the decode instance's ranks."""
    return [int(p) for p in re.findall(r"\(pid (\d+),", out)] + rank_pids(d_url)


def rank_pids(d_url: str) -> list[int]:
    return [r["pid"] for r in http.get(f"{d_url}/capacity", timeout=10).json()["ranks"]]


def greedy(router: str) -> list[int]:
    model = http.get(f"{router}/v1/models", timeout=10).json()["data"][0]["id"]
    r = http.post(
        f"{router}/v1/completions",
        timeout=60,
        json={
            "model": model,
            "prompt": list(range(5, 40)),
            "max_tokens": 6,
            "temperature": 0,
            "ignore_eos": True,
            "return_token_ids": True,
        },
    )
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["token_ids"]


def router_health(router: str) -> int:
    return http.get(f"{router}/health", timeout=5).status_code


def assert_all_gone(pids: list[int]) -> None:
    wait_until(lambda: not [p for p in pids if pid_alive(p)], "every process of the stack to exit", 30)


@pytest.mark.slow
def test_up_restarts_a_dead_instance_and_stops_when_the_router_dies(model_dir, tmp_path):
    proc, lines, router = launch_up(
        model_dir,
        tmp_path,
        "--prefill-cp",
        "1",
        "--decode-tp",
        "2",
        "--decode-dcp",
        "2",
        "--max-kv-tokens",
        "1024",
    )
    try:
        out = "".join(lines)
        d_url = re.search(r"decode-0: (\S+)", out).group(1)
        router_pid = int(re.search(r"router: \S+ \(pid (\d+)", out).group(1))
        before, old_ranks = greedy(router), rank_pids(d_url)
        os.kill(old_ranks[1], signal.SIGKILL)
        wait_until(lambda: router_health(router) == 503, "the router to see its decode instance gone")
        wait_until(lambda: "decode-0: healthy again" in "".join(lines), "decode-0 to be restarted", 120)
        out = "".join(lines)
        assert proc.poll() is None and pid_alive(router_pid), out
        assert re.search(
            rf"decode-0 exited with status 1 \(log \S+decode-0\.log\); restarting it on {d_url} in 1 s", out
        ), out
        assert not set(rank_pids(d_url)) & set(old_ranks) and not any(pid_alive(p) for p in old_ranks)
        wait_until(lambda: router_health(router) == 200, "the router to take the decode instance back")
        assert greedy(router) == before
        log = (tmp_path / "decode-0.log").read_text()  # the crash's log survives the restart
        crash, marker = (
            log.find("stopping the decode instance"),
            log.find("===== pdserve up: restart 1 of decode-0"),
        )
        assert 0 <= crash < marker, log
        pids = all_pids("".join(lines), d_url)
        os.kill(router_pid, signal.SIGKILL)
        assert proc.wait(60) == 1
        assert "error: the router exited with signal SIGKILL" in "".join(lines), "".join(lines)
        assert_all_gone(pids)
        assert (
            "drained; stopping the decode instance" in (tmp_path / "decode-0.log").read_text()
        )  # SIGTERM, not KILL
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.slow
def test_up_restart_never_stops_the_stack_when_an_instance_dies(model_dir, tmp_path):
    proc, lines, router = launch_up(model_dir, tmp_path, "--restart", "never", "--max-kv-tokens", "256")
    try:
        d_url = re.search(r"decode-0: (\S+)", "".join(lines)).group(1)
        pids = all_pids("".join(lines), d_url)
        os.kill(rank_pids(d_url)[0], signal.SIGKILL)
        assert proc.wait(60) == 1
        assert "error: decode-0 exited with status 1" in "".join(lines), "".join(lines)
        assert_all_gone(pids)
    finally:
        if proc.poll() is None:
            proc.kill()


def test_restart_backoff_doubles_to_its_cap_and_starts_over_after_a_stable_run():
    b = Backoff(initial_s=1.0, max_s=30.0, stable_s=60.0)
    assert [b.delay(healthy_for_s=5.0) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert b.delay(healthy_for_s=60.0) == 1 and b.delay(healthy_for_s=0.0) == 2


def test_restart_backoff_max_reaches_every_watch_and_is_range_checked(tmp_path):
    from pdserve.router.launch import StackConfig
    from pdserve.router.supervise import Supervisor

    sup = Supervisor(None, None, [SimpleNamespace(name="decode-0")], "on-failure", backoff_max_s=2.0)
    backoff = sup.watches["decode-0"][1].backoff
    assert [backoff.delay(healthy_for_s=0.0) for _ in range(4)] == [1, 2, 2, 2]
    sup.http.close()
    for bad in (0.5, float("inf"), float("nan")):
        with pytest.raises(ValueError, match="restart-backoff-max"):
            StackConfig(model=str(tmp_path), restart_backoff_max_s=bad)
        with pytest.raises(ValueError, match="bootstrap-timeout"):
            StackConfig(model=str(tmp_path), bootstrap_timeout_s=bad - 0.5)
