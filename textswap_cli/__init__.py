"""textswap command line: train, apply, inspect and query a textswap service over HTTP.

Installed as the console script `textswap` (pyproject.toml). Talks only
HTTP, so it works against a remote service too; imports nothing of the
service itself.
"""
