"""pdserve: disaggregated prefill/decode serving for long-context MLA models."""
