"""The native CPU kernels (rows.c, moe.c, attend.c): built with the machine's C compiler at first use
(lib.py) and called through ctypes (ops.py)."""
