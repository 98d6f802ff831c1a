"""A node agent: `pdserve prefill|decode --nnodes N --node-rank R` with R > 0.

It connects to the leader's node link (runtime/node_wire.py, at --dist-addr's port + 1; retried
until the leader is up), says Hello, and then runs what the leader says (runtime/node_group.py):
Start starts this node's ranks (global ranks R x ranks per node + 0, 1, ...) with the leader's
worker config, in which it puts its own frame key (from its own internal token: the key never
crosses the wire) and its node-local fields (--data-host); Command runs one command on them and
answers Replies (or Failed when the node's group broke); Stop stops them. Beats go both ways: a
leader silent for --node-timeout, or a closed link, stops the ranks at once (a command in flight
ends with them), and the agent waits for the leader's next Start, which is how the whole group
restarts together. A rank that dies here is named in the next Beat. SIGTERM stops the ranks and exits.
"""

from __future__ import annotations

import dataclasses
import queue
import signal
import sys
import threading
import time

from .launcher import RankError, RankGroup, RankWorker
from .node_group import role_of
from .node_wire import (
    Beat,
    Command,
    Failed,
    Hello,
    LinkError,
    Ready,
    Refused,
    Replies,
    Start,
    Stop,
    connect_link,
    link_key,
)


def _say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


class AgentSession:
    """One connection to one leader process: its Starts, Commands and Stops."""

    def __init__(self, link, node_rank: int, nnodes: int, role: str, overrides: dict, timeout_s: float):
        self.link, self.node_rank, self.nnodes, self.role = link, node_rank, nnodes, role
        self.overrides, self.timeout_s = overrides, timeout_s
        self.group: RankGroup | None = None
        self.generation = 0
        self.inbox: queue.SimpleQueue = queue.SimpleQueue()
        self.ended = threading.Event()
        self.reason, self.refused = "", False
        self.busy = False
        self.last_seen = time.monotonic()

    def run(self) -> str:
        """Serves the leader until the link ends; returns why it ended."""
        self.link.send(Hello(self.node_rank, self.nnodes, self.role))
        threading.Thread(target=self._reader, name="agent-link", daemon=True).start()
        threading.Thread(target=self._beats, name="agent-beats", daemon=True).start()
        try:
            while not self.ended.is_set():
                try:
                    msg = self.inbox.get(timeout=0.2)
                except queue.Empty:
                    continue
                try:
                    self._handle(msg)
                except LinkError as e:
                    self._end(str(e))
        finally:
            self._stop_group()
            self.link.close()
        return self.reason

    def _end(self, reason: str) -> None:
        if not self.ended.is_set():
            self.reason = reason
            self.ended.set()
        self._kill_ranks()  # a command in flight ends now: its ranks are gone

    def _kill_ranks(self) -> None:
        group = self.group
        for p in list(group.procs) if group else []:
            if p.is_alive():
                p.kill()

    def _reader(self) -> None:
        try:
            while True:
                msg = self.link.recv()
                self.last_seen = time.monotonic()
                if isinstance(msg, Refused):
                    self.refused = True
                    self._end(f"the leader refused this node: {msg.reason}")
                    return
                if isinstance(msg, Stop) and self.busy:
                    self._kill_ranks()
                if not isinstance(msg, Beat):
                    self.inbox.put(msg)
        except LinkError as e:
            self._end(str(e))

    def _beats(self) -> None:
        while not self.ended.wait(self.timeout_s / 4):
            silent = time.monotonic() - self.last_seen
            if silent > self.timeout_s:
                self._end(f"the leader is silent for {silent:.1f} s (--node-timeout {self.timeout_s:g})")
                self.link.close()
                return
            group = self.group
            try:
                self.link.send(Beat(self.generation, group.dead_rank() if group else None))
            except LinkError as e:
                self._end(str(e))

    def _handle(self, msg) -> None:
        if isinstance(msg, Start):
            self._start(msg)
        elif isinstance(msg, Command):
            self._command(msg)
        elif isinstance(msg, Stop) and msg.generation == self.generation:
            self._stop_group()

    def _start(self, msg: Start) -> None:
        self._stop_group()
        self.generation = msg.generation
        factory, launch = msg.factory, msg.launch
        if (
            not (isinstance(factory, type) and issubclass(factory, RankWorker))
            or role_of(factory) != self.role
        ):
            self.link.send(Failed(msg.generation, f"node {self.node_rank} runs {self.role} ranks only"))
            return
        if launch.nnodes != self.nnodes:
            self.link.send(
                Failed(msg.generation, f"node {self.node_rank} was started with --nnodes {self.nnodes}")
            )
            return
        launch = dataclasses.replace(launch, node_rank=self.node_rank)
        names = {f.name for f in dataclasses.fields(msg.payload)}
        payload = dataclasses.replace(msg.payload, **{k: v for k, v in self.overrides.items() if k in names})
        self.group = RankGroup(factory, payload, launch)
        self.busy = True
        try:
            infos = self.group.start()
        except RankError as e:
            self.group = None
            self.link.send(Failed(msg.generation, str(e)))
            return
        finally:
            self.busy = False
        _say(f"node {self.node_rank}: ranks {launch.local_ranks} ready")
        self.link.send(Ready(msg.generation, infos, self.group.pids))

    def _command(self, msg: Command) -> None:
        if self.group is None or msg.generation != self.generation:
            self.link.send(Failed(msg.generation, f"node {self.node_rank} has no ranks of this generation"))
            return
        self.busy = True
        try:
            replies, errors = self.group.call_raw(msg.cmd, msg.timeout_s)
        except RankError as e:
            self.link.send(Failed(msg.generation, str(e)))
            self._stop_group()
            return
        finally:
            self.busy = False
        self.link.send(Replies(msg.generation, msg.seq, replies, errors))

    def _stop_group(self) -> None:
        group, self.group = self.group, None
        if group is not None:
            group.shutdown(0.5 if group.unhealthy() else 5.0)


