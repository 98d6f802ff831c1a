"""bench/transfer.py's ceiling for the hand-off: raw NIXL WRITEs over the same pairs as the hand-off.

A hand-off from C_p prefill ranks into C_d decode ranks is C_p x C_d concurrent sender -> receiver
pairs (every prefill rank holds some rows of every decode rank). Its fair ceiling is therefore not
one raw pair but the same pairs at once: C_p sender processes, each WRITEing bytes / (C_p x C_d) into
each of C_d receiver processes, all posted together; timed from a common start until every receiver
has seen every notification; every side polls with 0.2 ms sleeps, as the hand-off's loops do (4
processes spinning on 2 cores starve each other). Nothing is packed, checksummed or stored: this is what the transport
gives these processes on this machine (bench/ is on sys.path when a script runs)."""

from __future__ import annotations

import multiprocessing as mp
import statistics
import time

import torch

POLL_S = 0.0002  # the hand-off's own status polls sleep too


def _receiver(conn, idx: int, nbytes: int) -> None:
    from pdserve.transfer.nixl_agent import make_agent

    torch.set_num_threads(1)
    buf = torch.zeros(max(nbytes, 1), dtype=torch.uint8)
    agent = make_agent(f"raw-recv-{idx}")
    reg = agent.register_memory(buf)
    conn.send({"md": agent.get_agent_metadata(), "addr": buf.data_ptr()})
    while True:
        cmd = conn.recv()
        if cmd[0] != "wait":
            agent.deregister_memory(reg)
            conn.send("bye")
            return
        pending = set(cmd[1])  # (sender agent name, tag)
        conn.send("ready")
        while pending:  # polls with short sleeps: 4 spinning processes would starve each other on 2 cores
            pending = {(s, t) for s, t in pending if not agent.check_remote_xfer_done(s, t)}
            if pending:
                time.sleep(POLL_S)
        conn.send(time.perf_counter())


def _sender(conn, idx: int, chunk: int, receivers: list[dict]) -> None:
    from pdserve.transfer.nixl_agent import make_agent

    torch.set_num_threads(1)
    src = (torch.arange(chunk * len(receivers), dtype=torch.int64) % 251).to(torch.uint8)
    agent = make_agent(f"raw-send-{idx}")
    reg = agent.register_memory(src)
    peers = [agent.add_remote_agent(r["md"]) for r in receivers]
    conn.send("ready")
    while True:
        cmd = conn.recv()
        if cmd[0] != "go":
            agent.deregister_memory(reg)
            conn.send("bye")
            return
        _, tag, start = cmd
        handles = [
            agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs([(src.data_ptr() + d * chunk, chunk, 0)], "DRAM"),
                agent.get_xfer_descs([(r["addr"] + idx * chunk, chunk, 0)], "DRAM"),
                peer,
                tag,
            )
            for d, (r, peer) in enumerate(zip(receivers, peers))
        ]
        while time.perf_counter() < start:
            pass
        states = [agent.transfer(h) for h in handles]
        while any(s == "PROC" for s in states):
            time.sleep(POLL_S)
            states = [agent.check_xfer_state(h) if s == "PROC" else s for h, s in zip(handles, states)]
        for h in handles:
            agent.release_xfer_handle(h)
        conn.send(states)


def aggregate_nixl(senders: int, receivers: int, total_bytes: int, repeats: int) -> dict:
    """GB/s of total_bytes split over senders x receivers concurrent raw WRITEs; median of repeats."""
    ctx = mp.get_context("spawn")
    chunk = -(-total_bytes // (senders * receivers))
    rpipes, spipes, procs = [], [], []
    for i in range(receivers):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_receiver, args=(b, i, chunk * senders), daemon=True)
        p.start()
        rpipes.append(a)
        procs.append(p)
    infos = [a.recv() for a in rpipes]
    for i in range(senders):
        a, b = ctx.Pipe()
        p = ctx.Process(target=_sender, args=(b, i, chunk, infos), daemon=True)
        p.start()
        spipes.append(a)
        procs.append(p)
    for a in spipes:
        a.recv()
    times = []
    try:
        for rep in range(repeats + 1):  # the first round warms up the connections
            tag = f"raw{rep}".encode()
            for a in rpipes:
                a.send(("wait", [(f"raw-send-{s}", tag) for s in range(senders)]))
                a.recv()
            start = time.perf_counter() + 0.05
            for a in spipes:
                a.send(("go", tag, start))
            states = [a.recv() for a in spipes]
            if any(s != "DONE" for st in states for s in st):
                raise RuntimeError(f"raw NIXL WRITE ended {states}")
            done = max(a.recv() for a in rpipes)
            if rep:
                times.append(done - start)
    finally:
        for a in rpipes + spipes:
            a.send(("quit",))
            a.recv()
        for p in procs:
            p.join(10)
    med = statistics.median(times)
    nbytes = chunk * senders * receivers
    return {
        "senders": senders,
        "receivers": receivers,
        "bytes": nbytes,
        "seconds": {"min": min(times), "median": med, "max": max(times), "all": times},
        "GBps_median": nbytes / med / 1e9,
    }
