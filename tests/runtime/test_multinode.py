"""One instance over two nodes, on loopback (runtime/node_group.py, node_agent.py, node_wire.py):
node 0 is this test's PrefillInstance (its rank 0 over a pipe), node 1 a real
`pdserve prefill --nnodes 2 --node-rank 1 --dist-addr 127.0.0.1:PORT` agent process (rank 1),
one gloo group, the node link authenticated with the internal token.

- Prefill logits and cache entries equal the single-rank engine's in float64 (docs/design.md
  invariant 2), the remote rank's included; a command that raises on the remote rank fails that
  command only.
- A remote rank killed, or the agent itself, is named by `unhealthy()` within --node-timeout; the
  agent then waits, and a new leader (the group restarted) is exact again.
- The node link: a peer without the token is refused at the handshake, and the decoder admits
  only data classes (no callable of the standard library, torch or numpy runs).
"""

from __future__ import annotations

import os
import pickle
import socket
import subprocess
import sys
import threading
import time

import pytest
import torch

from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.prefill_server.worker_config import PrefillWorkerConfig
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import CommandFailed, LaunchConfig, RankError
from pdserve.runtime.node_wire import LinkError, Replies, connect_link, dumps, link_key, loads
from pdserve.transfer.frames import cluster_frame_key
from tests.reference import assert_close, assert_prefill_cache, free_port
from tests.reference import reference_prefill as reference
from tests.servers import TEST_TOKEN, pid_alive, wait_until

TIMEOUT_S = 2.0  # --node-timeout of both sides


def start_agent(model: str, port: int) -> subprocess.Popen:
    cmd = [
        sys.executable,
        "-m",
        "pdserve.cli",
        "prefill",
        "--model",
        model,
        "--cp-size",
        "2",
        "--nnodes",
        "2",
    ]
    cmd += ["--node-rank", "1", "--dist-addr", f"127.0.0.1:{port}", "--node-timeout", str(TIMEOUT_S)]
    return subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)


def leader(model: str, port: int) -> PrefillInstance:
    worker = PrefillWorkerConfig(
        model, 4096, "float64", query_block=16, float32_islands=False, frame_key=cluster_frame_key(TEST_TOKEN)
    )
    launch = LaunchConfig(2, port, nnodes=2, node_rank=0, node_timeout_s=TIMEOUT_S, ready_timeout_s=120)
    return PrefillInstance(worker, launch, chunk_size=64)


def check(inst: PrefillInstance, engine: LLMEngine, n: int, chunk: int) -> None:
    ids = torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
    want_logits, want_entries = reference(engine, ids)
    res = inst.prefill(f"r{n}-{chunk}", ids, SamplingParams(), chunk_size=chunk, want_logits=True)
    assert_close(res.logits, want_logits, f"n={n} chunk={chunk} logits")
    assert_prefill_cache(inst, res.slots, want_entries, f"n={n} chunk={chunk}")  # both ranks' entries
    inst.release(res.request_id)


def in_flight(inst: PrefillInstance) -> threading.Thread:
    """A long prefill on its own thread (its exception in .error), once it runs on every rank."""
    ids = [(7 * i) % 490 + 4 for i in range(2000)]

    def run():
        try:
            inst.prefill("long", ids, SamplingParams(), chunk_size=16)
        except Exception as e:
            t.error = e

    before = inst.ranks.seq
    t = threading.Thread(target=run)
    t.error = None
    t.start()
    deadline = time.monotonic() + 10
    while inst.ranks.seq == before and time.monotonic() < deadline:  # Command sent to node 1
        time.sleep(0.01)
    return t


def wait_unhealthy(inst: PrefillInstance) -> tuple[str, float]:
    t0 = time.monotonic()
    while not inst.ranks.unhealthy():
        assert time.monotonic() - t0 < TIMEOUT_S + 5, "the dead node was not seen"
        time.sleep(0.05)
    return inst.ranks.unhealthy(), time.monotonic() - t0


@pytest.fixture(scope="module")
def model(tiny_checkpoints):
    return str(tiny_checkpoints[("glm_moe_dsa", "make-model")])


@pytest.fixture(scope="module")
def engine(model):
    return LLMEngine.from_pretrained(model, "float64", float32_islands=False, max_kv_tokens=512)


