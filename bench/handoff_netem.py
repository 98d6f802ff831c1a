"""KV hand-off across a shaped link between two hosts (root only).

A prefill instance (C_p = 2) on host p and a decode instance (W = C_d = 2) on host d: network
namespaces joined by veths on a bridge (tests/system/netns.py), each host's NIC shaped with
`tc qdisc add dev eth0 root netem delay 1ms rate 10gbit` (both directions: 1 ms each way). The whole
hand-off of a 16k-token prompt of the built-in `small` model is timed as bench/transfer.py (c) does
(plan, expect, every prefill rank sends its share, every decode rank stores its rows), the median of
--repeats (min and max recorded), and compared with the link's floor: payload bytes / link rate
(+ one round trip). Kernels without sch_netem get tbf (rate only; see shape()).

- tcp: the decode ranks' receivers listen on host d's address (`--data-host`), the prefill ranks
  connect over the shaped link.
- nixl: UCX over TCP on eth0 (UCX_NET_DEVICES=eth0, UCX_TLS=tcp,self: the ranks of both hosts are
  processes of one machine here, so UCX's shared-memory transports would otherwise bypass the link).

Run:  sudo .venv/bin/python bench/handoff_netem.py     (~2 min; bench/results/handoff_netem.json)
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import sys
import threading
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))  # tests.system.netns

from common import resolve_model  # noqa: E402  (bench/ is on sys.path when a script runs)
from transfer import handoff  # noqa: E402

from tests.system.netns import DEVICE, Hosts, join_netns  # noqa: E402


class OnHost:
    """Starts an instance (its rank processes) from a thread inside a host's namespace: the ranks
    inherit it, so their sockets and NIXL agents are on that host. The thread lives as long as the
    instance (the ranks' parent-death signal follows the thread that started them) and stops it."""

    def __init__(self, ns: str, instance):
        self.ns, self.instance = ns, instance
        self.started, self.stop = threading.Event(), threading.Event()
        self.error: BaseException | None = None

    def _run(self) -> None:
        try:
            join_netns(self.ns)
            with self.instance:
                self.started.set()
                self.stop.wait()
        except BaseException as e:  # handed to __enter__
            self.error = e
            self.started.set()

    def __enter__(self):
        self.thread = threading.Thread(target=self._run, name=f"host-{self.ns}")
        self.thread.start()
        self.started.wait()
        if self.error is not None:
            raise self.error
        return self.instance

    def __exit__(self, *exc):
        self.stop.set()
        self.thread.join()


def shape(hosts: Hosts, rate_gbit: float, delay_ms: float) -> float:
    """Shapes both hosts' NICs; returns the delay each way actually added. netem (rate and delay)
    where the kernel has it; else tbf (rate alone: kernels built without sch_netem, like the
    Firecracker VMs this was run on, have no qdisc that delays)."""
    netem = ["netem", "delay", f"{delay_ms}ms", "rate", f"{rate_gbit}gbit", "limit", "100000"]
    tbf = ["tbf", "rate", f"{rate_gbit}gbit", "burst", "2mb", "latency", "100ms"]
    added = delay_ms
    for host in ("p", "d"):
        r = hosts.exec(host, "tc", "qdisc", "add", "dev", DEVICE, "root", *netem, check=False)
        if r.returncode != 0 and "unknown" in r.stderr:
            print(f"no netem in this kernel ({r.stderr.strip()}): tbf, rate only", flush=True)
            hosts.exec(host, "tc", "qdisc", "add", "dev", DEVICE, "root", *tbf)
            added = 0.0
        elif r.returncode != 0:
            raise RuntimeError(r.stderr)
    return added


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=int, default=16384, help="prompt tokens (default 16384)")
    ap.add_argument("--delay-ms", type=float, default=1.0, help="netem delay each way (default 1)")
    ap.add_argument("--rate-gbit", type=float, default=10.0, help="netem rate (default 10)")
    ap.add_argument("--transfers", default="tcp,nixl", help="data paths (default tcp,nixl)")
    ap.add_argument(
        "--repeats", type=int, default=5, help="hand-offs per data path, the median kept (default 5)"
    )
    ap.add_argument("--model", default=None, help="checkpoint directory (default: the built-in small model)")
    ap.add_argument("--out", default="bench/results", help="output directory for handoff_netem.json")
    args = ap.parse_args()
    if os.geteuid() != 0:
        sys.exit("bench/handoff_netem.py needs root (network namespaces, tc)")
    os.environ.update({"UCX_NET_DEVICES": DEVICE, "UCX_TLS": "tcp,self"})
    model = resolve_model(args.model)
    rate = args.rate_gbit * 1e9 / 8  # bytes/s
    results = {}
    with Hosts(["p", "d"]) as hosts:
        delay_ms = shape(hosts, args.rate_gbit, args.delay_ms)

        def place(role: str, instance):
            return OnHost(hosts.ns("p" if role == "prefill" else "d"), instance)

        for transfer in args.transfers.split(","):
            r = handoff(model, transfer, args.tokens, args.repeats, data_host=hosts.addr("d"), place=place)
            floor = r["bytes"] / rate + 2 * delay_ms / 1000
            r |= {"link_floor_s": floor, "over_floor": r["seconds"] / floor}
            print(
                f"{transfer}: {r['bytes'] / 1e6:.1f} MB in {1000 * r['seconds']:.1f} ms; link floor "
                f"{1000 * floor:.1f} ms (bytes / {args.rate_gbit:g} Gbit/s + one round trip): "
                f"{r['over_floor']:.2f}x",
                flush=True,
            )
            results[transfer] = r
        qdisc = hosts.exec("p", "tc", "-s", "qdisc", "show", "dev", DEVICE).stdout
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    record = {
        "machine": {
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
        },
        "config": {
            "tokens": args.tokens,
            "delay_ms": delay_ms,
            "rate_gbit": args.rate_gbit,
            "repeats": args.repeats,
            "model": model,
            "UCX_TLS": os.environ["UCX_TLS"],
            "qdisc_prefill_host": qdisc.strip(),
        },
        "handoff": results,
    }
    (out / "handoff_netem.json").write_text(json.dumps(record, indent=1) + "\n")
    print(f"wrote {out / 'handoff_netem.json'}")


if __name__ == "__main__":
    main()
