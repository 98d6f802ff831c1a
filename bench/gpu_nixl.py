"""NIXL VRAM-to-VRAM WRITE between two processes on one GPU, against a device copy of the same bytes:
by size and by UCX setting, with the protocol UCX says it chose (issue 41: find which UCX transport
and thresholds the WRITE uses, and what it gives).

For every setting (an environment for UCX: `SETTINGS`, or those named by --settings) one receiver
and one sender process start (spawned, so UCX reads the setting at its start); the sender WRITEs
each size once untimed, then --repeats times timed (from `transfer` until `check_xfer_state` says
DONE); the receiver counts the notifications. Each pair's stdout and stderr are kept, and the
protocol tables UCX prints for remote memory writes (UCX_PROTO_INFO=y: size range, protocol,
transport) go into the JSON (`ucx_protocols`), a failed setting's log tail too. A device copy
(`dst.copy_(src)`, synchronised) of each size is the baseline, so each row carries
`write_over_copy` (the issue's target: >= 0.5). A fixed cost per WRITE shows as a ratio that
rises with size; a slow transport as one that does not.

The JSON is rewritten after every setting, so a run cut short by its time limit keeps what it
measured. On a CPU (`--device cpu`) the same runs take host memory: a smoke test of the script.

    python bench/gpu_nixl.py                               on a GPU: 64 MB .. 2 GB, every setting
    python bench/gpu_nixl.py --device cpu --sizes-mb 4,16 --settings default --repeats 2

bench/gpu.py takes `handoff` from here for its one-size row."""

from __future__ import annotations

import argparse
import datetime
import json
import os
import queue
import re
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

MB = 1 << 20
# name -> UCX environment. NIXL's UCX backend WRITEs with ucp_put; on one GPU the candidates are
# cuda_ipc (the peer's buffer mapped, a device copy) and a pipeline staged through cuda_copy
SETTINGS = {
    "default": {},
    "cuda_ipc": {"UCX_TLS": "cuda_ipc,cuda_copy,sm,self"},
    "no_cuda_ipc": {"UCX_TLS": "^cuda_ipc"},
}
WRITE_TIMEOUT_S = 60  # one WRITE not DONE by then is an error of its setting


def _device(name: str) -> torch.device:
    return torch.device("cuda", 0) if name == "cuda" else torch.device("cpu")