def test_two_nodes_exact_dead_rank_seen_and_group_restarts(model, engine):
    port = free_port()
    agent = start_agent(model, port)
    try:
        inst = leader(model, port).start()
        print(f"\nleader {os.getpid()}: pdserve.engine from {__import__('pdserve').__file__}")
        for n, chunk in ((1, 64), (3, 64), (37, 7)):
            check(inst, engine, n, chunk)
        with pytest.raises(CommandFailed, match="unknown command"):  # a bad command fails alone
            inst.ranks.call("no such command")
        _, errors = inst.ranks.call_raw("no such command")  # node 1's traceback crossed the link
        assert sorted(errors) == [0, 1] and "TypeError: unknown command str" in errors[1]
        check(inst, engine, 19, 64)
        remote_rank = inst.ranks.pids[1]
        failed = in_flight(inst)  # the remote rank dies inside a command: the command fails at once
        os.kill(remote_rank, 9)
        why, took = wait_unhealthy(inst)
        print(f"remote rank killed: seen after {took:.2f} s: {why}")
        assert "node 1: rank 1" in why and took < TIMEOUT_S  # its agent's answer, or its next beat
        failed.join(TIMEOUT_S + 5)
        assert isinstance(failed.error, RankError), failed.error
        assert not inst.held  # the failed prefill's pages went back
        inst.shutdown()

        inst = leader(model, port).start()  # the agent joins the next leader: the group restarted
        assert pid_alive(agent.pid) and inst.ranks.pids[1] != remote_rank
        check(inst, engine, 37, 7)
        agent.kill()
        why, took = wait_unhealthy(inst)
        print(f"agent killed: seen after {took:.2f} s: {why}")
        assert why.startswith("node 1") and took < TIMEOUT_S + 1
        wait_until(lambda: not pid_alive(inst.ranks.pids[1]), "the dead agent's rank to exit", 5)
        inst.shutdown()
    finally:
        agent.kill()
        agent.wait(10)


def test_node_link_refuses_a_peer_without_the_token():
    """The leader's side of the handshake against a wrong key and against garbage; frames under
    the right key decode only to data classes."""
    from pdserve.runtime.node_wire import accept_link

    key = link_key(cluster_frame_key(TEST_TOKEN))
    server = socket.create_server(("127.0.0.1", 0))
    port = server.getsockname()[1]
    results = []

    def accept_one():
        sock, addr = server.accept()
        try:
            results.append(accept_link(sock, key, str(addr)))
        except LinkError as e:
            results.append(e)
            sock.close()

    for attempt in ("wrong key", "garbage"):
        t = threading.Thread(target=accept_one)
        t.start()
        if attempt == "wrong key":
            with pytest.raises(LinkError, match="authentication"):
                connect_link("127.0.0.1", port, link_key(b"another cluster's frame key....."))
        else:
            with socket.create_connection(("127.0.0.1", port)) as s:
                s.recv(32)
                s.sendall(b"\0" * 64)
        t.join(10)
        assert isinstance(results[-1], LinkError) and "authentication" in str(results[-1])
    server.close()


def test_node_wire_decodes_data_classes_only():
    msg = Replies(7, 3, [torch.arange(6, dtype=torch.bfloat16).view(2, 3), None], {1: "tb"})
    back = loads(dumps(msg))
    assert back.replies[0].dtype == torch.bfloat16 and torch.equal(back.replies[0], msg.replies[0])
    assert (back.generation, back.seq, back.errors) == (7, 3, {1: "tb"})

    class Evil:
        def __reduce__(self):
            return (os.system, ("true",))

    for bad in (Evil(), pickle.loads, torch.load):
        with pytest.raises(pickle.UnpicklingError, match="may not cross the node link"):
            loads(pickle.dumps(bad))


def test_node_link_bounds_and_checks_every_frame():
    """After the handshake: a frame announcing more than MAX_FRAME is refused before it is read,
    and a replayed frame (a sequence number already used) fails authentication."""
    from pdserve.runtime.node_wire import MAX_FRAME, Link

    a, b = socket.socketpair()
    tx = Link(a, b"k" * 32, b"leader->agent", b"agent->leader", "agent")
    rx = Link(b, b"k" * 32, b"agent->leader", b"leader->agent", "leader")
    tx.send(Replies(1, 1, [], {}))
    first = rx.sock.recv(1 << 16)  # taken off the wire by hand, to be sent twice
    rx.sock.close()
    a2, b2 = socket.socketpair()
    rx = Link(b2, b"k" * 32, b"agent->leader", b"leader->agent", "leader")
    a2.sendall(first)
    assert rx.recv() == Replies(1, 1, [], {})
    a2.sendall(first)  # the same frame again: its sequence number is spent
    with pytest.raises(LinkError, match="authentication"):
        rx.recv()
    a3, b3 = socket.socketpair()
    rx = Link(b3, b"k" * 32, b"agent->leader", b"leader->agent", "leader")
    a3.sendall((MAX_FRAME + 1).to_bytes(8, "little") + b"\0" * 32)
    with pytest.raises(LinkError, match="limit"):
        rx.recv()
    for s in (a, a2, a3, b2, b3):
        s.close()
