"""The leader's rank group of an instance over several hosts (`--nnodes` > 1).

Node 0 (this process: HTTP, loop, scheduler) runs its own ranks over pipes like any RankGroup; each
other node runs an agent (runtime/node_agent.py) that connects to the node link here
(--dist-addr's port + 1, runtime/node_wire.py: authenticated with the internal token, typed
messages) and runs that node's ranks. All ranks form one torch.distributed group at --dist-addr.

    start   wait for every agent's Hello; Start(generation) to each; local ranks spawn; every rank's
            readiness gathered (Ready per node, in global rank order)
    call    Command(seq) to every agent and the command to every local pipe; one Replies per node
            and one reply per local rank gathered: the same CommandFailed / RankError semantics as
            one host (a node's errors cut the deadline to error_grace_s like a local rank's)
    beats   both ways every node_timeout_s / 4; a node silent for node_timeout_s, one that closed
            its link, or one whose Beat names a dead rank is dead: `dead_rank()` says which, the
            watchdog fails the instance's requests and restarts the whole group (serving/watchdog.py:
            the leader stops its ranks, tells the agents to stop theirs, and runs itself anew;
            the agents wait for its next Start). Until it is up again nothing answers /health, so the
            router stops choosing the instance.
"""

from __future__ import annotations

import multiprocessing.connection as mpc
import os
import queue
import secrets
import socket
import sys
import threading
import time
from typing import Any, Callable

from .launcher import LaunchConfig, RankError, RankGroup, raise_start_errors
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
    accept_link,
    link_key,
)


def role_of(factory: type) -> str:
    """ "prefill" for pdserve.prefill_server.*, "decode" for pdserve.decode_server.*."""
    return factory.__module__.split(".")[1].removesuffix("_server")


def strip_node_local(payload: Any) -> Any:
    """The payload without its frame key: the agent puts in its own (the key never crosses a wire)."""
    import dataclasses

    if dataclasses.is_dataclass(payload) and any(f.name == "frame_key" for f in dataclasses.fields(payload)):
        return dataclasses.replace(payload, frame_key=b"")
    return payload


class _Node:
    def __init__(self, rank: int, link):
        self.rank, self.link = rank, link
        self.last_seen = time.monotonic()
        self.dead: str | None = None


