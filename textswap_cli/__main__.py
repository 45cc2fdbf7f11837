"""`python -m textswap_cli`: the same as the `textswap` console script."""
from textswap_cli.main import main

main()
