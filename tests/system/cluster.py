"""pdserve processes on namespace hosts (tests/system/netns.py), started with the flags a user gives
on separate machines: `--host` (the HTTP API and, on a prefill, the side channel it advertises as
the bootstrap address), `--data-host` (the decode ranks' TCP receivers), UCX_NET_DEVICES naming the
host's NIC and UCX_TLS as the README documents for hosts without RDMA. Everything the tests send
goes from inside a namespace (Hosts.call)."""

from __future__ import annotations

import os
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx

from tests.servers import AUTH
from tests.system.netns import DEVICE, Hosts

UCX_TLS = "tcp,sm,self"  # README, Deploy: hosts without RDMA


@dataclass
class Proc:
    name: str
    host: str
    url: str
    proc: object
    log: Path
    env: dict = field(default_factory=dict)

    def tail(self, n: int = 40) -> str:
        return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])


def host_env(**extra: str) -> dict:
    """The environment of a pdserve process on a namespace host: this one (the internal token,
    PYTHONPATH) plus UCX on the host's veth, and `extra`."""
    return {**os.environ, "UCX_NET_DEVICES": DEVICE, "UCX_TLS": UCX_TLS, **extra}


def start(hosts: Hosts, host: str, name: str, args: list[str], port: int, logs: Path, env: dict) -> Proc:
    """`pdserve ARGS --host <the host's address> --port PORT` on `host`, output in logs/NAME.log."""
    log = logs / f"{name}.log"
    out = log.open("w")
    cmd = [sys.executable, "-m", "pdserve.cli", *args, "--host", hosts.addr(host), "--port", str(port)]
    proc = hosts.popen(host, cmd, env=env, stdout=out, stderr=out)
    return Proc(name, host, f"http://{hosts.addr(host)}:{port}", proc, log, env)


def get(url: str, timeout: float = 5.0) -> httpx.Response:
    return httpx.get(url, headers=AUTH, timeout=timeout, trust_env=False)


def wait_healthy(hosts: Hosts, procs: list[Proc], timeout_s: float = 240.0, via: str = "r") -> None:
    """Polls every process's /health from host `via` until all answer 200."""

    def poll() -> None:
        pending = list(procs)
        deadline = time.monotonic() + timeout_s
        while pending:
            for p in list(pending):
                assert p.proc.poll() is None, f"{p.name} exited:\n{p.tail()}"
                try:
                    if get(f"{p.url}/health", 2).status_code == 200:
                        pending.remove(p)
                except httpx.HTTPError:
                    pass
            assert time.monotonic() < deadline, f"not healthy in {timeout_s} s: {[p.name for p in pending]}"
            time.sleep(0.3)

    hosts.call(via, poll)


def complete(url: str, prompt: list[int], max_tokens: int, timeout: float = 120.0) -> httpx.Response:
    """POST /v1/completions of token ids, temperature 0, the generated ids returned."""
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "return_token_ids": True,
    }
    return httpx.post(f"{url}/v1/completions", json=body, timeout=timeout, trust_env=False)


def rx_bytes(hosts: Hosts, host: str) -> int:
    """Bytes the host's NIC has received (what crossed the veth into it)."""
    return int(hosts.exec(host, "cat", f"/sys/class/net/{DEVICE}/statistics/rx_bytes").stdout)