class NodeGroup(RankGroup):
    restarts_on_failure = True  # serving/watchdog.py: a broken group restarts, the leader does not exit

    def __init__(self, factory, payload, cfg):
        super().__init__(factory, payload, cfg)
        self.key = link_key(payload.frame_key)
        self.role = role_of(factory)
        self.nodes: dict[int, _Node] = {}
        self.generation, self.seq = 0, 0
        self.remote_pids: list[int] = []
        self._lock = threading.Lock()
        self._arrived = threading.Condition(self._lock)
        self._inbox: queue.SimpleQueue = queue.SimpleQueue()  # (node, message) of Ready / Failed / Replies
        self._wake_r, self._wake_w = os.pipe()
        self._closed = threading.Event()
        self._listener: socket.socket | None = None

    @property
    def pids(self) -> list[int]:
        return super().pids + self.remote_pids

    # --- node link ---------------------------------------------------------------------------------

    def listen(self) -> None:
        host, port = self.cfg.dist_host, self.cfg.dist_port + 1
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        self._listener = socket.socket(family, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind((host, port))
        self._listener.listen(16)
        threading.Thread(target=self._accept_loop, name="node-link", daemon=True).start()
        threading.Thread(target=self._beat_loop, name="node-beats", daemon=True).start()

    def _accept_loop(self) -> None:
        while not self._closed.is_set():
            try:
                sock, addr = self._listener.accept()
            except OSError:
                return
            peer = f"{addr[0]}:{addr[1]}"
            threading.Thread(target=self._serve, args=(sock, peer), name="node-peer", daemon=True).start()

    def _serve(self, sock: socket.socket, peer: str) -> None:
        """One agent's connection: handshake, Hello, then its messages until it closes."""
        try:
            link = accept_link(sock, self.key, peer)
            hello = link.recv()
            node = self._admit(link, hello, peer)
        except (LinkError, OSError) as e:
            print(f"node link: {peer}: {e}", file=sys.stderr, flush=True)
            sock.close()
            return
        if node is None:
            return
        try:
            while True:
                msg = link.recv()
                node.last_seen = time.monotonic()
                if isinstance(msg, Beat):
                    if msg.dead and msg.generation == self.generation:
                        node.dead = f"node {node.rank}: {msg.dead}"
                elif isinstance(msg, (Ready, Failed, Replies)):
                    self._inbox.put((node.rank, msg))
                    os.write(self._wake_w, b"x")
        except LinkError as e:
            node.dead = f"node {node.rank} ({peer}): {e}"
            os.write(self._wake_w, b"x")

    def _admit(self, link, hello, peer: str) -> _Node | None:
        why = None
        if not isinstance(hello, Hello):
            why = f"expected Hello, got {type(hello).__name__}"
        elif hello.role != self.role or hello.nnodes != self.cfg.nnodes:
            why = f"this is a {self.role} instance of {self.cfg.nnodes} nodes, not {hello.role} of {hello.nnodes}"
        elif not 0 < hello.node_rank < self.cfg.nnodes:
            why = f"node rank {hello.node_rank} is not in [1, {self.cfg.nnodes - 1}]"
        if why:
            print(f"node link: {peer} refused: {why}", file=sys.stderr, flush=True)
            try:
                link.send(Refused(why))
            finally:
                link.close()
            return None
        with self._arrived:
            old = self.nodes.get(hello.node_rank)
            node = self.nodes[hello.node_rank] = _Node(hello.node_rank, link)
            self._arrived.notify_all()
        if old is not None:  # a node that came back: its ranks are new, the group's old ones are gone
            old.dead = f"node {hello.node_rank} reconnected from {peer}"
            old.link.close()
        print(f"node link: node {hello.node_rank} joined from {peer}", file=sys.stderr, flush=True)
        return node

    def _beat_loop(self) -> None:
        interval = self.cfg.node_timeout_s / 4
        while not self._closed.wait(interval):
            for node in list(self.nodes.values()):
                try:
                    node.link.send(Beat(self.generation))
                except LinkError:
                    pass  # its reader sees the link close

    def _broadcast(self, msg) -> None:
        for rank in self._remote_ranks():
            try:
                self.nodes[rank].link.send(msg)
            except LinkError as e:
                raise RankError(f"node {rank}: {e}") from None

    def _remote_ranks(self) -> list[int]:
        return list(range(1, self.cfg.nnodes))

    # --- the group ---------------------------------------------------------------------------------

    def start(self) -> list[dict]:
        if self._listener is None:
            self.listen()
        deadline = time.monotonic() + self.cfg.ready_timeout_s
        self._wait_for_nodes(deadline)
        self.generation = secrets.randbits(62) + 1
        try:
            self._broadcast(Start(self.generation, self.factory, strip_node_local(self.payload), self.cfg))
            self._spawn()
            self.infos, errors = self._gather(deadline, Ready)
            raise_start_errors(errors)
        except BaseException:
            self.shutdown()
            raise
        return self.infos

    def _wait_for_nodes(self, deadline: float) -> None:
        told = 0.0
        with self._arrived:
            while set(self._remote_ranks()) - self._live_nodes():
                missing = sorted(set(self._remote_ranks()) - self._live_nodes())
                if time.monotonic() > deadline:
                    raise RankError(
                        f"node(s) {missing} did not join at {self.cfg.dist_host}:{self.cfg.dist_port + 1}"
                    )
                if time.monotonic() - told > 10:
                    told = time.monotonic()
                    print(f"waiting for node(s) {missing} to join", file=sys.stderr, flush=True)
                self._arrived.wait(0.5)

    def _live_nodes(self) -> set[int]:
        return {r for r, n in self.nodes.items() if n.dead is None}

    def call_raw(self, cmd: Any, timeout_s: float | None = None):
        if self.broken:
            raise RankError(f"the rank group is broken: {self.broken}")
        timeout = timeout_s or self.cfg.collective_timeout_s
        self.seq += 1
        try:
            self._broadcast(Command(self.generation, self.seq, cmd, timeout))
            self._send_all(cmd)
            return self._gather(time.monotonic() + timeout, Replies)
        except RankError as e:
            self.broken = str(e).splitlines()[0]
            raise

    def _gather(self, deadline: float, kind=Replies):
        """Every local rank's answer and every node's (Ready at start, Replies of this seq)."""
        per = self.cfg.ranks_per_node
        replies: list[Any] = [None] * self.cfg.world_size
        errors: dict[int, str] = {}
        pending: set = set(range(len(self.conns))) | {("node", r) for r in self._remote_ranks()}
        while pending:
            local = [self.conns[i] for i in pending if isinstance(i, int)]
            for conn in mpc.wait([*local, self._wake_r], timeout=0.05):
                if conn == self._wake_r:
                    os.read(self._wake_r, 4096)
                    continue
                i = self.conns.index(conn)
                deadline = self._take_local(i, replies, errors, deadline)
                pending.discard(i)
            while not self._inbox.empty():
                rank, msg = self._inbox.get_nowait()
                if msg.generation != self.generation:
                    continue  # an answer to an earlier leader's start
                if isinstance(msg, Failed):  # the node's group broke: so did this one
                    raise RankError(f"node {rank}: {msg.message}")
                if not isinstance(msg, kind) or (kind is Replies and msg.seq != self.seq):
                    continue  # a late answer of an earlier command
                got = msg.infos if kind is Ready else msg.replies
                replies[rank * per : (rank + 1) * per] = got
                errors.update(getattr(msg, "errors", {}))
                if getattr(msg, "errors", None):
                    deadline = min(deadline, time.monotonic() + self.cfg.error_grace_s)
                if kind is Ready:
                    self.remote_pids += msg.pids
                pending.discard(("node", rank))
            self._check(pending, errors, deadline)
        return replies, errors

    def _pending_names(self, pending: set) -> list:
        local = sorted(self.rank_ids[i] for i in pending if isinstance(i, int))
        return local + sorted(f"node {i[1]}" for i in pending if isinstance(i, tuple))

    def dead_rank(self) -> str | None:
        dead = super().dead_rank()
        if dead:
            return dead
        now = time.monotonic()
        for rank in self._remote_ranks():
            node = self.nodes.get(rank)
            if node is None:
                continue  # not joined yet: start() waits for it
            if node.dead:
                return node.dead
            if now - node.last_seen > self.cfg.node_timeout_s:
                return f"node {rank} silent for {now - node.last_seen:.1f} s (--node-timeout {self.cfg.node_timeout_s:g})"
        return None

    def shutdown(self, grace_s: float = 5.0) -> None:
        """Stops every rank (the agents stop theirs) and closes the node link: final, like a one-host
        group's; the agents then wait for the next leader."""
        for node in list(self.nodes.values()):
            try:
                node.link.send(Stop(self.generation))
            except LinkError:
                pass
        super().shutdown(0.5 if self.broken or self.dead_rank() else grace_s)
        self._closed.set()
        if self._listener is not None:
            try:  # wakes the accept() blocked on it; a close alone would leave the port listening
                self._listener.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._listener.close()
        for node in self.nodes.values():
            node.link.close()


def make_group(factory: Callable[..., Any], payload: Any, cfg: LaunchConfig) -> RankGroup:
    """The instance's rank group: local ranks only, or with nnodes > 1 the leader's view of every
    node (this process is node 0)."""
    if cfg.nnodes == 1:
        return RankGroup(factory, payload, cfg)
    return NodeGroup(factory, payload, cfg)
