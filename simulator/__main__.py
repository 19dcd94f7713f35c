"""``python -m simulator serve ...`` (one worker) or ``python -m simulator sim ...`` (a fleet)."""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "serve":
        from .server import main as serve_main

        return serve_main(argv[1:])
    if argv and argv[0] == "sim":
        argv = argv[1:]
    from .cli import main as cli_main

    return cli_main(argv)


if __name__ == "__main__":
    sys.exit(main())
