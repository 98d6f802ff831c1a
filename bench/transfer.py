"""KV hand-off transport: bandwidth between two processes, pack cost, and a whole 16k-token hand-off.

Claims measured: at 64 MB, NIXL (UCX, host DRAM) moves data at least as fast as a raw TCP
socket on loopback (the practical ceiling on a machine without RDMA), measured in the same run; and
a whole hand-off of a 16k-token prompt of the built-in `small` model from a prefill instance with
C_p = 2 into a decode instance with W = C_d = 2 (pack included, from the first send to the last row
stored) reaches at least 80% of the aggregate raw NIXL rate of the same sender -> receiver pairs
WRITEing the same bytes at once, in rounds between the hand-offs, with the same number of repeats;
medians on both sides; and against raw WRITEs whose receivers read every landed byte once, the read
invariant 8 requires of a verified hand-off (bench/transfer_raw.py).

(a) transports, between a parent and a spawned child process, payloads of 1, 16, 64 and 256 MB:
    - NIXL: one WRITE of the payload from a registered buffer into the child's registered buffer,
      timed until the child saw the notification;
    - zmq PUSH -> PULL of one [header, payload] message: the TCP backend's transport (tcp.py);
    - a raw TCP socket on 127.0.0.1 (sendall -> recv_into a preallocated buffer);
    - memcpy: one single-threaded copy of the same bytes inside one process (the physical ceiling).
    Each is timed --repeats times; the median counts (min and max recorded).
(b) pack: gathering one decode rank's rows (every other token, all layers) into a contiguous
    buffer, as a sender does before a WRITE; and the room MAC of the same rows (RoomChecksum under
    the frame key), which a hand-off's senders and receivers both take over every byte (invariants 8
    and 11) and raw WRITEs do not, and the TCP frame tag (HMAC-SHA256) over them; `ratios` says
    what share of each hand-off's time the two room MACs would take on one core.
(c) the whole hand-off with --transfer tcp and nixl: the prompt is prefilled once, then the cache is
    sent --handoff-repeats times into fresh reservations (plan, expect, every prefill rank sends its
    share, every decode rank stores its rows); rate = payload bytes / median time. Also the CPU time
    (user + system, from /proc) all four rank processes and this one spent per hand-off, and how
    many of the machine's cores that kept busy: on a 2-core host the hand-off is CPU-bound, so this
    says how much of its time is work (pack, WRITE, store, checksums) rather than waiting.

(d) overlap (--overlap-tokens, default 16k and 64k): the hand-off's exposed time (from the prefill's
    last compute to every row verified on the decode side) as a share of TTFT, streamed and not,
    and the unstreamed hand-off's rate against the verified floor (bench/handoff_overlap.py, whose
    `measure` runs here; its summary rows join this file's).

Run:  .venv/bin/python bench/transfer.py      (a few minutes, plus the 64k prefills of (d);
      bench/results/transfer.json + .png)
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import socket
import statistics
import time
from pathlib import Path

import torch

# bench/ is on sys.path when a script runs
from common import cpu_user_system, free_port, machine_info, resolve_model
from handoff_overlap import measure as overlap_measure
from handoff_overlap import summary_rows as overlap_rows
from transfer_costs import checksum_cost, pack_cost
from transfer_raw import Interleaved
from transfer_report import plot, summary_rows

MB = 1 << 20


# ---- (a) transports --------------------------------------------------------------------------------
def _child(conn, max_bytes: int) -> None:
    """The receiving process: a NIXL agent with a registered buffer, a zmq PULL socket, a TCP listener."""
    import zmq

    from pdserve.transfer.nixl_agent import make_agent

    torch.set_num_threads(1)
    buf = torch.zeros(max_bytes, dtype=torch.uint8)
    agent = make_agent("bench-receiver")
    reg = agent.register_memory(buf)
    ctx = zmq.Context()
    pull = ctx.socket(zmq.PULL)
    zport = pull.bind_to_random_port("tcp://127.0.0.1")
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send(
        {
            "md": agent.get_agent_metadata(),
            "addr": buf.data_ptr(),
            "zmq": f"tcp://127.0.0.1:{zport}",
            "tcp": srv.getsockname()[1],
        }
    )
    view = memoryview(buf.numpy())
    while True:
        cmd = conn.recv()
        if cmd[0] == "nixl":
            tag = cmd[1]
            conn.send("ready")
            while not agent.check_remote_xfer_done("bench-sender", tag):
                pass  # the receiver must poll for the WRITE to progress (no progress thread)
            conn.send(time.perf_counter())
        elif cmd[0] == "zmq":
            conn.send("ready")
            header, payload = pull.recv_multipart(copy=False)
            buf[: len(payload.buffer)].copy_(
                torch.frombuffer(payload.buffer, dtype=torch.uint8)
            )  # store it, as tcp.py does
            conn.send(time.perf_counter())
        elif cmd[0] == "tcp":
            conn.send("ready")
            c, _ = srv.accept()
            n, got = cmd[1], 0
            while got < n:
                got += c.recv_into(view[got:n], n - got)
            c.close()
            conn.send(time.perf_counter())
        else:
            agent.deregister_memory(reg)
            pull.close()
            ctx.term()
            conn.send("bye")
            return


def transports(sizes_mb: list[int], repeats: int) -> dict:
    import zmq

    from pdserve.transfer.nixl_agent import make_agent

    torch.set_num_threads(1)
    top = max(sizes_mb) * MB
    parent, child_end = mp.get_context("spawn").Pipe()
    child = mp.get_context("spawn").Process(target=_child, args=(child_end, top), daemon=True)
    child.start()
    info = parent.recv()
    src = (torch.arange(top, dtype=torch.int64) % 251).to(torch.uint8)
    agent = make_agent("bench-sender")
    reg = agent.register_memory(src)
    peer = agent.add_remote_agent(info["md"])
    ctx = zmq.Context()
    push = ctx.socket(zmq.PUSH)
    push.connect(info["zmq"])
    out: dict[str, dict[int, float]] = {
        "nixl": {},
        "zmq (tcp backend transport)": {},
        "tcp socket": {},
        "memcpy": {},
    }
    spread: dict[str, dict[int, list[float]]] = {k: {} for k in out}
    for mb in sizes_mb:
        n = mb * MB
        times: dict[str, list[float]] = {k: [] for k in out}
        dst = torch.empty(n, dtype=torch.uint8)
        for i in range(repeats):
            tag = f"w{mb}-{i}".encode()
            parent.send(("nixl", tag))
            parent.recv()
            h = agent.initialize_xfer(
                "WRITE",
                agent.get_xfer_descs([(src.data_ptr(), n, 0)], "DRAM"),
                agent.get_xfer_descs([(info["addr"], n, 0)], "DRAM"),
                peer,
                tag,
            )
            t0 = time.perf_counter()
            state = agent.transfer(h)
            while state == "PROC":
                state = agent.check_xfer_state(h)
            if state != "DONE":
                raise RuntimeError(f"NIXL WRITE ended {state}")
            times["nixl"].append(parent.recv() - t0)
            agent.release_xfer_handle(h)

            parent.send(("zmq",))
            parent.recv()
            t0 = time.perf_counter()
            push.send_multipart([b"{}", memoryview(src.numpy())[:n]], copy=False)
            times["zmq (tcp backend transport)"].append(parent.recv() - t0)

            parent.send(("tcp", n))
            parent.recv()
            with socket.create_connection(("127.0.0.1", info["tcp"])) as s:
                t0 = time.perf_counter()
                s.sendall(memoryview(src.numpy())[:n])
                times["tcp socket"].append(parent.recv() - t0)

            t0 = time.perf_counter()
            dst.copy_(src[:n])
            times["memcpy"].append(time.perf_counter() - t0)
        for k in out:
            out[k][mb] = n / statistics.median(times[k]) / 1e9  # GB/s, median of the repeats
            spread[k][mb] = [n / t / 1e9 for t in sorted(times[k], reverse=True)]  # min .. max GB/s
        print(f"{mb:4d} MB  " + "  ".join(f"{k}: {out[k][mb]:6.2f} GB/s" for k in out), flush=True)
    parent.send(("quit",))
    parent.recv()
    child.join(10)
    agent.remove_remote_agent(peer if isinstance(peer, str) else peer.decode())
    agent.deregister_memory(reg)
    push.close()
    ctx.term()
    return out, spread


# ---- (c) the whole hand-off ---------------------------------------------------------------------------
def _phases(start: float, seen: float, senders: list, receivers: list) -> dict[str, float]:
    # senders: the prefill ranks' SenderStatus, receivers: the decode ranks' RoomStatus
    """One hand-off's critical path in ms, from the ranks' own clocks (time.monotonic: one clock on one
    host), in four parts that add up to the whole: the command reaching the last sender; from there
    until the last send returned (laying out, WRITEs, waiting for them); the receivers counting and
    checksumming the last rows after that; the caller seeing every rank complete."""
    began = max(s.counters["last_send_began"] for s in senders)
    ended = max(s.counters["last_send_ended"] for s in senders)
    checked = max((r.last_row_at for r in receivers if r.last_row_at is not None), default=ended)
    return {
        "dispatch": 1000 * (began - start),
        "sends": 1000 * (ended - began),
        "checks_after_sends": 1000 * max(0.0, checked - ended),
        "seen_after_checks": 1000 * (seen - max(checked, ended)),
    }


def handoff(
    model: str,
    transfer: str,
    tokens: int,
    repeats: int,
    data_host: str = "127.0.0.1",
    place=None,
    between=None,
) -> dict:
    """(c) above. data_host: the decode ranks' TCP receivers' address; place(role, instance): the
    context manager that starts an instance (default: the instance itself; bench/handoff_netem.py
    starts each on a host of its own); between(pair_bytes, row_bytes, pids): called after each
    hand-off, outside its timing, with the bytes each (prefill rank, decode rank) pair carried, a
    latent row's bytes and the instances' process ids (transfer_raw.Interleaved)."""
    from pdserve.decode_server.instance import DecodeInstance
    from pdserve.decode_server.worker_config import DecodeWorkerConfig
    from pdserve.prefill_server.instance import PrefillInstance
    from pdserve.prefill_server.worker_config import PrefillWorkerConfig
    from pdserve.request import SamplingParams
    from pdserve.runtime.launcher import LaunchConfig
    from pdserve.transfer.plan import plan_transfer

    page = 64
    slots = -(-tokens // page) * page
    pw = PrefillWorkerConfig(model, slots, transfer=transfer)
    dw = DecodeWorkerConfig(model, slots, dcp_size=2, transfer=transfer, data_host=data_host)
    place = place or (lambda role, instance: instance)
    with (
        place(
            "prefill", PrefillInstance(pw, LaunchConfig(2, free_port()), page_size=page, chunk_size=4096)
        ) as pre,
        place("decode", DecodeInstance(dw, LaunchConfig(2, free_port()), page_size=page)) as dec,
    ):
        ids = [(7 * i) % 500 + 4 for i in range(tokens)]
        t0 = time.perf_counter()
        result = pre.prefill("bench", ids, SamplingParams())
        prefill_s = time.perf_counter() - t0
        cfg = pre.model_config
        times, nbytes, wall = [], 0, 0.0
        names = [f"prefill rank {r}" for r in range(2)] + [f"decode rank {r}" for r in range(2)] + ["bench"]
        pids = pre.ranks.pids + dec.ranks.pids + [os.getpid()]
        cpu, system = dict.fromkeys(names, 0.0), dict.fromkeys(names, 0.0)
        phases: dict[str, list[float]] = {}
        for i in range(repeats):
            room = f"bench-{i}"
            pages = dec.allocator.allocate(tokens)
            reservation = dec.reservation(room, pages, prompt_len=tokens)
            plan = plan_transfer(pre.prefill_side(result.slots), dec.decode_side(pages), tokens)
            dec.expect(room, reservation.ticket, plan, pages)
            c0, t0, m0 = [cpu_user_system(pid) for pid in pids], time.perf_counter(), time.monotonic()
            pre.send("bench", room, reservation.ticket, plan, reservation.endpoints)
            while True:  # one status round trip per poll, as the decode loop thread does
                status = dec.room_status(room)
                if all(s.complete for s in status):
                    break
                if any(s.error for s in status):
                    raise RuntimeError(status)
                time.sleep(0.0005)
            times.append(time.perf_counter() - t0)
            for name, ms in _phases(m0, time.monotonic(), pre.transfer_status(), status).items():
                phases.setdefault(name, []).append(ms)
            wall += times[-1]
            for name, pid, (user0, sys0) in zip(names, pids, c0):
                user, sys_s = cpu_user_system(pid)
                cpu[name] += user - user0 + sys_s - sys0
                system[name] += sys_s - sys0
            dec.forget(room, True)
            dec.allocator.free(pages)
            pair_bytes: dict[tuple[int, int], int] = {}
            for t in plan:
                key = (t.src_rank, t.dst_rank)
                row = (cfg.kv_entry_dim if t.kind == "kv" else cfg.index_head_dim) * 4
                pair_bytes[key] = pair_bytes.get(key, 0) + t.rows * row
            nbytes = sum(pair_bytes.values())
            if between is not None:
                between(pair_bytes, cfg.kv_entry_dim * 4, pids[:-1])
        pre.release("bench")
    best = statistics.median(times)  # the median hand-off (min and max recorded)
    total = sum(cpu.values())
    by_process = {name: round(1000 * c / repeats, 1) for name, c in cpu.items()}
    system_by_process = {name: round(1000 * c / repeats, 1) for name, c in system.items()}
    print(
        f"hand-off {transfer:5s}: {tokens} tokens, {nbytes / MB:.1f} MB in {1000 * best:.1f} ms "
        f"({nbytes / best / 1e9:.2f} GB/s; the prefill itself took {prefill_s:.1f} s)\n"
        f"    CPU per hand-off {1000 * total / repeats:.0f} ms, {total / wall:.2f} cores busy; ms by process: "
        f"{by_process}; of it system time (kernel work: the copies of a shared-memory WRITE or of a socket) {system_by_process}\n"
        f"    median ms of its critical path: "
        f"{ {name: round(statistics.median(v), 2) for name, v in phases.items()} }",
        flush=True,
    )
    return {
        "tokens": tokens,
        "bytes": nbytes,
        "seconds": best,
        "seconds_min_max": [min(times), max(times)],
        "GBps": nbytes / best / 1e9,
        "prefill_s": prefill_s,
        "cpu_s_per_handoff": total / repeats,
        "cores_busy": total / wall,
        "cpu_ms_per_handoff_by_process": by_process,
        "system_cpu_ms_per_handoff_by_process": system_by_process,
        "mean_seconds": wall / repeats,
        "phases_ms_median": {name: statistics.median(v) for name, v in phases.items()},
        "pair_bytes": {f"{s} -> {d}": n for (s, d), n in sorted(pair_bytes.items())},
    }


def main() -> None:

    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--sizes", default="1,16,64,256", help="payload sizes in MB, comma-separated (64 is required)"
    )
    ap.add_argument(
        "--tokens", type=int, default=16384, help="prompt tokens of the whole hand-off (default 16384)"
    )
    ap.add_argument(
        "--transfers", default="nixl,tcp", help="hand-off data paths to measure (default nixl,tcp)"
    )
    ap.add_argument(
        "--repeats", type=int, default=5, help="timed repeats per transport and size; medians (default 5)"
    )
    ap.add_argument(
        "--handoff-repeats",
        type=int,
        default=10,
        help="hand-offs per data path and raw aggregate rounds: medians, CPU time averaged (default 10)",
    )
    ap.add_argument(
        "--overlap-tokens",
        default="16384,65536",
        help="prompt lengths of (d), streamed vs unstreamed over NIXL, comma-separated ('' skips it)",
    )
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in small model)")
    ap.add_argument("--out", default="bench/results", help="output directory for transfer.json/.png")
    args = ap.parse_args()
    os.environ.setdefault("UCX_NET_DEVICES", "lo")
    sizes = [int(x) for x in args.sizes.split(",")]
    if 64 not in sizes:
        ap.error("--sizes must include 64 (the claim is stated at 64 MB)")
    model = resolve_model(args.model)
    raw, raw_spread = transports(sizes, args.repeats)
    res = {
        "transports_GBps": raw,
        "transports_GBps_min_max": raw_spread,
        "pack": pack_cost(model, args.tokens, args.repeats),
        "checksum": checksum_cost(model, args.tokens, args.repeats),
        "handoff": {},
    }
    raw = Interleaved()  # the ceilings' rounds, between the NIXL hand-offs (the same VM phase)
    try:
        for t in args.transfers.split(","):
            res["handoff"][t] = handoff(
                model, t, args.tokens, args.handoff_repeats, between=raw if t == "nixl" else None
            )
    finally:
        raw.close()
    overlap = [int(x) for x in args.overlap_tokens.split(",") if x.strip()]
    res["overlap"] = {str(n): overlap_measure(model, "nixl", n, 2) for n in overlap}
    nixl64 = res["transports_GBps"]["nixl"][64]
    ratios = {"nixl_over_tcp_socket_64MB": nixl64 / res["transports_GBps"]["tcp socket"][64]}
    if "nixl" in res["handoff"]:
        agg, ver = raw.result("raw"), raw.result("verified")
        res["aggregate_raw_nixl"], res["verified_raw_nixl"] = agg, ver
        res["raw_rounds_instances_cpu_ms"] = raw.instances_cpu_ms()
        for name, r in (("raw NIXL", agg), ("raw NIXL + the receivers' one read", ver)):
            print(
                f"{name} over the hand-off's pairs {sorted(r['pair_bytes'])}: {r['bytes'] / MB:.1f} MB in "
                f"{1000 * r['seconds']['median']:.1f} ms median ({r['GBps_median']:.2f} GB/s)",
                flush=True,
            )
        ratios["handoff_nixl_over_aggregate_raw_nixl"] = res["handoff"]["nixl"]["GBps"] / agg["GBps_median"]
        ratios["handoff_nixl_over_verified_raw_nixl"] = res["handoff"]["nixl"]["GBps"] / ver["GBps_median"]
        # what any hand-off that reads its bytes once can reach of the raw rate, on these cores
        ratios["verified_raw_over_aggregate_raw_nixl"] = ver["GBps_median"] / agg["GBps_median"]
    for t, h in res["handoff"].items():
        ratios[f"handoff_{t}_over_single_pair_nixl_raw_64MB"] = h["GBps"] / nixl64
        # the room MACs taken during it per byte, times the hand-off's bytes per second: the receiver's,
        # and over TCP the sender's (a NIXL sender reads the row hashes its pool kept at store time)
        ratios[f"room_macs_share_of_handoff_{t}"] = (
            (1 if t == "nixl" else 2)
            * res["checksum"]["seconds"]
            / res["checksum"]["bytes"]
            * h["GBps"]
            * 1e9
        )
    print("\nratios:", json.dumps(ratios, indent=1))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "transfer.json").write_text(
        json.dumps(
            {
                "machine": dict(
                    machine_info(("torch", "nixl")),
                    UCX_NET_DEVICES=os.environ.get("UCX_NET_DEVICES"),
                    UCX_TLS=os.environ.get("UCX_TLS"),
                ),
                "config": {
                    "sizes_mb": sizes,
                    "tokens": args.tokens,
                    "repeats": args.repeats,
                    "handoff_repeats": args.handoff_repeats,
                    "model": model,
                },
                **res,
                "ratios": ratios,
                "summary": summary_rows(res, ratios, args) + overlap_rows(res["overlap"], "nixl"),
            },
            indent=1,
        )
    )
    plot(res, out / "transfer.png")
    print(f"\nwrote {out / 'transfer.json'} and {out / 'transfer.png'}")


if __name__ == "__main__":
    main()
