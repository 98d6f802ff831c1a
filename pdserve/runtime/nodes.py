"""One instance over several hosts: the node settings, from flags or a LeaderWorkerSet's environment.
Torch-free (the CLI reads them before torch is imported).

A LeaderWorkerSet (sigs.k8s.io/lws) gives each pod of a group LWS_GROUP_SIZE (pods in the group),
LWS_WORKER_INDEX (0 for the leader) and LWS_LEADER_ADDRESS (the leader pod's DNS name): they are
--nnodes, --node-rank and --dist-addr's host when those flags are not given.

The interfaces the ranks talk over are environment variables of the rank processes, set here from
the flags before any rank starts: GLOO_SOCKET_IFNAME (gloo: --gloo-ifname, else the variable, else
`lo` for a loopback --dist-addr, else the interface that holds the address reaching --dist-addr),
NCCL_SOCKET_IFNAME (--nccl-ifname) and NCCL_IB_HCA (--nccl-ib-hca).
"""

from __future__ import annotations

import fcntl
import os
import socket
import struct

LWS_ENV = {"nnodes": "LWS_GROUP_SIZE", "node_rank": "LWS_WORKER_INDEX", "dist_addr": "LWS_LEADER_ADDRESS"}
_SIOCGIFADDR = 0x8915


def parse_dist_addr(addr: str, default_port: int) -> tuple[str, int]:
    """ "host", "host:port", "[v6]:port" -> (host, port); "" -> ("127.0.0.1", default_port)."""
    if not addr:
        return "127.0.0.1", default_port
    host, port = addr, default_port
    if addr.startswith("["):
        host, _, rest = addr[1:].partition("]")
        if rest:
            port = _port(rest.removeprefix(":"), addr)
    elif addr.count(":") == 1:
        host, text = addr.split(":")
        port = _port(text, addr)
    if not host:
        raise ValueError(f"--dist-addr {addr!r}: no host")
    return host, port


def _port(text: str, addr: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65535:
        raise ValueError(f"--dist-addr {addr!r}: the port must be a number in [1, 65534]")
    return int(text)


def lws_values(values: dict, environ=os.environ) -> dict:
    """The CLI's values with --nnodes, --node-rank and --dist-addr filled from the LeaderWorkerSet
    variables where the flag was not given (None), else from their defaults."""
    for name, var in LWS_ENV.items():
        if values.get(name) is not None:
            continue
        text = environ.get(var, "")
        if name == "dist_addr":
            values[name] = text
        elif text:
            if not text.isdigit():
                raise ValueError(f"${var} must be a number, got {text!r}")
            values[name] = int(text)
        else:
            values[name] = 1 if name == "nnodes" else 0
    return values


def interface_env(cfg, environ=os.environ) -> dict[str, str]:
    """The variables the ranks of this node need (see the module doc), beyond what `environ` has."""
    out = {}
    host, _ = cfg.dist_endpoint()
    gloo = cfg.gloo_ifname or environ.get("GLOO_SOCKET_IFNAME", "")
    if not gloo and cfg.nnodes > 1 and host not in ("127.0.0.1", "localhost", "::1"):
        gloo = ifname_for(host)
    if gloo:
        out["GLOO_SOCKET_IFNAME"] = gloo
    if cfg.nccl_ifname:
        out["NCCL_SOCKET_IFNAME"] = cfg.nccl_ifname
    if cfg.nccl_ib_hca:
        out["NCCL_IB_HCA"] = cfg.nccl_ib_hca
    return out


def apply_interfaces(cfg) -> dict[str, str]:
    """Sets interface_env(cfg) in this process's environment (the ranks inherit it); returns it."""
    env = interface_env(cfg)
    os.environ.update(env)
    return env


def ifname_for(host: str) -> str:
    """The interface holding this host's address on the route to `host` ("" when none is found:
    gloo then resolves the hostname itself)."""
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        addr = socket.getaddrinfo(host, 1, family, socket.SOCK_DGRAM)[0][4][0]
        with socket.socket(family, socket.SOCK_DGRAM) as s:
            s.connect((addr, 1))  # no packet: only the route is looked up
            local = s.getsockname()[0]
    except OSError:
        return ""
    if family != socket.AF_INET:
        return ""
    for _, name in socket.if_nameindex():
        if _ipv4_of(name) == local:
            return name
    return ""


def _ipv4_of(name: str) -> str:
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        try:
            raw = fcntl.ioctl(s.fileno(), _SIOCGIFADDR, struct.pack("256s", name.encode()[:15]))
        except OSError:
            return ""
    return socket.inet_ntoa(raw[20:24])


def describe_nodes(cfg) -> str:
    """ " over N nodes (rendezvous H:P, node link H:P+1)" for a startup line; "" on one host."""
    if cfg.nnodes == 1:
        return ""
    host, port = cfg.dist_endpoint()
    return f" over {cfg.nnodes} nodes (rendezvous {host}:{port}, node link {host}:{port + 1})"
