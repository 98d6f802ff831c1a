"""Two-process NIXL WRITE (UCX backend, host DRAM) with completion notification; 64 MB vs loopback TCP.
pip install torch==2.13.0 nixl   (resolves nixl 1.5.1 + nixl-cu12/-cu13 1.5.1; the CPU box uses nixl_cu13)
Run:  UCX_NET_DEVICES=lo python nixl_demo.py [--no-fail]     env NIXL_PTHR=<us> enables the progress thread."""

import multiprocessing as mp
import os
import socket
import sys
import time

import torch

MB = 1 << 20
N = 64 * MB
REGIONS = [
    (0, 1 * MB, 8 * MB),
    (3 * MB, 4096, 20 * MB),
    (10 * MB, 5 * MB, 40 * MB),
]  # (src_off, len, dst_off)


def pattern(n):  # deterministic source bytes, recomputable by the receiver
    return (torch.arange(n, dtype=torch.int64) % 251).to(torch.uint8)


def make_agent(name):
    try:
        import nixl._api as api  # meta package `nixl` (picks nixl_cu13 / nixl_cu12 at import)
    except ImportError:
        import nixl_cu13._api as api  # only `nixl-cu13` installed
    pthr = os.environ.get("NIXL_PTHR")  # progress-thread sleep in us; the wrapper hard-codes 0 = busy spin
    if pthr is not None and not getattr(api, "_pthr_patched", False):
        orig = api.nixlBind.nixlAgent

        def patched(n, cfg):
            cfg.pthrDelay = int(pthr)
            return orig(n, cfg)

        api.nixlBind.nixlAgent, api._pthr_patched = patched, True
    # No progress thread: the owner must poll (check_xfer_state / get_new_notifs) to make progress.
    return api.nixl_agent(name, api.nixl_agent_config(enable_prog_thread=pthr is not None, backends=["UCX"]))


def receiver(conn, name="receiver"):
    agent = make_agent(name)
    buf = torch.zeros(N, dtype=torch.uint8)
    reg = agent.register_memory(buf)  # CPU tensor -> DRAM; returns nixlRegDList (keep it for deregister)
    srv = socket.create_server(("127.0.0.1", 0))
    conn.send(
        {
            "md": agent.get_agent_metadata(),  # bytes; in production send over the ZMQ side channel
            "descs": agent.get_serialized_descs(agent.get_xfer_descs(buf)),  # pickled nixlXferDList
            "tcp_port": srv.getsockname()[1],
        }
    )
    ref = pattern(N)
    while True:
        cmd = conn.recv()
        if cmd[0] == "wait":  # ("wait", tag, [(src_off, len, dst_off), ...], timeout_s)
            _, tag, regions, tmo = cmd
            t_end = time.monotonic() + tmo
            # check_remote_xfer_done: get_new_notifs() merged into agent.notifs; pops the match
            while not agent.check_remote_xfer_done("sender", tag):
                if time.monotonic() > t_end:
                    conn.send(("timeout", None, False))
                    break
                time.sleep(0.0002)
            else:
                t = time.perf_counter()
                ok = all(torch.equal(buf[d : d + n], ref[s : s + n]) for s, n, d in regions)
                buf.zero_()
                conn.send(("ok", t, ok))
        elif cmd[0] == "tcp":
            c, _ = srv.accept()
            mv = memoryview(buf.numpy())
            got = 0
            while got < N:
                got += c.recv_into(mv[got:], N - got)
            t = time.perf_counter()
            c.close()
            ok = torch.equal(buf, ref)
            buf.zero_()
            conn.send(("ok", t, ok))
        elif cmd[0] == "quit":
            agent.deregister_memory(reg)
            conn.send("bye")
            return


def start_receiver(ctx):
    a, b = ctx.Pipe()
    p = ctx.Process(target=receiver, args=(b,), daemon=True)
    p.start()
    return p, a, a.recv()


def wait_done(
    agent, h, tmo=30.0
):  # transfer() -> "DONE"/"PROC"/"ERR"; raises nixlRemoteDisconnectError on dead peer
    st, t_end = agent.transfer(h), time.monotonic() + tmo
    while st == "PROC":
        if time.monotonic() > t_end:
            return "TIMEOUT"  # caller then release_xfer_handle(h) (cancels) and remove_remote_agent()
        st = agent.check_xfer_state(h)
    return st


