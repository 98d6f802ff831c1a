"""`pdserve up`: the whole stack on this machine, as child processes of one launcher.

Starts N prefill instances and M decode instances (each `python -m pdserve.cli prefill|decode` on
free ports), waits until every one answers /health (deadline), then starts the router in front of
them and waits for its /health. Prints the URL and an example request, then watches: a child
that exits stops the stack (exit 1); Ctrl-C or SIGTERM stops every child (router first, then the
instances, SIGTERM then SIGKILL after a grace period) and exits 0. Children's output goes to
one log file each in --log-dir; a child that fails to start has its log's tail printed.
Imports no torch: the model directory must exist (cli.py builds the built-in one first).
"""

from __future__ import annotations

import ctypes
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx


@dataclass(frozen=True)
class StackConfig:
    model: str
    prefill_instances: int = 1
    prefill_cp: int = 1
    decode_instances: int = 1
    decode_tp: int = 1
    decode_dcp: int = 1
    dcp_index: str = "copy"
    transfer: str = "tcp"
    host: str = "127.0.0.1"
    port: int = 8000
    policy: str = "round_robin"
    admin_token: str | None = None
    log_dir: str = "pdserve-logs"
    max_kv_tokens: int | None = None  # per instance; None: each server's default
    ready_timeout_s: float = 600.0

    def __post_init__(self):
        for name in ("prefill_instances", "prefill_cp", "decode_instances", "decode_tp", "decode_dcp"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        if self.decode_tp % self.decode_dcp:
            raise ValueError(f"--decode-dcp {self.decode_dcp} must divide --decode-tp {self.decode_tp}")


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path


def _die_with_launcher() -> None:
    """In a child, before exec: SIGTERM when `pdserve up` dies, however it dies (Linux PR_SET_PDEATHSIG)."""
    try:
        ctypes.CDLL("libc.so.6", use_errno=True).prctl(1, signal.SIGTERM)
    except OSError:
        pass


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Stack:
    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.children: list[Child] = []
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)

    def _spawn(self, name: str, args: list[str], port: int) -> Child:
        log = self.log_dir / f"{name}.log"
        with log.open("w") as out:
            proc = subprocess.Popen([sys.executable, "-m", "pdserve.cli", *args], stdout=out, stderr=subprocess.STDOUT,
                                    start_new_session=True,  # Ctrl-C reaches the launcher only; it stops the rest
                                    preexec_fn=_die_with_launcher)
        child = Child(name, proc, f"http://127.0.0.1:{port}", log)
        self.children.append(child)
        return child

    def start_instances(self) -> tuple[list[Child], list[Child]]:
        c, model = self.cfg, self.cfg.model
        kv = ["--max-kv-tokens", str(c.max_kv_tokens)] if c.max_kv_tokens else []
        prefill, decode = [], []
        for i in range(c.prefill_instances):
            port = free_port()
            prefill.append(self._spawn(f"prefill-{i}", [
                "prefill", "--model", model, "--cp-size", str(c.prefill_cp), "--port", str(port),
                "--dist-port", str(free_port()), "--transfer", c.transfer, "--kv-residues", str(c.decode_dcp), *kv],
                port))  # residues = C_d: each decode rank's rows are contiguous in the prefill cache
        page = 64 if 64 % c.decode_dcp == 0 else 64 * c.decode_dcp
        for i in range(c.decode_instances):
            port = free_port()
            decode.append(self._spawn(f"decode-{i}", [
                "decode", "--model", model, "--tp-size", str(c.decode_tp), "--dcp-size", str(c.decode_dcp),
                "--dcp-index", c.dcp_index, "--page-size", str(page), "--port", str(port),
                "--dist-port", str(free_port()), "--transfer", c.transfer, *kv], port))
        return prefill, decode

    def start_router(self, prefill: list[Child], decode: list[Child]) -> Child:
        c = self.cfg
        args = ["router", "--model", c.model, "--host", c.host, "--port", str(c.port), "--policy", c.policy]
        args += [a for p in prefill for a in ("--prefill", p.url)] + [a for d in decode for a in ("--decode", d.url)]
        if c.admin_token:
            args += ["--admin-token", c.admin_token]
        child = self._spawn("router", args, c.port)
        child.url = f"http://{'127.0.0.1' if c.host in ('0.0.0.0', '::') else c.host}:{c.port}"
        return child

    def wait_ready(self, children: list[Child], deadline: float) -> None:
        """Polls every child's /health until all answer 200; raises if one exits or the deadline passes."""
        pending = list(children)
        while pending:
            for child in list(pending):
                self.check_alive(child)
                try:
                    if httpx.get(f"{child.url}/health", timeout=2).status_code == 200:
                        pending.remove(child)
                except httpx.HTTPError:
                    pass
            if pending and time.monotonic() > deadline:
                raise RuntimeError(f"not ready within {self.cfg.ready_timeout_s:.0f} s: "
                                   f"{', '.join(c.name for c in pending)} (logs in {self.log_dir})")
            time.sleep(0.3)

    def check_alive(self, child: Child) -> None:
        code = child.proc.poll()
        if code is not None:
            tail = "".join(child.log.read_text(errors="replace").splitlines(keepends=True)[-20:])
            raise RuntimeError(f"{child.name} exited with status {code}; the end of {child.log}:\n{tail}")

    def stop(self, grace_s: float = 20.0) -> None:
        for child in reversed(self.children):  # the router first: no new requests reach dying instances
            if child.proc.poll() is None:
                child.proc.terminate()
                try:
                    child.proc.wait(grace_s)
                except subprocess.TimeoutExpired:
                    child.proc.kill()
                    child.proc.wait()


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop()


def up(cfg: StackConfig, echo=print) -> int:
    """Runs the stack until Ctrl-C / SIGTERM (returns 0) or until a child dies (returns 1)."""
    stack = Stack(cfg)
    old = signal.signal(signal.SIGTERM, _raise_stop)
    try:
        deadline = time.monotonic() + cfg.ready_timeout_s
        prefill, decode = stack.start_instances()
        for child in prefill + decode:
            echo(f"{child.name}: {child.url} (pid {child.proc.pid}, log {child.log})")
        stack.wait_ready(prefill + decode, deadline)
        router = stack.start_router(prefill, decode)
        stack.wait_ready([router], deadline)
        model = httpx.get(f"{router.url}/v1/models", timeout=5).json()["data"][0]["id"]
        echo(f"router: {router.url} (pid {router.proc.pid}, log {router.log})")
        echo(f"ready: {router.url}/v1  (model {model!r}; Ctrl-C stops everything)")
        echo(f"example:\n  curl {router.url}/v1/completions -H 'Content-Type: application/json' "
             f"-d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'")
        while True:
            for child in stack.children:
                stack.check_alive(child)
            time.sleep(0.5)
    except (KeyboardInterrupt, _Stop):
        echo("stopping")
        return 0
    except RuntimeError as e:
        echo(f"error: {e}")
        return 1
    finally:
        # a second Ctrl-C or SIGTERM (process managers repeat them) must not cut the stop short and
        # orphan the instances; they also die with this process if it is killed (_die_with_launcher)
        old_int = signal.signal(signal.SIGINT, signal.SIG_IGN)
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        try:
            stack.stop()
        finally:
            signal.signal(signal.SIGTERM, old)
            signal.signal(signal.SIGINT, old_int)
