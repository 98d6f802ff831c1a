"""Model definition: config, weights, tokenizer, attention math. Imports torch only; knows nothing about serving."""
