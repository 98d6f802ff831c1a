"""`pdserve up`: the whole stack on this machine, as child processes of one launcher.

Starts N prefill instances and M decode instances (each `python -m pdserve.cli prefill|decode` on
free ports), waits until every one answers /health (deadline), then starts the router in front of
them and waits for its /health. Prints the URL and an example request, then supervises
(supervise.py): an instance that exits is started again on its port with backoff
(`--restart on-failure`, the default) or stops the stack (`--restart never`, exit 1); the router
exiting stops the stack (exit 1). Ctrl-C or SIGTERM stops every child (SIGTERM to all at once: the
instances drain for --shutdown-grace seconds; SIGKILL for what is left after that) and exits 0.
Children's output goes to one log file each in --log-dir (a restart appends); a child that fails to
start has its log's tail printed.
Imports no torch: the model directory must exist (cli/stack.py builds the built-in one first).
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import httpx

from ..choices import Restart
from ..decode_server.config import DecodeServerConfig as D
from ..flags import as_args, option, passed_on, passed_values
from ..prefill_server.config import PrefillServerConfig as P
from ..runtime.parent_death import die_with_parent
from ..runtime.placement import check_gpu_ids
from ..serving.auth import INTERNAL_TOKEN_ENV, new_token
from ..serving.ports import free_port
from .config import ADMIN_TOKEN_ENV, RouterConfig
from .supervise import RESTART_POLICIES, Supervisor

STOP_MARGIN_S = 15.0  # past the instances' grace period: time to stop their ranks before SIGKILL
POLL_S = 0.5  # how often the launcher looks at its children
ROUTER_HEALTH_INTERVAL_S = 1.0  # a restarted instance rejoins (and a dead one leaves) within about this
EVERY, EVERY_P, EVERY_D, ROUTER = (
    "every instance's",
    "every prefill instance's",
    "every decode instance's",
    "the router's",
)


@dataclass(frozen=True, kw_only=True)
class StackConfig:
    """`pdserve up`'s config and, field by field, its flags (pdserve/flags.py)."""

    model: str = option(
        help="Checkpoint directory. Default: the built-in small model (built once, then reused).",
        cli_type=Optional[Path],
        cli_default=None,
    )
    prefill_instances: int = option(1, "Number of prefill instances N.", min=1)
    prefill_cp: int = passed_on((P, "cp_size"), who=EVERY_P, name="--prefill-cp")
    decode_instances: int = option(1, "Number of decode instances M.", min=1)
    decode_tp: int = passed_on((D, "tp_size"), who=EVERY_D, name="--decode-tp")
    decode_dcp: int = passed_on((D, "dcp_size"), who=EVERY_D, name="--decode-dcp")
    dcp_index: str = passed_on((D, "dcp_index"), who=EVERY_D)
    transfer: str = passed_on((P, "transfer"), (D, "transfer"), who=EVERY)
    max_kv_tokens: int | None = passed_on(  # None: each server's default
        (P, "max_kv_tokens"),
        (D, "max_kv_tokens"),
        who=EVERY,
        default=None,
        help="KV cache capacity in tokens (default: each server's own default).",
        cli_type=Optional[int],
    )
    policy: str = passed_on((RouterConfig, "policy"), who=ROUTER)
    prefix_cache: str = passed_on((P, "prefix_cache"), (D, "prefix_cache"), who=EVERY)
    host: str = passed_on((RouterConfig, "host"), who=ROUTER)
    port: int = passed_on((RouterConfig, "port"), who=ROUTER)
    admin_token: str | None = option(  # reaches the router through its environment
        None,
        "Bearer token of the router's /admin API (default: PDSERVE_ADMIN_TOKEN); none disables it.",
        repr=False,
    )
    report_cached_tokens: bool = passed_on((RouterConfig, "report_cached_tokens"), who=ROUTER)
    max_migrations: int = passed_on((RouterConfig, "max_migrations"), who=ROUTER)
    api_key_file: str | None = passed_on((RouterConfig, "api_key_file"), who=ROUTER)
    log_dir: str = option(
        "pdserve-logs",
        "Directory for one log file per started process.",
        cli_type=Path,
        cli_default=Path("pdserve-logs"),
    )
    ready_timeout_s: float = option(
        600.0,
        "Seconds every process gets to become healthy before the launch is given up.",
        name="--ready-timeout",
    )
    restart: str = option(
        "on-failure", choices=Restart
    )  # a dead instance: on-failure (start it again) | never (stop the stack)
    restart_backoff_max_s: float = option(
        30.0,
        "--restart on-failure: the longest wait before a dead instance is started again (the wait starts at 1 s and doubles per failure, back to 1 s once it stayed healthy for a minute).",
        name="--restart-backoff-max",
        min=1.0,
    )
    bootstrap_timeout_s: float = passed_on((P, "bootstrap_timeout_s"), who=EVERY_P)
    shutdown_grace_s: float = passed_on((P, "shutdown_grace_s"), (D, "shutdown_grace_s"), who=EVERY)
    device: str = passed_on((P, "device"), (D, "device"), who=EVERY)
    gpu_ids: tuple[int, ...] = option(  # cuda: one per rank of the whole stack, prefill instances first
        (),
        "--device cuda: comma-separated GPU ordinals, one per rank of the whole stack (prefill instances' "
        "ranks first, then decode instances'); the same ordinal twice puts two ranks on one GPU. Default: "
        "0, 1, 2, ...",
        cli_type=Optional[str],
        cli_default=None,
    )
    attention_ops: str = passed_on((P, "attention_ops"), (D, "attention_ops"), who=EVERY)
    internal_token: str = option(  # one per stack, in the children's environment
        help="The stack's internal token (default: $PDSERVE_INTERNAL_TOKEN, else a new random one); it reaches the router and the instances through their environment, never their command lines.",
        default_factory=new_token,
        cli_type=Optional[str],
        cli_default=None,
        repr=False,
    )

    def __post_init__(self):
        if self.restart not in RESTART_POLICIES:
            raise ValueError(f"--restart must be one of {', '.join(RESTART_POLICIES)}, got {self.restart!r}")
        if not 1.0 <= self.restart_backoff_max_s <= 3600:
            raise ValueError(
                f"--restart-backoff-max must be in [1, 3600] s, got {self.restart_backoff_max_s}"
            )
        for name in ("prefill_instances", "decode_instances"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")
        check_gpu_ids(self.gpu_ids)
        if self.gpu_ids and (self.device != "cuda" or len(self.gpu_ids) != self.total_ranks):
            raise ValueError(
                f"--gpu-ids needs --device cuda and one GPU per rank of the stack ({self.total_ranks}), "
                f"got {len(self.gpu_ids)}"
            )
        # what `up` passes on is checked by the configs that receive it: one rule per knob
        for role, cls in (("prefill", P), ("decode", D)):
            try:
                cls.create(**self.instance_fields(role, 0))
            except ValueError as e:
                raise ValueError(f"a {role} instance would refuse these options: {e}") from None
        try:
            RouterConfig(model=self.model, **passed_values(self, RouterConfig))
        except ValueError as e:
            raise ValueError(f"the router would refuse these options: {e}") from None

    def instance_fields(self, role: str, index: int) -> dict:
        """The server config fields `up` sets on `role` instance `index`, ports aside (each gets free
        ones): the options it passes on, the instance's GPUs and what follows from the stack's shape."""
        cls = P if role == "prefill" else D
        fields = {"model": self.model, **passed_values(self, cls)}
        if self.device == "cuda":
            fields["gpu_ids"] = self.instance_gpus(role, index)
        if role == "prefill":  # residues = C_d: each decode rank's rows are contiguous in the prefill cache
            return fields | {"kv_residues": self.decode_dcp}
        return fields | {"page_size": math.lcm(64, self.decode_dcp)}  # pages are C_d-wide

    @property
    def total_ranks(self) -> int:
        return self.prefill_instances * self.prefill_cp + self.decode_instances * self.decode_tp

    def instance_gpus(self, role: str, index: int) -> tuple[int, ...]:
        """The GPUs of one instance: consecutive ranks of the stack, prefill instances first."""
        gpus = self.gpu_ids or tuple(range(self.total_ranks))
        if role == "prefill":
            start, n = index * self.prefill_cp, self.prefill_cp
        else:
            start, n = self.prefill_instances * self.prefill_cp + index * self.decode_tp, self.decode_tp
        return gpus[start : start + n]


@dataclass
class Child:
    name: str
    proc: subprocess.Popen
    url: str
    log: Path
    args: Callable[[], list[str]]  # its command line; called again for a restart (fresh side ports)


def _popen(args: list[str], log: Path, mode: str, env: dict[str, str]) -> subprocess.Popen:
    """A child; secrets travel in `env`, never on its command line (visible in ps)."""
    with log.open(mode) as out:
        return subprocess.Popen(
            [sys.executable, "-m", "pdserve.cli", *args],
            stdout=out,
            stderr=subprocess.STDOUT,
            env=env,
            stdin=subprocess.DEVNULL,
            # a process group of its own, so Ctrl-C reaches the launcher only (it stops the rest), but
            # the launcher's session: a session of its own would be an autogroup of its own, and
            # the kernel would then share the CPU equally per instance, not per rank (a 2-rank
            # prefill got 1 of 2 cores beside a 1-rank decode)
            process_group=0,
            preexec_fn=die_with_parent,  # SIGTERM when `pdserve up` dies, however it dies
        )


class Stack:
    def __init__(self, cfg: StackConfig):
        self.cfg = cfg
        self.children: list[Child] = []
        self.log_dir = Path(cfg.log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, INTERNAL_TOKEN_ENV: cfg.internal_token}
        self.env.pop(ADMIN_TOKEN_ENV, None)
        if cfg.admin_token:  # only the router reads it; instances ignore it
            self.env[ADMIN_TOKEN_ENV] = cfg.admin_token

    def _spawn(self, name: str, args: Callable[[], list[str]], port: int) -> Child:
        log = self.log_dir / f"{name}.log"
        child = Child(name, _popen(args(), log, "w", self.env), f"http://127.0.0.1:{port}", log, args)
        self.children.append(child)
        return child

    def respawn(self, child: Child, why: str) -> None:
        """Starts an exited child again with the same HTTP port, appending to its log after a marker."""
        with child.log.open("a") as out:
            out.write(f"\n===== pdserve up: {why} =====\n")
        child.proc = _popen(child.args(), child.log, "a", self.env)

    def start_instances(self) -> tuple[list[Child], list[Child]]:
        prefill = [self._start_instance("prefill", i) for i in range(self.cfg.prefill_instances)]
        decode = [self._start_instance("decode", i) for i in range(self.cfg.decode_instances)]
        return prefill, decode

    def _start_instance(self, role: str, index: int) -> Child:
        port = free_port()
        return self._spawn(f"{role}-{index}", lambda: self.instance_args(role, index, port), port)

    def instance_args(self, role: str, index: int, port: int) -> list[str]:
        """The `pdserve` arguments of `role` instance `index` (a fresh --dist-port each call: a restart)."""
        fields = self.cfg.instance_fields(role, index) | {"port": port, "dist_port": free_port()}
        return [role, *as_args(P if role == "prefill" else D, fields)]

    def start_router(self, prefill: list[Child], decode: list[Child]) -> Child:
        c = self.cfg
        args = self.router_args([p.url for p in prefill], [d.url for d in decode])
        child = self._spawn("router", lambda: args, c.port)
        child.url = f"http://{'127.0.0.1' if c.host in ('0.0.0.0', '::') else c.host}:{c.port}"
        return child

    def router_args(self, prefill: list[str], decode: list[str]) -> list[str]:
        """The router's `pdserve` arguments in front of these instance URLs."""
        values = {"model": self.cfg.model, **passed_values(self.cfg, RouterConfig)}
        values["health_interval_s"] = ROUTER_HEALTH_INTERVAL_S
        if self.cfg.api_key_file:  # the router's working directory may differ
            values["api_key_file"] = str(Path(self.cfg.api_key_file).resolve())
        urls = [a for p in prefill for a in ("--prefill", p)] + [a for d in decode for a in ("--decode", d)]
        return ["router", *as_args(RouterConfig, values), *urls]

    def wait_ready(self, children: list[Child], deadline: float) -> None:
        """Polls every child's /health until all answer 200; raises if one exits or the deadline passes."""
        pending = list(children)
        with httpx.Client(timeout=2) as client:  # one client: httpx.get builds an SSL context each call
            while pending:
                for child in list(pending):
                    self.check_alive(child)
                    try:
                        if client.get(f"{child.url}/health").status_code == 200:
                            pending.remove(child)
                    except httpx.HTTPError:
                        pass
                if pending and time.monotonic() > deadline:
                    raise RuntimeError(
                        f"not ready within {self.cfg.ready_timeout_s:.0f} s: "
                        f"{', '.join(c.name for c in pending)} (logs in {self.log_dir})"
                    )
                time.sleep(0.3)

    def check_alive(self, child: Child) -> None:
        code = child.proc.poll()
        if code is not None:
            tail = "".join(child.log.read_text(errors="replace").splitlines(keepends=True)[-20:])
            raise RuntimeError(f"{child.name} exited with status {code}; the end of {child.log}:\n{tail}")

    def terminate_all(self) -> None:
        """SIGTERM to every live child. A second one, during stop(), cuts the instances' drain short
        (they still stop cleanly)."""
        for child in self.children:
            if child.proc.poll() is None:
                child.proc.terminate()

    def stop(self) -> None:
        """SIGTERM to every child at once: the router stops taking requests and lets its open ones end,
        the instances drain (--shutdown-grace); SIGKILL to any still running some seconds after that."""
        self.terminate_all()
        deadline = time.monotonic() + self.cfg.shutdown_grace_s + STOP_MARGIN_S
        for child in self.children:
            try:
                child.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                child.proc.kill()
                child.proc.wait()


class _Stop(Exception):
    pass


def _raise_stop(signum, frame):
    raise _Stop()


def up(cfg: StackConfig, echo=print) -> int:
    """Runs the stack until Ctrl-C / SIGTERM (returns 0), or until the router dies or, with
    --restart never, any child (returns 1)."""
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
        models = httpx.get(f"{router.url}/v1/models", timeout=5)  # 401 behind API keys
        model = models.json()["data"][0]["id"] if models.is_success else Path(cfg.model).resolve().name
        echo(f"router: {router.url} (pid {router.proc.pid}, log {router.log})")
        echo(f"ready: {router.url}/v1  (model {model!r}; Ctrl-C stops everything)")
        echo(
            f"example:\n  curl {router.url}/v1/completions -H 'Content-Type: application/json' "
            f'-d \'{{"model": "{model}", "prompt": "Hello", "max_tokens": 16}}\''
        )
        with Supervisor(
            stack, router, prefill + decode, cfg.restart, echo, cfg.restart_backoff_max_s
        ) as supervisor:
            while True:
                supervisor.tick()
                time.sleep(POLL_S)
    except (KeyboardInterrupt, _Stop):
        echo(
            f"stopping (the instances drain for up to {cfg.shutdown_grace_s:g} s; Ctrl-C again cuts that short)"
        )
        return 0
    except RuntimeError as e:
        echo(f"error: {e}")
        return 1
    finally:
        # a second Ctrl-C or SIGTERM (process managers repeat them) must not cut the stop short and
        # orphan the instances, only their drain; they also die with this process if it is killed
        # (die_with_parent)
        old_int = signal.signal(signal.SIGINT, lambda signum, frame: stack.terminate_all())
        signal.signal(signal.SIGTERM, lambda signum, frame: stack.terminate_all())
        try:
            stack.stop()
        finally:
            signal.signal(signal.SIGTERM, old)
            signal.signal(signal.SIGINT, old_int)
