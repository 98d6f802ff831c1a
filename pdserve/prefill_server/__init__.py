"""Prefill instance: context-parallel layouts, CP attention backend, prefill scheduler."""
