"""Loading never holds two copies of the weights: peak anonymous memory during load_model stays
within 1.2x of one copy of the parameters (file pages mapped by safetensors are page cache, not
counted). An FP8 checkpoint is dequantized tensor by tensor as it is read, so it stays within 1.3x,
and prints its progress per shard."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

# Runs `load` (a statement that sets `model`) in a fresh process while a thread samples RssAnon;
# `peak_kb` is the growth over the process's memory before it (file pages are not counted).
PEAK_SCRIPT = textwrap.dedent(
    """
    import threading, time, torch
    from pdserve.model.weights import load_model

    def anon_kb():
        for line in open("/proc/self/status"):
            if line.startswith("RssAnon:"):
                return int(line.split()[1])

    {setup}
    torch.zeros(1)
    base, peak, stop = anon_kb(), [0], threading.Event()

    def sample():
        while not stop.is_set():
            peak[0] = max(peak[0], anon_kb())
            time.sleep(0.0005)

    t = threading.Thread(target=sample)
    t.start()
    {load}
    stop.set(); t.join()
    peak_kb = peak[0] - base
    {report}
    """
)


def peak_script(setup: str, load: str, report: str) -> str:
    return PEAK_SCRIPT.format(setup=setup, load=load, report=report)


SCRIPT = peak_script(
    "from pdserve.checkpoints.random_checkpoint import make_model\n"
    'path = make_model(r"{out}", "glm_moe_dsa", "small", seed=0, max_shard_bytes={shard}, quantize={quantize!r})',
    "messages = []; model = load_model(path, progress=messages.append)",
    "weights_kb = sum(p.numel() * p.element_size() for p in model.parameters()) // 1024\n"
    'print(weights_kb, peak_kb, len(messages), len(list(path.glob("model-*.safetensors"))))',
)


# 1.2: a fresh-clone run under two xdist workers measured 1.150007 once (176,372 kB of weights):
# the allocator's and the sampling thread's overhead is not all proportional; two copies would be 2.0
@pytest.mark.parametrize("quantize,shard,bound", [(None, 64 << 20, 1.2), ("fp8", 16 << 20, 1.3)])
def test_peak_memory_while_loading_is_one_copy_of_the_weights(tmp_path, quantize, shard, bound):
    script = SCRIPT.format(out=tmp_path / "small", shard=shard, quantize=quantize)
    proc = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    weights_kb, peak_growth_kb, n_messages, n_shards = map(int, proc.stdout.split())
    assert weights_kb > 100_000  # ~45M float32 parameters
    assert n_shards > 1 and n_messages == n_shards  # one progress line per shard
    # one copy of the weights plus at most one tensor in flight (the largest is ~8 MB) and slack
    assert peak_growth_kb < weights_kb * bound, (weights_kb, peak_growth_kb)
