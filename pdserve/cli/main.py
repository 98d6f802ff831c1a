"""The `pdserve` command line. One entry point, one subcommand per process role or tool:
make-model and generate here, prefill and decode in servers.py, router and up in stack.py,
admin in admin.py; the shared app and helpers in common.py."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Optional

import typer

from ..choices import Arch, Quantize, Size
from ..choices import ModelDType as DType
from ..flags import DTYPE_HELP
from .admin import admin_app
from .common import AttentionOpsOpt, DeviceOpt, GpuIdsOpt, app, device_args, ensure_builtin_model, fail


@app.command("make-model")
def make_model_cmd(
    out_dir: Path = typer.Argument(
        ..., help="Directory to write the checkpoint into (must be empty or absent)."
    ),
    arch: Arch = typer.Option(Arch.glm_moe_dsa, help="Architecture (Hugging Face model_type)."),
    size: Size = typer.Option(
        Size.tiny,
        help="tiny: for tests (seconds); small: for benchmarks (tens of millions of parameters); mla: the released MLA dims (kv_lora_rank 512, rope 64, top-k 2048) in 2 layers, for the GPU kernel checks.",
    ),
    seed: int = typer.Option(0, help="Random seed; the same seed writes byte-identical files."),
    max_shard_mb: Optional[float] = typer.Option(
        None,
        help="Split the weights into shards of at most this many MiB (with model.safetensors.index.json).",
    ),
    overwrite: bool = typer.Option(False, help="Replace OUT_DIR if it already holds files."),
    quantize: Optional[Quantize] = typer.Option(
        None,
        help="fp8: the released FP8 layout (e4m3 projection weights with a float32 weight_scale_inv per 128 x 128 block; norms, embeddings, LM head, router and indexer weights_proj unquantized).",
    ),
    check_config: bool = typer.Option(
        False, "--check-config", help="Validate the arguments, print them as JSON, and exit without writing."
    ),
):
    """Write a deterministic random checkpoint in the Hugging Face layout (transformers loads it too)."""
    shard = int(max_shard_mb * 2**20) if max_shard_mb else None
    if check_config:
        if shard is not None and shard <= 0:
            fail(f"--max-shard-mb must be positive, got {max_shard_mb}")
        if out_dir.exists() and (not out_dir.is_dir() or any(out_dir.iterdir())) and not overwrite:
            fail(f"{out_dir} already holds files (give --overwrite to replace them)")
        typer.echo(
            json.dumps(
                {
                    "out_dir": str(out_dir),
                    "arch": arch.value,
                    "size": size.value,
                    "seed": seed,
                    "max_shard_bytes": shard,
                    "overwrite": overwrite,
                    "quantize": quantize.value if quantize else None,
                }
            )
        )
        return
    from ..checkpoints.random_checkpoint import make_model

    try:
        path = make_model(
            out_dir,
            arch.value,
            size.value,
            seed=seed,
            max_shard_bytes=shard,
            overwrite=overwrite,
            quantize=quantize.value if quantize else None,
        )
    except (ValueError, FileExistsError) as e:
        fail(str(e))
    typer.echo(str(path))


def _parse_token_ids(text: str) -> list[int]:
    try:
        return [int(t) for t in text.replace(" ", "").split(",") if t]
    except ValueError:
        fail(f"--token-ids must be comma-separated integers, got {text!r}")


@app.command()
def generate(
    model: Optional[Path] = typer.Option(
        None, help="Checkpoint directory. Default: the built-in small model (built on first use)."
    ),
    prompt: Optional[str] = typer.Option(
        None, help="Prompt text (tokenized with the checkpoint's tokenizer)."
    ),
    token_ids: Optional[str] = typer.Option(
        None, help="Prompt as comma-separated token ids, e.g. 1,2,3 (instead of --prompt)."
    ),
    chat: bool = typer.Option(
        False, help="Wrap --prompt as a user message with the checkpoint's chat template."
    ),
    max_new_tokens: int = typer.Option(32, min=1, help="Number of tokens to generate at most."),
    temperature: float = typer.Option(0.0, min=0.0, help="Sampling temperature; 0 means greedy."),
    top_p: float = typer.Option(
        1.0,
        min=0.0,
        max=1.0,
        help="Nucleus sampling: keep the smallest set of tokens with this much probability.",
    ),
    top_k: int = typer.Option(0, min=0, help="Keep only the k most likely tokens; 0 disables."),
    seed: Optional[int] = typer.Option(None, help="Seed for sampling (ignored when greedy)."),
    dtype: Optional[DType] = typer.Option(None, help=DTYPE_HELP),
    device: DeviceOpt = "cpu",
    gpu_ids: GpuIdsOpt = None,
    attention_ops: AttentionOpsOpt = "auto",
    threads: int = typer.Option(0, min=0, help="torch threads; 0 means one per CPU core."),
    ignore_eos: bool = typer.Option(False, help="Keep generating past the end-of-sequence token."),
    as_json: bool = typer.Option(
        False,
        "--json",
        help='Print one JSON object {"token_ids": [...], "text": "..."} (generated tokens only).',
    ),
):
    """Run the single-rank engine on one prompt and print the generated text."""
    from ..request import SamplingParams

    if (prompt is None) == (token_ids is None):  # the arguments first: an error does not wait for torch
        fail("give exactly one of --prompt or --token-ids")
    ids = _parse_token_ids(token_ids) if token_ids is not None else None
    try:
        params = SamplingParams(
            max_tokens=max_new_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            seed=seed,
            ignore_eos=ignore_eos,
        )
    except ValueError as e:
        fail(str(e))

    import torch

    from ..engine.llm_engine import LLMEngine
    from ..model.tokenizer import Tokenizer
    from ..runtime.device import check_devices, default_dtype

    dev = device_args(device, gpu_ids)
    try:
        plan = check_devices(dev["device"], 1, dev["gpu_ids"])  # one rank: --gpu-ids names one GPU
    except ValueError as e:
        fail(str(e))
    torch_device = torch.device("cuda", plan.gpus[0]) if plan.device == "cuda" else torch.device("cpu")
    if plan.device == "cuda":
        torch.cuda.set_device(torch_device)
    torch.set_num_threads(threads or os.cpu_count() or 1)
    model_dir = model or ensure_builtin_model()
    if not (model_dir / "config.json").is_file():
        fail(f"{model_dir} is not a checkpoint directory (no config.json)")
    tok = Tokenizer.from_pretrained(model_dir)
    if prompt is not None:
        text = tok.apply_chat_template([{"role": "user", "content": prompt}]) if chat else prompt
        ids = tok.encode(text)
    if not ids:
        fail("the prompt is empty")
    try:
        engine = LLMEngine.from_pretrained(
            model_dir,
            dtype.value if dtype else default_dtype(plan.device),
            device=torch_device,
            max_kv_tokens=len(ids) + max_new_tokens,
            attention_ops=attention_ops.value,
            announce="generate",
        )
        out = engine.generate([ids], params)[0]
    except ValueError as e:
        fail(str(e))
    text_out = tok.decode(out)
    if as_json:
        typer.echo(json.dumps({"token_ids": out, "text": text_out}))
    else:
        typer.echo(text_out)


# registered after make-model and generate: the order of `pdserve --help` and docs/flags.md
from . import servers, stack  # noqa: E402, F401

app.add_typer(admin_app, name="admin")


def main() -> None:
    import logging

    # server logs: errors with their id (serving/http_edge.py) and any traceback go to stderr
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    app()


if __name__ == "__main__":
    main()