def run_agent(
    host: str,
    port: int,
    node_rank: int,
    nnodes: int,
    role: str,
    frame_key: bytes,
    overrides: dict,
    timeout_s: float,
    stop: threading.Event | None = None,
) -> None:
    """Serves leader after leader at host:port + 1 until `stop` is set (or SIGTERM, in a server)."""
    key, stop = link_key(frame_key), stop or threading.Event()
    overrides = {**overrides, "frame_key": frame_key}
    waiting = False
    while not stop.is_set():
        try:
            link = connect_link(host, port + 1, key)
        except (OSError, LinkError) as e:
            if not waiting:
                _say(f"node {node_rank}: waiting for the leader's node link at {host}:{port + 1} ({e})")
                waiting = True
            stop.wait(0.5)
            continue
        waiting = False
        _say(f"node {node_rank}: joined the {role} leader at {host}:{port + 1}")
        session = AgentSession(link, node_rank, nnodes, role, overrides, timeout_s)
        reason = session.run()
        _say(f"node {node_rank}: the leader's link ended ({reason}); waiting for the leader")
        if session.refused:
            raise SystemExit(f"error: {reason}")


def serve_agent(cfg, role: str, frame_key: bytes) -> None:
    """`pdserve prefill|decode` on a node other than 0: this node's ranks, for as long as the process lives."""
    import torch

    from .nodes import apply_interfaces

    torch.set_num_threads(1)  # the agent relays; its ranks set their own thread counts
    env = apply_interfaces(cfg)
    host, port = cfg.dist_endpoint()
    _say(
        f"{role} node {cfg.node_rank} of {cfg.nnodes}: leader at {host}:{port}, interfaces {env or 'default'}"
    )
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(0))
    overrides = {"data_host": cfg.data_host} if hasattr(cfg, "data_host") else {}
    run_agent(host, port, cfg.node_rank, cfg.nnodes, role, frame_key, overrides, cfg.node_timeout_s)
