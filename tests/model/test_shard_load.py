"""Shard-only loading (issue 39 item 1, model/shard.py): a rank that builds only its slices on the meta
device and reads only them from the safetensors files holds exactly what a full load sliced
afterwards holds (bf16/float32 and fp8 checkpoints, decode TP with DCP and a replicated q
projection, prefill --moe-tp, --moe-ep's whole experts by id); fp8 weights kept fp8 are the checkpoint's bytes of the rank's slice
and its block scales, and multiply to the dequantized model's results exactly in float64; a rank's
peak memory while loading is its share, not the model."""

from __future__ import annotations

import shutil
import subprocess
import sys
from functools import partial

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from pdserve.checkpoints.random_checkpoint import make_model
from pdserve.decode_server.tp import shard_decode_model
from pdserve.engine.llm_engine import LLMEngine
from pdserve.model.layers import Experts, Linear
from pdserve.model.quant import dequantize_fp8
from pdserve.model.shard import EXPERT_KEY, weight_bytes_by_dtype
from pdserve.model.weights import load_model
from pdserve.prefill_server.moe_tp import shard_moe_tp, shard_prefill_ffn
from tests.conftest import ARCHS
from tests.model.test_load_memory import peak_script

FP8 = torch.float8_e4m3fn
# per-rank MLP and expert slices of 128 rows at W=2 (kept fp8), 64 at W=4 (dequantized); the head
# slices (q_b 48 rows, o_proj 32 columns at W=2) fall inside a block: dequantized
ALIGNED = {"intermediate_size": 256, "moe_intermediate_size": 256}


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory):
    root = tmp_path_factory.mktemp("shard")
    out = {}
    for arch in ARCHS:
        out[(arch, None)] = make_model(root / arch, arch, "tiny", seed=5, config_overrides=ALIGNED)
        out[(arch, "fp8")] = make_model(
            root / f"{arch}-fp8", arch, "tiny", seed=5, quantize="fp8", config_overrides=ALIGNED
        )
    return out


def dequantized_state(model) -> dict[str, torch.Tensor]:
    """Every weight in float64, fp8 ones times their block scales (experts per expert)."""
    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Linear) and module.weight.dtype == FP8:
            out[name + ".weight"] = dequantize_fp8(
                module.weight, module.weight_scale_inv, module.block, torch.float64
            )
        elif isinstance(module, Experts) and module.gate_up_proj.dtype == FP8:
            for attr, scale in (
                ("gate_up_proj", module.gate_up_scale_inv),
                ("down_proj", module.down_scale_inv),
            ):
                w = getattr(module, attr)
                out[f"{name}.{attr}"] = torch.stack(
                    [dequantize_fp8(w[e], scale[e], module.block, torch.float64) for e in range(w.shape[0])]
                )
    for name, p in model.named_parameters():
        out.setdefault(name, p.double())
    return out


DECODE = [(2, 1, False), (2, 2, True), (4, 2, False), (4, 4, True)]


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_decode_rank_holds_the_slices_of_a_full_load(checkpoints, arch, quant):
    path = checkpoints[(arch, quant)]
    for world, dcp, replicate in DECODE:
        for rank in range(world):
            full = load_model(path, torch.float64)
            shard_decode_model(full, rank, world, dcp, replicate)
            shard = partial(shard_decode_model, rank=rank, world=world, dcp=dcp, replicate_q=replicate)
            part = load_model(path, torch.float64, shard=shard)
            want = dict(full.named_parameters())
            got = dict(part.named_parameters())
            assert got.keys() == want.keys()
            for name, w in want.items():
                assert torch.equal(got[name], w), (world, rank, name)
            kept = load_model(path, torch.float64, shard=shard, keep_fp8=True)
            got8 = dequantized_state(kept)
            for name, w in want.items():
                assert torch.equal(got8[name], w), (world, rank, name, "fp8 kept")
            fp8_bytes = weight_bytes_by_dtype(kept).get("float8_e4m3fn", 0)
            if quant is None:
                assert fp8_bytes == 0
            elif world == 2:  # the MLP and expert slices are 128-row aligned: they stay fp8
                assert kept.model.layers[-1].mlp.experts.gate_up_proj.dtype == FP8
                assert fp8_bytes > 0


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_rank_bytes_are_the_checkpoint_bytes_of_its_slices(checkpoints, arch):
    """Each kept fp8 Linear holds the checkpoint's bytes of its slice and the scale rows of its blocks;
    the rank's float8 bytes are exactly those slices' bytes (experts included)."""
    path = checkpoints[(arch, "fp8")]
    for rank in range(2):
        model = load_model(
            path,
            torch.float32,
            shard=partial(shard_decode_model, rank=rank, world=2, dcp=1, replicate_q=False),
            keep_fp8=True,
        )
        expect = 0
        with safe_open(str(path / "model.safetensors"), "pt") as f:
            for name, module in model.named_modules():
                if isinstance(module, Linear) and module.weight.dtype == FP8:
                    q = f.get_tensor(name + ".weight")
                    s = f.get_tensor(name + ".weight_scale_inv")
                    cut = module.cut
                    if cut is not None:
                        q = q[cut.index(2)]
                        s = s[cut.blocks(128).index(2)]
                    assert torch.equal(module.weight.view(torch.uint8), q.view(torch.uint8)), name
                    assert torch.equal(module.weight_scale_inv, s), name
                    expect += q.numel()
                elif isinstance(module, Experts) and module.gate_up_proj.dtype == FP8:
                    span = slice(module.cut.start, module.cut.stop)
                    for e in range(module.n_routed):
                        gate = f.get_tensor(f"{name}.{e}.gate_proj.weight")[span]
                        up = f.get_tensor(f"{name}.{e}.up_proj.weight")[span]
                        down = f.get_tensor(f"{name}.{e}.down_proj.weight")[:, span]
                        assert torch.equal(
                            module.gate_up_proj[e].view(torch.uint8), torch.cat([gate, up]).view(torch.uint8)
                        )
                        assert torch.equal(module.down_proj[e].view(torch.uint8), down.view(torch.uint8))
                        expect += gate.numel() + up.numel() + down.numel()
        assert expect > 0
        assert weight_bytes_by_dtype(model)["float8_e4m3fn"] == expect


