"""``python -m engine_patches.run_server [sglang args]``: patch, then run sglang.launch_server.

SGLang starts its scheduler processes with multiprocessing's *spawn* method, so a
monkeypatch made only in the launching process would be lost where it matters (the
scheduler owns the HiCache controller and the KV event publisher). Spawn re-imports the
parent's ``__main__`` module by name in every child; the patches are therefore applied at
import time of this module, and SGLang's own ``launch_server`` runs with ``alter_sys=False``
so that this module stays ``__main__``. SGLang >= 0.5.2x also loads the same patch through
its ``sglang.srt.plugins`` entry point when kvgate is pip-installed; ``install`` is idempotent.
"""

from __future__ import annotations

import runpy
import sys

from engine_patches import cpu_engine, l3_events

if cpu_engine.enabled():
    cpu_engine.install()
l3_events.install()


def main() -> None:
    sys.argv[0] = "sglang.launch_server"
    runpy.run_module("sglang.launch_server", run_name="__main__", alter_sys=False)


if __name__ == "__main__":
    main()
