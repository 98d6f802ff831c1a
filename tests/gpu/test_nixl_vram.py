"""NIXL in GPU memory: a VRAM-to-VRAM WRITE between two processes (the registered tensors are CUDA
tensors: descriptor type VRAM, device id = GPU ordinal), with its notification, and the receiver's
keyed row hashes of the landed rows (transfer/row_mac.row_macs, computed on the GPU) equal to the sender's."""

from __future__ import annotations

import torch
import torch.multiprocessing as mp

ROWS, WIDTH = 4096, 576  # 4096 latent entries of the released dims, bf16: 4.5 MiB


def _data() -> torch.Tensor:
    g = torch.Generator().manual_seed(7)
    return torch.randn(ROWS, WIDTH, generator=g).to(torch.bfloat16)


def _receiver(q_out, q_in, results) -> None:
    import time

    from pdserve.transfer.frames import DEV_FRAME_KEY
    from pdserve.transfer.nixl_agent import bind_device, make_agent, mem_type
    from pdserve.transfer.row_mac import row_macs

    buf = torch.zeros(ROWS, WIDTH, dtype=torch.bfloat16, device="cuda:0")
    bind_device(buf)
    agent = make_agent("gpu-check-recv")
    reg = agent.register_memory(buf)
    q_out.put(
        (agent.get_agent_metadata(), buf.data_ptr(), buf.numel() * 2, mem_type(buf), buf.device.index or 0)
    )
    deadline, notes = time.monotonic() + 60, []
    while time.monotonic() < deadline and not notes:
        notes = [m for msgs in agent.get_new_notifs().values() for m in msgs]
        time.sleep(0.001)
    torch.cuda.synchronize()
    results.put(
        (
            "recv",
            notes[:1],
            row_macs(DEV_FRAME_KEY, buf).cpu().tolist(),
            bool(torch.equal(buf.cpu(), _data())),
        )
    )
    q_in.get(timeout=60)  # the sender is done with our memory
    agent.deregister_memory(reg)


def _sender(q_in, q_out, results) -> None:
    import time

    from pdserve.transfer.frames import DEV_FRAME_KEY
    from pdserve.transfer.nixl_agent import make_agent, mem_type
    from pdserve.transfer.row_mac import row_macs

    torch.cuda.set_device(0)
    src = _data().to("cuda:0")
    agent = make_agent("gpu-check-send")
    reg = agent.register_memory(src)
    meta, addr, nbytes, mem, dev = q_in.get(timeout=120)
    peer = agent.add_remote_agent(meta)
    peer = peer.decode() if isinstance(peer, bytes) else peer
    torch.cuda.current_stream().synchronize()
    local = agent.get_xfer_descs([(src.data_ptr(), nbytes, src.device.index or 0)], mem_type(src))
    remote = agent.get_xfer_descs([(addr, nbytes, dev)], mem)
    h = agent.initialize_xfer("WRITE", local, remote, peer, b"kv-landed")
    state, t0 = agent.transfer(h), time.monotonic()
    while state == "PROC" and time.monotonic() - t0 < 60:
        state = agent.check_xfer_state(h)
    results.put(("send", state, row_macs(DEV_FRAME_KEY, src).cpu().tolist(), mem))
    agent.release_xfer_handle(h)
    q_out.put("done")
    agent.deregister_memory(reg)


def test_nixl_vram_write_between_processes():
    ctx = mp.get_context("spawn")
    to_sender, to_receiver, results = ctx.Queue(), ctx.Queue(), ctx.Queue()
    procs = [
        ctx.Process(target=_receiver, args=(to_sender, to_receiver, results)),
        ctx.Process(target=_sender, args=(to_sender, to_receiver, results)),
    ]
    for p in procs:
        p.start()
    got = dict((r[0], r[1:]) for r in (results.get(timeout=180) for _ in range(2)))
    for p in procs:
        p.join(30)
    state, sent_digest, mem = got["send"]
    notes, recv_digest, equal = got["recv"]
    assert mem == "VRAM" and state == "DONE", (mem, state)
    assert notes == [b"kv-landed"] and equal
    assert recv_digest == sent_digest