@pytest.mark.parametrize("arch", ARCHS)
def test_prefill_moe_tp_rank_holds_the_slices_of_a_full_load(checkpoints, arch):
    path = checkpoints[(arch, "fp8")]
    for rank in range(2):
        full = load_model(path, torch.float64)
        shard_moe_tp(full, rank, 2)
        part = load_model(path, torch.float64, shard=partial(shard_moe_tp, rank=rank, world=2))
        got = dict(part.named_parameters())
        for name, w in full.named_parameters():
            assert torch.equal(got[name], w), name


@pytest.mark.parametrize("quant", [None, "fp8"])
@pytest.mark.parametrize("arch", ARCHS)
def test_moe_ep_rank_holds_its_whole_experts_of_a_full_load(checkpoints, arch, quant):
    """--moe-ep (decode W = 2 and 4, prefill C_p = 2 with and without --moe-tp): a rank allocates and
    reads only its E/W experts, whole; they equal the full load's expert slices, fp8 kept bit for bit
    with their scales (a whole expert is block-aligned), the rest as the TP / replicated cuts say."""
    path = checkpoints[(arch, quant)]
    full = load_model(path, torch.float64)
    shards = [
        (w, partial(shard_decode_model, world=w, dcp=1, replicate_q=False, moe_ep=True)) for w in (2, 4)
    ]
    shards += [(2, partial(shard_prefill_ffn, world=2, moe_tp=tp, moe_ep=True)) for tp in (False, True)]
    for world, shard in shards:
        for rank in range(world):
            want = load_model(path, torch.float64)
            shard(want, rank=rank)  # the same cuts applied to a whole model
            part = load_model(path, torch.float64, shard=partial(shard, rank=rank))
            got = dict(part.named_parameters())
            assert got.keys() == dict(want.named_parameters()).keys()
            for name, w in want.named_parameters():
                assert torch.equal(got[name], w), (world, rank, name)
            for layer, whole in zip(part.model.layers, full.model.layers):
                ex = layer.mlp.experts if hasattr(layer.mlp, "experts") else None
                if ex is None:
                    continue
                per = whole.mlp.experts.n_routed // world
                assert (ex.first_expert, ex.n_routed) == (rank * per, per)
                ids = slice(rank * per, (rank + 1) * per)
                assert torch.equal(ex.gate_up_proj, whole.mlp.experts.gate_up_proj[ids])
                assert torch.equal(ex.down_proj, whole.mlp.experts.down_proj[ids])
            if quant == "fp8":
                kept = load_model(path, torch.float64, shard=partial(shard, rank=rank), keep_fp8=True)
                ex = kept.model.layers[-1].mlp.experts
                assert ex.gate_up_proj.dtype == FP8 and ex.gate_up_proj.shape[0] == per
                got8 = dequantized_state(kept)
                for name, w in want.named_parameters():
                    assert torch.equal(got8[name], w), (world, rank, name, "fp8 kept")


