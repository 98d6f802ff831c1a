"""`python -m pdserve.cli ...`: the same as the `pdserve` command."""

from .main import main

main()
