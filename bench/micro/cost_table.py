"""Print the simulator's cost model per profile: what one prefill / decode step costs.

``python -m bench.micro.cost_table`` - pure arithmetic (no server), for checking the profiles
against published measurements (see ``simulator/profiles.py`` for the derivations).
"""

from __future__ import annotations

from simulator.cost_model import CostModel
from simulator.profiles import PROFILES


def main() -> int:
    for name, prof in PROFILES.items():
        if name == "tiny-test":
            continue
        cm = CostModel(prof)
        print(f"## {name} ({prof.model_path}, TP{prof.tp}, pool {prof.max_total_num_tokens} tokens)")
        print(f"{'prefill tokens':>15} {'cached':>8} {'time ms':>9} {'tok/s':>9}")
        for n, c in ((128, 0), (1024, 0), (8192, 0), (1024, 7168), (512, 15872)):
            t = cm.prefill_time(n, c)
            print(f"{n:>15} {c:>8} {t * 1000:>9.1f} {n / t:>9.0f}")
        print(f"{'decode batch':>15} {'ctx/req':>8} {'ITL ms':>9} {'tok/s':>9}")
        for b, ctx in ((1, 1000), (16, 2000), (64, 2000), (256, 1000), (256, 4000)):
            t = cm.decode_step_time(b, b * ctx)
            print(f"{b:>15} {ctx:>8} {t * 1000:>9.1f} {b / t:>9.0f}")
        print()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
