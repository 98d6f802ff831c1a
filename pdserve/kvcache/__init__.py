"""KV storage: the pool tensors, the page allocator, the prefix (radix) cache, and the capacity and
fit rules (torch-free except kv_cache.py and huge_pages.py: the router imports kv_fit)."""