def main():
    ctx = mp.get_context("spawn")
    p, conn, info = start_receiver(ctx)
    agent = make_agent("sender")
    src = pattern(N)
    reg = agent.register_memory(src)
    remote = agent.add_remote_agent(info["md"])  # returns the name as bytes: b"receiver"
    raddr = agent.deserialize_descs(info["descs"])[0][0]  # desc -> (addr, len, dev_id)

    # 1) three non-contiguous regions via prepped dlists (prepare once, pick indices per request)
    local = agent.prep_xfer_dlist(
        "NIXL_INIT_AGENT", [(src.data_ptr() + s, n, 0) for s, n, d in REGIONS], "DRAM"
    )
    rem = agent.prep_xfer_dlist("receiver", [(raddr + d, n, 0) for s, n, d in REGIONS], "DRAM")
    conn.send(("wait", b"regions-1", REGIONS, 10))  # receiver polls before we post (it must progress)
    h = agent.make_prepped_xfer("WRITE", local, [0, 1, 2], rem, [0, 1, 2], b"regions-1")
    print("3-region WRITE:", wait_done(agent, h), "receiver:", conn.recv())
    agent.release_xfer_handle(h)
    agent.release_dlist_handle(local)
    agent.release_dlist_handle(rem)

    # 2) 64 MB timings: NIXL (initialize_xfer, one-shot API) vs loopback TCP
    for i in range(4):
        tag = b"big-%d" % i
        conn.send(("wait", tag, [(0, N, 0)], 10))
        h = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs([(src.data_ptr(), N, 0)], "DRAM"),
            agent.get_xfer_descs([(raddr, N, 0)], "DRAM"),
            remote,
            tag,
        )
        t0 = time.perf_counter()
        st = wait_done(agent, h)
        t1 = time.perf_counter()
        r = conn.recv()
        agent.release_xfer_handle(h)
        print(
            f"NIXL 64MB #{i}: {st} sender-done {1e3 * (t1 - t0):.1f} ms, notif-seen {1e3 * (r[1] - t0):.1f} ms "
            f"({N / (r[1] - t0) / 1e9:.2f} GB/s) verified={r[2]}"
        )
    for i in range(3):
        conn.send(("tcp",))
        s = socket.create_connection(("127.0.0.1", info["tcp_port"]))
        t0 = time.perf_counter()
        s.sendall(memoryview(src.numpy()))
        r = conn.recv()
        s.close()
        print(
            f"TCP  64MB #{i}: {1e3 * (r[1] - t0):.1f} ms ({N / (r[1] - t0) / 1e9:.2f} GB/s) verified={r[2]}"
        )

    if "--no-fail" in sys.argv:
        conn.send(("quit",))
        conn.recv()
        agent.remove_remote_agent("receiver")
        agent.deregister_memory(reg)
        return
    # 3) remote agent dies: a WRITE raises nixlRemoteDisconnectError at once
    p.kill()
    p.join()
    print("receiver killed")
    t = time.perf_counter()
    try:
        h = agent.initialize_xfer(
            "WRITE",
            agent.get_xfer_descs([(src.data_ptr(), MB, 0)], "DRAM"),
            agent.get_xfer_descs([(raddr, MB, 0)], "DRAM"),
            remote,
            b"dead",
        )
        print(f"WRITE to dead agent -> {wait_done(agent, h)}")
    except Exception as e:
        print(f"WRITE to dead agent raised after {time.perf_counter() - t:.3f}s: {type(e).__name__}: {e}")

    # 4) restart remote agent (same name, new metadata): must remove_remote_agent first
    p, conn, info = start_receiver(ctx)
    try:
        agent.add_remote_agent(info["md"])
        print("re-add without remove: OK")
    except Exception as e:
        print(f"re-add without remove raised: {type(e).__name__}: {e}")
        agent.remove_remote_agent("receiver")
        agent.add_remote_agent(info["md"])
        print("remove+add: OK")
    raddr = agent.deserialize_descs(info["descs"])[0][0]
    conn.send(("wait", b"after-restart", REGIONS, 10))
    h = agent.initialize_xfer(
        "WRITE",
        agent.get_xfer_descs([(src.data_ptr() + s, n, 0) for s, n, d in REGIONS], "DRAM"),
        agent.get_xfer_descs([(raddr + d, n, 0) for s, n, d in REGIONS], "DRAM"),
        remote,
        b"after-restart",
    )
    print("WRITE after restart:", wait_done(agent, h), conn.recv())
    agent.release_xfer_handle(h)
    conn.send(("quit",))
    conn.recv()
    p.join()
    agent.remove_remote_agent("receiver")
    agent.deregister_memory(reg)
    print("clean shutdown")


if __name__ == "__main__":
    main()
