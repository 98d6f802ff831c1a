"""GPU benchmark (runs only on a CUDA machine): the torch ops vs the flashinfer ops, and the KV
hand-off's GB/s over NIXL in VRAM vs a plain device copy.

Claims measured, on the `mla` preset (released MLA dims: kv_lora_rank 512, rope 64, index top-k
2048; two layers, so attention and the indexer dominate) in bf16 on GPU 0:
  1. decode step time (batch 1 and 8, one new token each) at 8k and 32k context, per ops;
  2. prefill tokens/s of an 8k and a 32k prompt (chunked at 4096), per ops;
  3. hand-off bandwidth: a NIXL VRAM-to-VRAM WRITE of one 32k-token layer set between two agents
     in two processes, vs torch's device-to-device copy of the same bytes (bench/gpu_nixl.py
     `handoff`; that script sweeps sizes and UCX settings).
The flashinfer rows are {"error": ...} where flashinfer cannot run (attn_ops.flashinfer_blocker).

Run:  python bench/gpu.py [--out bench/results/gpu.json] [--contexts 8192,32768]
"""

from __future__ import annotations

import argparse
import datetime
import json
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from gpu_nixl import handoff  # noqa: E402  (bench/ is on sys.path when a script runs)

from pdserve.checkpoints.random_checkpoint import make_model  # noqa: E402
from pdserve.engine.attn_ops import gather_facts, select_attention_ops  # noqa: E402
from pdserve.engine.llm_engine import LLMEngine  # noqa: E402
from pdserve.request import SamplingParams  # noqa: E402

DECODE_STEPS = 20


def _sync_time(fn) -> float:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0


def engine_run(model: str, ops: str, context: int, batch: int) -> dict:
    engine = LLMEngine.from_pretrained(
        model,
        "bfloat16",
        device="cuda",
        max_kv_tokens=batch * (context + DECODE_STEPS + 8),
        attention_ops=ops,
    )
    g = torch.Generator().manual_seed(context)
    prompts = [torch.randint(4, 500, (context,), generator=g).tolist() for _ in range(batch)]
    params = SamplingParams(max_tokens=DECODE_STEPS + 4, ignore_eos=True)
    reqs = [engine.add_request(p, params) for p in prompts]
    prefill_s = 0.0
    while any(not r.output_ids for r in reqs):  # chunked prefill until every request has its first token
        prefill_s += _sync_time(engine.step)
    timed = [_sync_time(engine.step) for _ in range(DECODE_STEPS + 2)][2:]  # two warm-up steps
    return {
        "prefill_tokens_per_s": round(batch * context / prefill_s, 1),
        "decode_step_ms": round(1000 * sum(timed) / max(1, len(timed)), 3),
        "decode_steps_timed": len(timed),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default="bench/results/gpu.json")
    p.add_argument("--contexts", default="8192,32768")
    args = p.parse_args()
    if not torch.cuda.is_available():
        sys.exit("bench/gpu.py needs a CUDA GPU")
    torch.cuda.set_device(0)
    model = str(make_model(Path(tempfile.mkdtemp()) / "mla", "glm_moe_dsa", "mla", seed=0))
    from pdserve.model.config import ModelConfig

    facts = gather_facts(torch.device("cuda", 0), torch.bfloat16, ModelConfig.from_pretrained(model))
    rows = []
    for context in (int(c) for c in args.contexts.split(",")):
        for batch in (1, 8):
            for ops in ("torch", "flashinfer"):
                row = {"context": context, "batch": batch, "ops": ops}
                try:
                    select_attention_ops(ops, facts)
                    row.update(engine_run(model, ops, context, batch))
                except Exception as e:  # recorded, not fatal: the other rows still run
                    row["error"] = f"{type(e).__name__}: {e}"
                print(json.dumps(row), flush=True)
                rows.append(row)
    # one 32k-token hand-off of every layer's latent entries of the mla preset, bf16: 2 x 32768 x 576 x 2 bytes
    transfer = handoff(2 * 32768 * 576 * 2)
    print(json.dumps(transfer), flush=True)
    result = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "facts": facts.__dict__,
        "engine": rows,
        "handoff": transfer,
    }
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
