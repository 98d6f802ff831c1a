"""Decode instance: DCP slot mapping, DCP attention backend and LSE merge, decode scheduler."""
