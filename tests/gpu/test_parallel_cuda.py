"""A 2-rank CP prefill and a 2-rank DCP decode on one GPU (--gpu-ids 0,0: the host comm, since NCCL
refuses two ranks on one GPU), equal to the single-rank engine (float64 within 1e-8)."""

from __future__ import annotations

import torch

from pdserve.decode_server.instance import DecodeInstance
from pdserve.decode_server.worker_config import DecodeWorkerConfig
from pdserve.engine.llm_engine import LLMEngine
from pdserve.prefill_server.instance import PrefillInstance
from pdserve.prefill_server.worker_config import PrefillWorkerConfig
from pdserve.request import SamplingParams
from pdserve.runtime.launcher import LaunchConfig
from tests.reference import assert_close, free_port, reference_prefill

TOKENS = 8


def _engine(path):
    return LLMEngine.from_pretrained(path, "float64", float32_islands=False, max_kv_tokens=1024)


def test_cp_prefill_two_ranks_on_one_gpu(tiny):
    engine = _engine(tiny)
    worker = PrefillWorkerConfig(tiny, 1024, "float64", query_block=16, float32_islands=False, device="cuda")
    launch = LaunchConfig(2, free_port(), device="cuda", gpu_ids=(0, 0))
    assert launch.devices().comm == "host"
    with PrefillInstance(worker, launch) as inst:
        for n, chunk in ((1, 1), (9, 9), (70, 16)):
            ids = torch.randint(4, 500, (n,), generator=torch.Generator().manual_seed(n)).tolist()
            want_logits, want_entries = reference_prefill(engine, ids)
            res = inst.prefill(f"r{n}", ids, SamplingParams(), chunk_size=chunk, want_logits=True)
            assert_close(res.logits, want_logits, f"n={n} logits")
            for rank, dump in enumerate(inst.dump_cache(res.slots)):
                for layer, (kv, _) in dump.items():
                    assert_close(kv, want_entries[layer][0], f"n={n} rank {rank} layer {layer}")
            inst.release(res.request_id)


def test_dcp_decode_two_ranks_on_one_gpu(tiny):
    engine = _engine(tiny)
    ids = torch.randint(4, 500, (70,), generator=torch.Generator().manual_seed(3)).tolist()
    want = engine.generate([ids], SamplingParams(max_tokens=TOKENS, ignore_eos=True))[0]
    want_logits = engine.prefill_logits(ids + want[:-1])[len(ids) :]
    entries = reference_prefill(engine, ids)[1]
    worker = DecodeWorkerConfig(
        tiny,
        num_slots=1024,
        dcp_size=2,
        dtype="float64",
        float32_islands=False,
        device="cuda",
        gpu_ids=(0, 0),
    )
    with DecodeInstance(
        worker, LaunchConfig(2, free_port(), device="cuda", gpu_ids=(0, 0)), page_size=4
    ) as inst:
        for index_mode in ("copy", "split"):
            inst.reconfigure(index_mode, "a2a")
            pages = inst.allocator.allocate(len(ids) + TOKENS)
            kv = torch.stack([entries[layer][0] for layer in sorted(entries)])
            inst.load(pages, kv, {layer: e[1] for layer, e in entries.items() if e[1] is not None})
            seq, logits = list(ids) + [want[0]], []
            for _ in range(TOKENS - 1):
                row = inst.step([seq[-1]], [pages], [len(seq)])[0]
                logits.append(row)
                seq.append(int(row.argmax()))
            inst.allocator.free(pages)
            assert seq[len(ids) :] == want, index_mode
            assert_close(torch.stack(logits), want_logits, index_mode)
