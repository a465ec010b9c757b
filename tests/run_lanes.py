"""Run test lanes one after another, each in its own pytest, and print each lane's result and time.

    python tests/run_lanes.py [--shard i/K] LANE [LANE ...] [-- PYTEST_ARGS]

`make test` runs unit, control, worlds and jobs with the rotating shard of extended tests;
`make test-fast` runs unit and control. Every lane runs even when an earlier one fails; the exit
status is 1 when any lane failed. The lanes are described in tests/README.md and tests/lanes.py.
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import time
from pathlib import Path

TESTS = Path(__file__).resolve().parent
sys.path.insert(0, str(TESTS))

from lanes import LANES  # noqa: E402  (tests/ is not a package)


def main(argv: list[str]) -> int:
    if "--" in argv:
        cut = argv.index("--")
        argv, extra = argv[:cut], argv[cut + 1 :]
    else:
        extra = []
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shard", default=None, metavar="i/K", help="also run this shard of the extended tests")
    parser.add_argument("--all-extended", action="store_true", help="run every extended test of the lanes")
    parser.add_argument("lanes", nargs="+", choices=sorted(LANES))
    args = parser.parse_args(argv)

    if args.all_extended:
        marks = "not chaos"
    elif args.shard:
        marks = "not chaos and not full_matrix and (not extended or in_shard)"
    else:
        marks = "not chaos and not extended and not full_matrix"
    results: list[tuple[str, int, float]] = []
    for lane in args.lanes:
        cmd = [sys.executable, "-m", "pytest", "-q", str(TESTS / lane), "-m", marks, "--durations=15"]
        if args.shard and not args.all_extended:
            cmd.append(f"--extended-shard={args.shard}")
        cmd += extra
        print(f"\n=== lane {lane}: {LANES[lane][0]} (cap {LANES[lane][1]} s a test)", flush=True)
        print("    " + " ".join(cmd), flush=True)
        start = time.monotonic()
        rc = subprocess.call(cmd)
        results.append((lane, rc, time.monotonic() - start))

    print("\n=== lanes", flush=True)
    for lane, rc, seconds in results:
        verdict = "passed" if rc == 0 else ("no tests" if rc == 5 else f"FAILED (rc {rc})")
        print(f"    {lane:<8} {verdict:<16} {seconds / 60:6.1f} min", flush=True)
    print(f"    {'total':<8} {'':<16} {sum(s for _, _, s in results) / 60:6.1f} min", flush=True)
    return 0 if all(rc in (0, 5) for _, rc, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
