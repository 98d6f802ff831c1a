"""Checkpoint tooling outside the model: the built-in tiny presets, the BPE tokenizer builder and the
random (seeded) checkpoints the tests, benches and `pdserve up` use."""
