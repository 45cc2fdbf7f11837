"""The service's command line: its options, and the config they override.

    python supervisor.py [--config FILE] [--port N] ... (supervisor.py main)
"""
from __future__ import annotations

import argparse
from typing import Any

from state.config import Config, load_config


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description="textswap: train short-text classifiers and serve them with "
                    "zero-downtime model switching.")
    p.add_argument("--config", help="YAML config file (built-in defaults when omitted)")
    p.add_argument("--host", help="inference API bind address (default 0.0.0.0)")
    p.add_argument("--port", type=int, help="inference API port (default 8080)")
    p.add_argument("--manage-host", help="management API bind address (default 127.0.0.1)")
    p.add_argument("--manage-port", type=int, help="management API port (default 8081)")
    p.add_argument("--models-dir", help="model store folder (default ./models)")
    p.add_argument("--event-loop", choices=["uvloop", "asyncio"],
                   help="the supervisor's event loop (server.event_loop; default uvloop "
                        "where it imports)")
    p.add_argument("--redis-url", help="cluster mode: the cluster store, e.g. "
                                       "redis://host:6379/0 (default: off)")
    p.add_argument("--node-id", help="cluster mode: this node's name (default hostname:port)")
    p.add_argument("--insecure-no-auth", action="store_true",
                   help="start with auth off (auth.enabled: false) although the management "
                        "API is bound beyond loopback: anyone who reaches it can drive the "
                        "service (refused without this flag)")
    p.add_argument("--log-level", type=str.upper,
                   choices=["DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL"],
                   help="log level (default INFO); debug also shows TensorFlow's C++ logs "
                        "of workers and trainers")
    p.add_argument("--log-format", choices=["text", "json"],
                   help="log records as text lines (default) or one JSON object a line "
                        "on stdout, for log collectors")
    return p.parse_args(argv)


def build_config(args: argparse.Namespace) -> Config:
    server = {k: v for k, v in (("host", args.host), ("port", args.port),
                                ("manage_host", args.manage_host),
                                ("manage_port", args.manage_port),
                                ("event_loop", getattr(args, "event_loop", None)))
              if v is not None}
    overrides: dict[str, Any] = {"server": server} if server else {}
    if args.models_dir:
        overrides["models_dir"] = args.models_dir
    cluster = {k: v for k, v in (("redis_url", args.redis_url), ("node_id", args.node_id))
               if v is not None}
    if cluster:
        overrides["cluster"] = cluster
    if getattr(args, "log_level", None):
        overrides["log_level"] = args.log_level
    if getattr(args, "log_format", None):
        overrides["log_format"] = args.log_format
    return load_config(args.config, overrides)