def _log_to(path: str) -> None:
    """This process's stdout and stderr (UCX's own writes included) go to `path`."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    os.dup2(fd, 1)
    os.dup2(fd, 2)


def _receiver(device: str, nbytes: int, writes: int, q_out, q_in, results, log: str) -> None:
    from pdserve.transfer.nixl_agent import bind_device, make_agent, mem_type

    _log_to(log)
    buf = torch.empty(nbytes, dtype=torch.uint8, device=_device(device))
    bind_device(buf)
    agent = make_agent("bench-nixl-recv")
    agent.register_memory(buf)
    q_out.put((agent.get_agent_metadata(), buf.data_ptr(), mem_type(buf), buf.device.index or 0))
    # every WRITE's notification, or what came until 2 s after the sender stopped (a WRITE failed)
    deadline, got, done_at = time.monotonic() + 300, 0, None
    while got < writes and time.monotonic() < min(deadline, (done_at or deadline) + 2):
        got += sum(len(m) for m in agent.get_new_notifs().values())
        if done_at is None and not q_in.empty():
            q_in.get()  # "done"
            done_at = time.monotonic()
        time.sleep(0.0005)
    results.put(("receiver", got))
    if done_at is None:
        q_in.get(timeout=300)


def _sender(device: str, sizes: list[int], repeats: int, q_in, q_out, results, log: str) -> None:
    from pdserve.transfer.nixl_agent import make_agent, mem_type

    _log_to(log)
    dev = _device(device)
    if dev.type == "cuda":
        torch.cuda.set_device(dev)
    src = torch.randint(0, 255, (max(sizes),), dtype=torch.uint8, device=dev)
    agent = make_agent("bench-nixl-send")
    agent.register_memory(src)
    meta, addr, mem, remote_dev = q_in.get(timeout=300)
    peer = agent.add_remote_agent(meta)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    out = {}
    for nbytes in sizes:
        local = agent.get_xfer_descs([(src.data_ptr(), nbytes, dev.index or 0)], mem_type(src))
        remote = agent.get_xfer_descs([(addr, nbytes, remote_dev)], mem)
        times = []
        for i in range(repeats + 1):  # the first one untimed: connection and mapping set up
            h = agent.initialize_xfer("WRITE", local, remote, peer, f"w{nbytes}-{i}".encode())
            t0 = time.perf_counter()
            state = agent.transfer(h)
            while state == "PROC" and time.perf_counter() - t0 < WRITE_TIMEOUT_S:
                state = agent.check_xfer_state(h)
            times.append(time.perf_counter() - t0)
            agent.release_xfer_handle(h)
            if state != "DONE":
                out[nbytes] = {"error": f"WRITE {state}"}
                break
        else:
            out[nbytes] = {"seconds": times[1:]}
    results.put(("sender", out))
    q_out.put("done")


def write_rates(device: str, sizes: list[int], repeats: int, env: dict, log: str) -> dict:
    """{bytes: {"seconds": [...]} or {"error": ...}} of one setting's sender, and the receiver's count."""
    ctx = mp.get_context("spawn")
    to_sender, to_receiver, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(
            target=_receiver,
            args=(device, max(sizes), len(sizes) * (repeats + 1), to_sender, to_receiver, results, log),
        ),
        ctx.Process(target=_sender, args=(device, sizes, repeats, to_sender, to_receiver, results, log)),
    ]
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # spawned children read the environment as it is at their start
    try:
        for p in procs:
            p.start()
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
    got: dict = {}
    error = None
    try:
        deadline = time.monotonic() + 600
        while len(got) < 2 and error is None:
            try:
                kind, value = results.get(timeout=1)
                got[kind] = value
            except queue.Empty:
                if crashed := [p.exitcode for p in procs if p.exitcode not in (None, 0)]:
                    error = f"a process exited with code {crashed[0]} (its log: ucx_log_tail)"
                elif time.monotonic() > deadline:
                    error = "no result within 600 s"
    finally:
        for p in procs:
            if p.pid is not None:
                p.join(10 if error is None else 0.1)
                if p.is_alive():
                    p.kill()
    out = {"writes": got.get("sender", {}), "notifications": got.get("receiver")}
    return out if error is None else {**out, "error": error}


def copy_seconds(device: str, nbytes: int, repeats: int) -> float:
    dev = _device(device)
    src = torch.randint(0, 255, (nbytes,), dtype=torch.uint8, device=dev)
    dst = torch.empty_like(src)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    times = []
    for _ in range(repeats + 1):
        sync()
        t0 = time.perf_counter()
        dst.copy_(src)
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times[1:])


def proto_lines(log: str, limit: int = 80) -> list[str]:
    """UCX's protocol tables for remote memory writes (UCX_PROTO_INFO=y), from the log: per table its
    endpoint config and title, then its rows (size range | how | transport/device); each table once."""
    try:
        lines = Path(log).read_text(errors="replace").splitlines()
    except OSError:
        return []
    tables, keep, cfg = [], False, ""  # [title, row, ...] each
    for raw in lines:
        line = re.sub(r"^\[[^]]*\] \[[^]]*\] *", "", raw).strip()  # UCX's [time] [host:pid:thread]
        if line.startswith("+"):  # a table's rule
            continue
        text = " ".join(line.strip("|").split()) if line.startswith("|") else ""
        if "cfg#" in text:
            cfg, keep = text, False
        elif text.startswith("remote memory write"):
            keep = True
            tables.append([f"{cfg}: {text}"])
        elif keep and (text[:1].isdigit() or text.startswith("Range")):
            tables[-1].append(f"  {text}")
        else:  # another table's title, or not UCX's
            keep = False
    return [line for table in dict.fromkeys(map(tuple, tables)) for line in table][:limit]


def log_tail(log: str, lines: int = 15) -> list[str]:
    try:
        return Path(log).read_text(errors="replace").splitlines()[-lines:]
    except OSError:
        return []


def handoff(nbytes: int, device: str = "cuda", repeats: int = 5) -> dict:
    """bench/gpu.py's row: one size, UCX as configured: the WRITE's GB/s (its best of repeats) and the copy's (median)."""
    with tempfile.TemporaryDirectory() as tmp:
        res = write_rates(device, [nbytes], repeats, {}, str(Path(tmp) / "ucx.log"))
    w = res["writes"][nbytes]
    if "error" in w:
        return {"error": w["error"], "bytes": nbytes}
    copy = copy_seconds(device, nbytes, repeats)
    return {
        "nixl_vram_gb_per_s": round(nbytes / min(w["seconds"]) / 1e9, 2),
        "bytes": nbytes,
        "device_copy_gb_per_s": round(nbytes / copy / 1e9, 2),
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument(
        "--device", choices=("cuda", "cpu"), default="cuda", help="cuda (the claim) or cpu (a smoke test)"
    )
    ap.add_argument(
        "--sizes-mb", default="64,512,2048", help="WRITE sizes in MB, comma-separated (default 64,512,2048)"
    )
    ap.add_argument(
        "--settings",
        default=",".join(SETTINGS),
        help=f"UCX settings to run, comma-separated, of {', '.join(SETTINGS)} (default: all)",
    )
    ap.add_argument(
        "--repeats", type=int, default=5, help="timed WRITEs and copies per size; medians (default 5)"
    )
    ap.add_argument(
        "--out", default="bench/results/gpu_nixl.json", help="the JSON, rewritten after every setting"
    )
    args = ap.parse_args(argv)
    try:
        sizes = [int(float(s) * MB) for s in args.sizes_mb.split(",") if s.strip()]
    except ValueError:
        ap.error(f"--sizes-mb: not numbers: {args.sizes_mb!r}")
    names = [s.strip() for s in args.settings.split(",") if s.strip()]
    if unknown := [n for n in names if n not in SETTINGS]:
        ap.error(f"unknown settings {unknown}; known: {', '.join(SETTINGS)}")
    if not sizes or min(sizes) < 1 or args.repeats < 1 or not names:
        ap.error("--sizes-mb must name positive sizes, --repeats be >= 1, --settings name one at least")
    if args.device == "cuda" and not torch.cuda.is_available():
        sys.exit("bench/gpu_nixl.py --device cuda needs a CUDA GPU (--device cpu: the smoke test)")
    copies = {n: copy_seconds(args.device, n, args.repeats) for n in sizes}
    doc = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "device": torch.cuda.get_device_name(0) if args.device == "cuda" else "cpu",
        "torch": torch.__version__,
        "config": {
            "sizes_bytes": sizes,
            "repeats": args.repeats,
            "settings": {n: SETTINGS[n] for n in names},
        },
        "copy_gb_per_s": {str(n): round(n / s / 1e9, 2) for n, s in copies.items()},
        "rows": [],
        "target": "write_over_copy >= 0.5 (issue 41)",
    }
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        for name in names:
            log = str(Path(tmp) / f"{name}.log")
            env = {**SETTINGS[name], "UCX_PROTO_INFO": "y"}
            t0 = time.monotonic()
            res = write_rates(args.device, sizes, args.repeats, env, log)  # a failure is recorded, not raised
            for n in sizes:
                w = res["writes"].get(n, {"error": res.get("error", "no result")})
                row = {"setting": name, "bytes": n}
                if "seconds" in w:
                    med = statistics.median(w["seconds"])
                    row.update(
                        write_ms_median=round(1000 * med, 3),
                        write_gb_per_s=round(n / med / 1e9, 2),
                        write_over_copy=round(copies[n] / med, 3),
                    )
                else:
                    row["error"] = w["error"]
                doc["rows"].append(row)
                print(json.dumps(row), flush=True)
            doc.setdefault("notifications", {})[name] = res.get("notifications")
            doc.setdefault("ucx_protocols", {})[name] = proto_lines(log)
            if "error" in res:
                doc.setdefault("ucx_log_tail", {})[name] = log_tail(log)
            doc.setdefault("setting_seconds", {})[name] = round(time.monotonic() - t0, 1)
            out.write_text(json.dumps(doc, indent=1))
    best = max(
        (r for r in doc["rows"] if "write_over_copy" in r), key=lambda r: r["write_over_copy"], default=None
    )
    doc["best"] = best
    out.write_text(json.dumps(doc, indent=1))
    print(f"best: {json.dumps(best)}\nwrote {out}")


if __name__ == "__main__":
    main()
