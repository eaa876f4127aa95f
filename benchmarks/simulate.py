"""``python -m benchmarks.simulate``: refresh the committed simulator results in ``benchmarks/results/``.

The model itself is :mod:`fgdiloco.pretrain.simulate` (also ``fgdiloco simulate``, which writes to a fresh folder
under ``runs/`` instead); this module re-exports it, so ``from benchmarks.simulate import predict`` keeps working.
"""

from __future__ import annotations

import argparse

from fgdiloco.pretrain.simulate import *  # noqa: F403 - the model, re-exported
from fgdiloco.pretrain.simulate import RESULTS, add_arguments, print_report, run


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0], allow_abbrev=False)
    add_arguments(ap, default_out=str(RESULTS))
    args = ap.parse_args(argv)
    print_report(run(args))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
