"""The single-rank reference engine and the per-rank compute both servers share: scheduler, model
runner, sampling (logit processing, grammars, the batched sampler) and the attention and linear
kernel choices (attn_ops, gemm_ops)."""
