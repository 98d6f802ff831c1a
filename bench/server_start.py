"""How long one server takes from its command to a healthy /health, and the CPU the machine spent
meanwhile (every process of the start: server, forkserver, ranks): `pdserve prefill` (C_p = 2),
`pdserve decode` (W = 1) and `pdserve decode` with W = C_d = 2 (decode-tp2), each started and
stopped --repeats times, with an idle wait before each side.

    .venv/bin/python bench/server_start.py                 every role, 5 starts each, the built-in model
    .venv/bin/python bench/server_start.py --roles decode,decode-tp2 --repeats 3

Not a claim of the README table: what the suite's server fixtures and `pdserve up` pay per instance
(a server imports torch, and so does the forkserver its cpu ranks fork from: runtime/launcher.prestart
overlaps the two). Writes server_start.json in --out. bench/ is on sys.path when a script runs."""

from __future__ import annotations

import argparse
import json
import os
import secrets
import signal
import subprocess
import sys
import time

import httpx
from common import (
    add_model_and_out,
    free_port,
    idle_side,
    machine_info,
    resolve_model,
    spread,
    system_busy_seconds,
)

# role: (subcommand, its flags)
WORLD = {
    "prefill": ("prefill", ["--cp-size", "2"]),
    "decode": ("decode", []),
    "decode-tp2": ("decode", ["--tp-size", "2", "--dcp-size", "2"]),
}


def start_once(role: str, model: str, http: httpx.Client, timeout_s: float) -> tuple[float, float]:
    """(seconds from Popen to the first 200 from /health, machine CPU seconds meanwhile); the server
    is stopped (SIGTERM) after."""
    port = free_port()
    sub, flags = WORLD[role]
    cmd = [sys.executable, "-m", "pdserve.cli", sub, "--model", model, "--port", str(port)]
    cmd += ["--dist-port", str(free_port()), *flags]
    env = dict(os.environ, PDSERVE_INTERNAL_TOKEN=secrets.token_urlsafe(32))
    c0, t0 = system_busy_seconds(), time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env, text=True)
    try:
        while time.perf_counter() - t0 < timeout_s:
            if proc.poll() is not None:
                raise RuntimeError(f"{role} server exited {proc.returncode}: {proc.stderr.read()[-800:]}")
            try:
                if http.get(f"http://127.0.0.1:{port}/health", timeout=1).status_code == 200:
                    return time.perf_counter() - t0, system_busy_seconds() - c0
            except httpx.HTTPError:
                pass
            time.sleep(0.05)
        raise RuntimeError(f"{role} server not healthy within {timeout_s} s")
    finally:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    add_model_and_out(ap, "server_start")
    ap.add_argument("--roles", default=",".join(WORLD), help=f"servers to start (default {','.join(WORLD)})")
    ap.add_argument("--repeats", type=int, default=5, help="starts per role; medians (default 5)")
    ap.add_argument(
        "--idle-wait", type=float, default=60, help="seconds to wait for an idle machine (default 60)"
    )
    ap.add_argument("--timeout", type=float, default=120, help="seconds allowed per start (default 120)")
    a = ap.parse_args(argv)
    roles = [r for r in a.roles.split(",") if r]
    if not roles or set(roles) - set(WORLD) or a.repeats < 1:
        ap.error(f"--roles takes {', '.join(WORLD)}; --repeats must be >= 1")
    model = resolve_model(a.model)
    res = {}
    with httpx.Client() as http:
        for role in roles:
            idle = idle_side(a.idle_wait, f"{role} starts")
            times, cpu = zip(*(start_once(role, model, http, a.timeout) for _ in range(a.repeats)))
            sub, flags = WORLD[role]
            res[role] = {"command": f"pdserve {sub} {' '.join(flags)}".strip(), "idle_before": idle}
            res[role]["seconds"], res[role]["cpu_seconds"] = spread(times), spread(cpu)
            print(
                f"{res[role]['command']}: healthy after {res[role]['seconds']['median']:.2f} s median "
                f"(min {min(times):.2f}, max {max(times):.2f}, {a.repeats} starts), "
                f"{res[role]['cpu_seconds']['median']:.2f} CPU s median",
                flush=True,
            )
    a.out.mkdir(parents=True, exist_ok=True)
    doc = {"machine": machine_info(("torch",)), "config": {"model": model, "repeats": a.repeats}, **res}
    (a.out / "server_start.json").write_text(json.dumps(doc, indent=1) + "\n")
    print(f"wrote {a.out / 'server_start.json'}")


if __name__ == "__main__":
    main()