def stacked_checkpoint(src, out):
    """src's checkpoint with every layer's experts in transformers' stacked in-memory layout
    (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), which some versions save."""
    out.mkdir()
    for f in src.iterdir():
        if f.suffix != ".safetensors":
            shutil.copy(f, out / f.name)
    state = load_file(str(src / "model.safetensors"))
    parts: dict[str, dict[int, dict[str, torch.Tensor]]] = {}
    for key in list(state):
        m = EXPERT_KEY.match(key)
        if m:
            parts.setdefault(m.group(1), {}).setdefault(int(m.group(2)), {})[m.group(3)] = state.pop(key)
    for prefix, experts in parts.items():
        ids = sorted(experts)
        state[prefix + ".gate_up_proj"] = torch.stack(
            [torch.cat([experts[e]["gate_proj"], experts[e]["up_proj"]]) for e in ids]
        )
        state[prefix + ".down_proj"] = torch.stack([experts[e]["down_proj"] for e in ids])
    save_file(state, str(out / "model.safetensors"))
    return out


def test_moe_ep_reads_its_experts_of_the_stacked_layout(checkpoints, tmp_path):
    """A checkpoint with stacked experts: an EP rank reads its experts' rows of each stack, and holds
    what the full load of the per-expert checkpoint holds for them."""
    path = checkpoints[("glm_moe_dsa", None)]
    stacked = stacked_checkpoint(path, tmp_path / "stacked")
    for rank in range(2):
        shard = partial(shard_decode_model, rank=rank, world=2, dcp=1, replicate_q=False, moe_ep=True)
        want = load_model(path, torch.float64)
        shard(want)
        got = dict(load_model(stacked, torch.float64, shard=shard).named_parameters())
        assert got["model.layers.1.mlp.experts.gate_up_proj"].shape[0] == 4
        for name, w in want.named_parameters():
            assert torch.equal(got[name], w), (rank, name)


@pytest.mark.parametrize("arch", ARCHS)
def test_fp8_kept_on_cpu_equals_the_dequantized_model_in_float64(checkpoints, arch):
    """The torch path multiplies kept fp8 weights dequantized 128 rows at a time: the same logits,
    bit for bit, as the model whose weights were dequantized at load."""
    path = checkpoints[(arch, "fp8")]
    kept = load_model(path, torch.float64, float32_islands=False, keep_fp8=True)
    plain = load_model(path, torch.float64, float32_islands=False)
    assert kept.model.layers[-1].mlp.experts.gate_up_proj.dtype == FP8
    assert plain.model.layers[-1].mlp.experts.gate_up_proj.dtype == torch.float64
    ids = torch.randint(4, 500, (13,), generator=torch.Generator().manual_seed(2)).tolist()
    got, want = (LLMEngine(m, max_kv_tokens=64).prefill_logits(ids) for m in (kept, plain))
    assert (got - want).abs().max().item() <= 1e-12, (got - want).abs().max().item()


PEAK = peak_script(
    # what a rank's forkserver imported before the rank started: modules that load during the
    # measure are no weights (sympy, which loading used to import, is tens of MB)
    "import importlib\n"
    "from pdserve.runtime.rank_process import _PRELOAD\n"
    "for module in _PRELOAD: importlib.import_module(module)\n"
    "from pdserve.decode_server.tp import shard_decode_model\n"
    "from pdserve.model.shard import weight_bytes_by_dtype\n"
    "from pdserve.model.weights import rank_model\n"
    "shard = lambda m: shard_decode_model(m, {rank}, 4, 1, False)\n"
    'share_kb = sum(weight_bytes_by_dtype(rank_model(r"{path}", torch.float32, shard=shard)).values()) // 1024',
    'model = load_model(r"{path}", torch.float32, shard=shard)',
    "print(share_kb, sum(weight_bytes_by_dtype(model).values()) // 1024, peak_kb)",
)


def test_each_rank_of_a_w4_decode_instance_peaks_at_its_share(tmp_path):
    """Peak anonymous memory (/proc/self/status) of each of 4 decode ranks while loading stays under
    its share of the checkpoint plus one tensor plus a fixed slack, far under the whole model."""
    path = make_model(tmp_path / "small", "glm_moe_dsa", "small", seed=0, max_shard_bytes=32 << 20)
    ckpt_kb = sum(p.stat().st_size for p in path.glob("*.safetensors")) // 1024
    largest_kb = 0
    for file in path.glob("*.safetensors"):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():
                part = f.get_slice(key)
                largest_kb = max(largest_kb, torch.Size(part.get_shape()).numel() * 4 // 1024)
    ranks = [  # at once, as an instance's ranks load (each measures its own peak)
        subprocess.Popen(
            [sys.executable, "-c", PEAK.format(path=path, rank=rank)],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for rank in range(4)
    ]
    for rank, proc in enumerate(ranks):
        out, err = proc.communicate(timeout=300)
        assert proc.returncode == 0, err
        share_kb, held_kb, peak_kb = map(int, out.split())
        assert share_kb == held_kb  # the meta plan is what the rank allocates
        # the replicated part (embeddings, LM head, norms, kv_a, the indexer, the router) is on every rank
        assert held_kb < ckpt_kb / 2, (held_kb, ckpt_kb)
        assert peak_kb < held_kb + largest_kb + 16 * 1024, (rank, peak_kb, held_kb, largest_kb)
