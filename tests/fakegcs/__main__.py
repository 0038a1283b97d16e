"""Run the fake GCS server until SIGTERM or SIGINT: `python -m tests.fakegcs --port 0 --print-url`."""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from tests.fakegcs.server import FakeGCS


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m tests.fakegcs", description=__doc__)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0 picks a free port")
    parser.add_argument("--bucket", action="append", default=[], help="create this bucket at start (repeatable)")
    parser.add_argument("--print-url", action="store_true", help="print the URL as the first line of stdout")
    parser.add_argument("--log-level", default="WARNING")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s %(message)s")

    stop = threading.Event()
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    with FakeGCS(args.host, args.port) as server:
        for bucket in args.bucket:
            server.create_bucket(bucket)
        if args.print_url:
            print(server.url, flush=True)
        stop.wait()
    return 0


if __name__ == "__main__":
    sys.exit(main())
