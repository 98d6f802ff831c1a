"""Prefill and decode on different hosts: three network namespaces on one bridge (host p: the prefill
instances, host d: the decode instances, host r: the routers and the client), every process started
with the addresses and flags of separate machines (tests/system/cluster.py).

- Through a router on host r: C_p = 2 into W = C_d = 2, copied and split index, over NIXL and over
  TCP: the greedy tokens equal the single-rank engine's, and the KV rows crossed the veth into host d.
- Misconfigurations users make fail the request within the timeout the README documents, with its
  error, and leave every instance healthy: a decode advertising 127.0.0.1 to the prefill
  (`--data-host` left at its default), a decode with UCX_NET_DEVICES=lo (pdserve's single-machine
  default), a firewall on host d dropping the prefill's connections to the data ports.
- Nothing is left: no namespace of the run, no process inside one.
"""

from __future__ import annotations

import json
import re
import time

import pytest

from pdserve.engine.llm_engine import LLMEngine
from pdserve.request import SamplingParams
from tests.system import cluster
from tests.system.netns import Hosts, leftovers

TIMEOUT_S = 5.0  # every instance's --bootstrap-timeout / --transfer-timeout here
TOKENS = 8
PROMPTS = [[(11 * i + n) % 500 + 4 for i in range(n)] for n in (5, 300)]
# (transport, index) -> (prefill port, decode port): every pairing of the issue
PAIRS = {("tcp", "copy"): (8100, 8200), ("tcp", "split"): (8100, 8210)}
PAIRS |= {("nixl", "copy"): (8101, 8201), ("nixl", "split"): (8101, 8211)}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    from pdserve.checkpoints.random_checkpoint import make_model

    return make_model(tmp_path_factory.mktemp("ckpt") / "tiny", "glm_moe_dsa", "tiny", seed=0)


@pytest.fixture(scope="module")
def engine(model_dir):
    return LLMEngine.from_pretrained(model_dir)


@pytest.fixture(scope="module")
def stack(model_dir, tmp_path_factory):
    """Two prefill instances (TCP, NIXL) on host p; four decode instances (TCP/NIXL x copy/split)
    and two misconfigured ones on host d; started together, torn down with their namespaces."""
    logs = tmp_path_factory.mktemp("logs")
    common = ["--model", str(model_dir), "--max-kv-tokens", "2048"]
    with Hosts(["p", "d", "r"]) as hosts:
        env = cluster.host_env()
        procs = {}
        for i, transport in enumerate(("tcp", "nixl")):
            procs[f"prefill-{transport}"] = cluster.start(
                hosts,
                "p",
                f"prefill-{transport}",
                ["prefill", *common, "--cp-size", "2", "--transfer", transport]
                + ["--dist-port", str(29500 + 10 * i), "--bootstrap-timeout", str(TIMEOUT_S)],
                8100 + i,
                logs,
                env,
            )
        decode = ["decode", *common, "--page-size", "4", "--transfer-timeout", str(TIMEOUT_S)]
        for (transport, index), (_, port) in PAIRS.items():
            procs[f"decode-{transport}-{index}"] = cluster.start(
                hosts,
                "d",
                f"decode-{transport}-{index}",
                [*decode, "--tp-size", "2", "--dcp-size", "2", "--dcp-index", index, "--transfer", transport]
                + ["--data-host", hosts.addr("d"), "--dist-port", str(port + 21400)],
                port,
                logs,
                env,
            )
        # the misconfigured ones (one rank each: what fails is the address, not the layout)
        procs["decode-tcp-loopback"] = cluster.start(
            hosts,
            "d",
            "decode-tcp-loopback",
            [*decode, "--transfer", "tcp", "--dist-port", "29700"],
            8300,
            logs,
            env,
        )
        procs["decode-nixl-lo"] = cluster.start(
            hosts,
            "d",
            "decode-nixl-lo",
            [*decode, "--transfer", "nixl", "--data-host", hosts.addr("d"), "--dist-port", "29710"],
            8301,
            logs,
            cluster.host_env(UCX_NET_DEVICES="lo"),
        )
        cluster.wait_healthy(hosts, list(procs.values()))
        yield {"hosts": hosts, "procs": procs, "logs": logs, "model": model_dir}
    assert not [n for n in leftovers() if n.startswith(hosts.tag)], "namespaces left behind"


def router(stack, name: str, prefill_port: int, decode_port: int, *extra: str) -> cluster.Proc:
    """`pdserve router` on host r in front of one prefill and one decode instance."""
    hosts = stack["hosts"]
    port = 8000 + len([p for p in stack["procs"] if p.startswith("router")])
    args = [
        "router",
        "--model",
        str(stack["model"]),
        "--served-model-name",
        "tiny",
        "--health-interval",
        "0.5",
    ]
    args += ["--prefill", f"http://{hosts.addr('p')}:{prefill_port}"]
    args += ["--decode", f"http://{hosts.addr('d')}:{decode_port}", *extra]
    proc = cluster.start(hosts, "r", f"router-{name}", args, port, stack["logs"], cluster.host_env())
    stack["procs"][f"router-{name}"] = proc
    cluster.wait_healthy(hosts, [proc], 60)
    return proc


