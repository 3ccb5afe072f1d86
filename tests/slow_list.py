"""Write tests/slow_tests.txt from a ``pytest --durations=0`` report (``make slow-list``): every
test whose setup, call and teardown took >= ``--min`` seconds together.

    python tests/slow_list.py DURATIONS.txt [--min 0.3] > tests/slow_tests.txt
"""

from __future__ import annotations

import argparse
import collections
import re

LINE = re.compile(r"^(\d+(?:\.\d+)?)s (?:setup|call|teardown)\s+(\S.*)$")
HEADER = """\
# Tests `make test` leaves out (marked `slow` by tests/conftest.py, run by `make test-all`): each
# took >= {min} s on the 2-core AMD EPYC VM (torch 2.13.0+cpu), measured with `pytest --durations=0`
# over the whole suite. Regenerate: `make slow-list` (writes this file from a durations run).
# seconds  test id
"""


def slow_tests(report: str, minimum: float) -> list[tuple[float, str]]:
    seconds: collections.Counter = collections.Counter()
    for line in report.splitlines():
        match = LINE.match(line.strip())
        if match:
            seconds[match.group(2).strip()] += float(match.group(1))
    return sorted(((s, t) for t, s in seconds.items() if s >= minimum), reverse=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("report")
    p.add_argument("--min", type=float, default=0.3)
    args = p.parse_args()
    with open(args.report) as f:
        rows = slow_tests(f.read(), args.min)
    print(HEADER.format(min=args.min), end="")
    for s, t in rows:
        print(f"{s:7.2f}  {t}")


if __name__ == "__main__":
    main()
