"""The stack side of bench/serve.py: `pdserve up` as a subprocess (the load comes from SGLang's client,
bench/load_client.py), and the latency statistics of the transformers baseline."""

from __future__ import annotations

import argparse
import math
import os
import secrets
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

from common import free_port  # bench/ is on sys.path when a script runs


# ---------------------------------------------------------------- prompts and statistics
def pct(xs: list[float], q: float) -> float | None:
    """Percentile q (0-100) with linear interpolation, like numpy's default."""
    if not xs:
        return None
    s = sorted(xs)
    pos = (len(s) - 1) * q / 100
    lo, hi = math.floor(pos), math.ceil(pos)
    return s[lo] + (s[hi] - s[lo]) * (pos - lo)


def summary(
    n_requests: int, tokens: int, wall: float, ttft: list[float], itl: list[float], e2e: list[float]
) -> dict:
    return {
        "requests": n_requests,
        "output_tokens": tokens,
        "wall_s": wall,
        "requests_per_s": n_requests / wall,
        "output_tokens_per_s": tokens / wall,
        "ttft_p50_ms": 1000 * pct(ttft, 50),
        "ttft_p99_ms": 1000 * pct(ttft, 99),
        "itl_p50_ms": 1000 * pct(itl, 50) if itl else None,
        "itl_p99_ms": 1000 * pct(itl, 99) if itl else None,
        "itl_mean_ms": 1000 * sum(itl) / len(itl) if itl else None,
        "e2e_p50_ms": 1000 * pct(e2e, 50),
        "e2e_p99_ms": 1000 * pct(e2e, 99),
    }


# ---------------------------------------------------------------- the stack


class StackProcess:
    """`pdserve up` as a subprocess: started, waited for ("ready: URL/v1"), stopped with SIGTERM."""

    def __init__(self, a: argparse.Namespace, model_dir: str, log_dir: str):
        self.port = a.port or free_port()
        self.cmd = [
            sys.executable,
            "-m",
            "pdserve.cli",
            "up",
            "--model",
            model_dir,
            "--prefill-instances",
            str(a.prefill_instances),
            "--prefill-cp",
            str(a.prefill_cp),
            "--policy",
            a.policy,
            "--decode-tp",
            str(a.decode_tp),
            "--decode-dcp",
            str(a.decode_dcp),
            "--dcp-index",
            a.dcp_index,
            "--transfer",
            a.transfer,
            "--port",
            str(self.port),
            "--log-dir",
            log_dir,
            "--ready-timeout",
            str(a.ready_timeout),
        ]
        # the admin API (its token reaches the router through the environment, never the command line)
        self.admin_token = secrets.token_urlsafe(32)
        self.lines: list[str] = []
        self.url: str | None = None
        self.model: str | None = None
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float) -> float:
        t0 = time.perf_counter()
        self.proc = subprocess.Popen(
            self.cmd,
            env={**os.environ, "PDSERVE_ADMIN_TOKEN": self.admin_token},
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            cwd=Path(__file__).resolve().parents[1],
            start_new_session=True,
        )
        ready = threading.Event()

        def read():
            for line in self.proc.stdout:
                self.lines.append(line.rstrip())
                if line.startswith("ready: "):  # "ready: http://127.0.0.1:P/v1  (model 'NAME'; ...)"
                    self.url = line.split()[1].removesuffix("/v1")
                    self.model = line.split("'")[1]
                    ready.set()
            ready.set()

        threading.Thread(target=read, daemon=True).start()
        ready.wait(timeout)
        if self.url is None:
            self.stop()
            raise RuntimeError("pdserve up did not become ready:\n  " + "\n  ".join(self.lines[-20:]))
        return time.perf_counter() - t0

    def flush_caches(self) -> int:
        """Empties every instance's prefix cache through the router's /admin/flush (the prompts of an
        earlier level must not be cache hits of the next: transformers recomputes every prompt);
        returns the tokens freed."""
        import httpx

        auth = {"Authorization": f"Bearer {self.admin_token}"}
        with httpx.Client(base_url=self.url, headers=auth, timeout=60) as c:
            rows = c.get("/admin/topology").raise_for_status().json()["instances"]
            return sum(
                c.post("/admin/flush", json={"url": r["url"]}).raise_for_status().json()["flushed_tokens"]
                for r in rows
            )

    def stop(self) -> int | None:
        if self.proc is None or self.proc.poll() is not None:
            return self.proc.returncode if self.proc else None
        self.proc.send_signal(signal.SIGTERM)
        try:
            return self.proc.wait(60)
        except subprocess.TimeoutExpired:  # the launcher gives its children 20 s each; should not happen
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
