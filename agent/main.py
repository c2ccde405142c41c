"""Entry point of ``bulkhead-agent``: the node agent DaemonSet process."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

from pydantic import ValidationError


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        prog="bulkhead-agent",
        description="Watch this node's GPUs, host and training workers; report anomalies.",
    )
    parser.add_argument(
        "--config", type=Path, help="YAML settings file (or $BULKHEAD_AGENT_CONFIG)"
    )
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    from bulkhead.agent.service import serve
    from bulkhead.agent.settings import load_settings

    try:
        settings = load_settings(args.config)
    except (ValidationError, FileNotFoundError) as exc:
        print(f"bulkhead-agent: invalid configuration:\n{exc}", file=sys.stderr)
        raise SystemExit(2) from exc
    from bulkhead.agent.reporters.kube import NotThisNode

    try:
        serve(settings)
    except NotThisNode as exc:
        print(f"bulkhead-agent: {exc}", file=sys.stderr)
        raise SystemExit(2) from exc


if __name__ == "__main__":
    main()