def greedy(engine, ids):
    return engine.generate([ids], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0]


@pytest.mark.parametrize("transport,index", list(PAIRS))
def test_tokens_cross_hosts_equal_single_rank_engine(stack, engine, transport, index):
    hosts = stack["hosts"]
    p_port, d_port = PAIRS[(transport, index)]
    r = router(stack, f"{transport}-{index}", p_port, d_port)
    want = [greedy(engine, ids) for ids in PROMPTS]
    before = cluster.rx_bytes(hosts, "d")
    got = [hosts.call("r", cluster.complete, r.url, ids, TOKENS) for ids in PROMPTS]
    crossed = cluster.rx_bytes(hosts, "d") - before
    for resp, w in zip(got, want):
        assert resp.status_code == 200, resp.text
        choice = resp.json()["choices"][0]
        assert choice["token_ids"] == w
    # at least the latent rows of every prompt token (float32) came over the veth into host d
    cfg = json.loads((stack["model"] / "config.json").read_text())
    latent = cfg["num_hidden_layers"] * (cfg["kv_lora_rank"] + cfg["qk_rope_head_dim"]) * 4
    assert crossed > latent * sum(map(len, PROMPTS)), crossed


def failing_request(stack, r: cluster.Proc, expect: str) -> None:
    """A request through router `r` fails with `expect` in its error, within the documented
    timeout of every try (the router's --max-attempts), and every instance stays healthy."""
    t0 = time.monotonic()
    resp = stack["hosts"].call("r", cluster.complete, r.url, PROMPTS[1], TOKENS, 120)
    took = time.monotonic() - t0
    assert resp.status_code == 502, resp.text
    message = resp.json()["error"]["message"]
    tries = int(re.match(r"failed after (\d+) tries: ", message).group(1))
    print(f"\n{r.name}: {took:.2f} s, {message}")
    assert expect in message
    assert took < tries * TIMEOUT_S + 10, (took, message)
    cluster.wait_healthy(
        stack["hosts"], [p for n, p in stack["procs"].items() if not n.startswith("router")], 30
    )


def test_decode_advertising_loopback_times_out(stack):
    """`--data-host` left at 127.0.0.1: the prefill ranks connect to their own host; the decode's
    --transfer-timeout ends the request."""
    r = router(stack, "tcp-loopback", 8100, 8300, "--max-attempts", "1")
    failing_request(stack, r, f"transfer timeout after {TIMEOUT_S} s waiting for the prefill's outcome")


def test_decode_ucx_on_lo_fails_at_once(stack):
    """UCX_NET_DEVICES=lo on the decode host: its agent advertises loopback only, and the prefill
    ranks cannot load it (a UCX error, before the timeout)."""
    r = router(stack, "nixl-lo", 8101, 8301, "--max-attempts", "1")
    failing_request(stack, r, "cannot load agent")


@pytest.mark.parametrize("transport", ["tcp", "nixl"])
def test_firewall_dropping_the_data_ports_fails_cleanly(stack, engine, transport):
    hosts = stack["hosts"]
    p_port, d_port = PAIRS[(transport, "copy")]
    r = stack["procs"].get(f"router-{transport}-copy") or router(stack, f"{transport}-copy", p_port, d_port)
    # host d drops every packet from host p but HTTP (to the decode APIs) and the side channel's
    # (from the prefill's bootstrap port): the data paths, whoever opened their connections
    info = hosts.call("r", cluster.get, f"{stack['procs'][f'prefill-{transport}'].url}/info").json()
    side_channel = int(info["bootstrap"].rsplit(":", 1)[1])
    rules = f"""table inet pdsv {{
        chain input {{
            type filter hook input priority 0; policy accept;
            ip saddr {hosts.addr("p")} tcp sport != {side_channel} tcp dport != {{ 8200, 8201, 8210, 8211, 8300, 8301 }} drop
        }}
    }}
    """
    hosts.exec("d", "nft", "-f", "-", stdin=rules)
    try:  # every try of the router (3) waits for the decode's --transfer-timeout
        failing_request(stack, r, f"transfer timeout after {TIMEOUT_S} s waiting for")
    finally:
        hosts.exec("d", "nft", "delete table inet pdsv")
    resp = hosts.call("r", cluster.complete, r.url, PROMPTS[0], TOKENS)
    assert resp.status_code == 200, resp.text
    assert resp.json()["choices"][0]["token_ids"] == greedy(engine, PROMPTS[0])
