"""One instance over two hosts (issue 41 item 1), hosts as network namespaces (tests/system/netns.py):
a prefill instance with C_p = 2 whose node 0 is on host p0 and node 1 on host p1, and a decode
instance with W = C_d = 2 split the same way over d0 and d1, each node started with the same flags
plus `--nnodes 2 --node-rank R --dist-addr <node 0>:PORT`, as on separate machines (the gloo
interface found from --dist-addr; each decode node advertises its own --data-host).

For each data path (TCP, NIXL): through a router on host r the greedy tokens equal the single-rank
engine's (as the single-host stack's do, tests/system/test_two_hosts.py); killing the worker node's
rank of either instance restarts that whole group (its /health fails meanwhile, then answers
200 again) and the requests after it are exact again.
"""

from __future__ import annotations

import time
from pathlib import Path

import httpx
import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from tests.system import cluster
from tests.system.netns import Hosts, leftovers

TOKENS = 8
PROMPTS = [[(11 * i + n) % 500 + 4 for i in range(n)] for n in (5, 300)]
NODE_TIMEOUT = "3"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pdserve.checkpoints.random_checkpoint import make_model

    return make_model(tmp_path_factory.mktemp("ckpt") / "tiny", "glm_moe_dsa", "tiny", seed=0)


@pytest.fixture(scope="module")
def want(model_dir):
    engine = LLMEngine.from_pretrained(model_dir)
    params = SamplingParams(max_tokens=TOKENS, ignore_eos=True)
    return [engine.generate([ids], params)[0] for ids in PROMPTS]


@pytest.fixture(scope="module", params=["tcp", "nixl"])
def stack(request, model_dir, tmp_path_factory):
    transport = request.param
    logs = tmp_path_factory.mktemp(f"logs-{transport}")
    common = ["--model", str(model_dir), "--max-kv-tokens", "2048", "--transfer", transport]
    common += ["--nnodes", "2", "--node-timeout", NODE_TIMEOUT]
    with Hosts(["p0", "p1", "d0", "d1", "r"]) as hosts:
        env = cluster.host_env()
        procs = {}
        prefill = ["prefill", *common, "--cp-size", "2", "--dist-addr", f"{hosts.addr('p0')}:29500"]
        decode = ["decode", *common, "--tp-size", "2", "--dcp-size", "2", "--page-size", "4"]
        decode += ["--dist-addr", f"{hosts.addr('d0')}:29600"]
        for node in (0, 1):
            p, d = f"p{node}", f"d{node}"
            args = [*prefill, "--node-rank", str(node)]
            procs[p] = cluster.start(hosts, p, f"prefill-node{node}", args, 8100, logs, env)
            args = [*decode, "--node-rank", str(node), "--data-host", hosts.addr(d)]
            procs[d] = cluster.start(hosts, d, f"decode-node{node}", args, 8200, logs, env)
        cluster.wait_healthy(hosts, [procs["p0"], procs["d0"]])  # node 0 answers once every rank is up
        router = [
            "router",
            "--model",
            str(model_dir),
            "--served-model-name",
            "tiny",
            "--health-interval",
            "0.5",
        ]
        router += ["--prefill", procs["p0"].url, "--decode", procs["d0"].url]
        procs["r"] = cluster.start(hosts, "r", "router", router, 8000, logs, env)
        cluster.wait_healthy(hosts, [procs["r"]], 60)
        yield {"hosts": hosts, "procs": procs, "transport": transport}
    assert not [n for n in leftovers() if n.startswith(hosts.tag)], "namespaces left behind"


def rank_pids(hosts: Hosts, host: str) -> list[int]:
    """The rank processes on `host`: the children of the forkserver its pdserve process started."""
    out = []
    for pid in hosts.exec(host, "ip", "netns", "pids", hosts.ns(host)).stdout.split():
        try:
            ppid = int(Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[1])
            parent = Path(f"/proc/{ppid}/cmdline").read_bytes()
        except (OSError, ValueError, IndexError):
            continue
        if b"multiprocessing.forkserver" in parent:
            out.append(int(pid))
    return out


def assert_exact(stack, want, deadline_s: float = 90.0) -> None:
    """Every prompt through the router gives the engine's tokens (after a restart the router may
    answer 502 until its next health poll has seen the instance again: retried within the deadline)."""
    hosts, url = stack["hosts"], stack["procs"]["r"].url
    for ids, w in zip(PROMPTS, want):
        deadline = time.monotonic() + deadline_s
        while True:
            resp = hosts.call("r", cluster.complete, url, ids, TOKENS)
            if resp.status_code == 200 or time.monotonic() > deadline:
                break
            time.sleep(0.5)
        assert resp.status_code == 200, resp.text
        assert resp.json()["choices"][0]["token_ids"] == w


def health(stack, node0: cluster.Proc) -> int:
    try:
        return stack["hosts"].call("r", cluster.get, f"{node0.url}/health", 1).status_code
    except httpx.HTTPError:
        return 0  # nothing listens: the leader is starting anew


def test_split_instances_are_exact(stack, want):
    assert_exact(stack, want)


@pytest.mark.parametrize("role", ["prefill", "decode"])
def test_killing_the_worker_nodes_rank_restarts_the_group(stack, want, role):
    hosts, procs = stack["hosts"], stack["procs"]
    worker, node0 = procs[f"{role[0]}1"], procs[f"{role[0]}0"]
    ranks = rank_pids(hosts, worker.host)
    assert len(ranks) == 1, (ranks, worker.tail())
    t0 = time.monotonic()
    hosts.exec(worker.host, "kill", "-9", str(ranks[0]))
    while health(stack, node0) == 200:  # the leader sees it within --node-timeout and goes down
        assert time.monotonic() - t0 < float(NODE_TIMEOUT) + 5, node0.tail()
        time.sleep(0.1)
    down = time.monotonic() - t0
    while health(stack, node0) != 200:
        assert time.monotonic() - t0 < 180, node0.tail()
        assert node0.proc.poll() is None and worker.proc.poll() is None, (node0.tail(), worker.tail())
        time.sleep(0.3)
    print(
        f"\n{stack['transport']} {role}: /health failed {down:.2f} s after the kill, 200 again after {time.monotonic() - t0:.1f} s"
    )
    assert "group restart 1" in node0.log.read_text()
    new = rank_pids(hosts, worker.host)
    assert len(new) == 1 and new != ranks
    assert_exact(stack, want)
