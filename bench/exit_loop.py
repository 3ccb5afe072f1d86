"""Launch a training script under torchrun many times; count the launches that do not exit 0.

    .venv/bin/python bench/exit_loop.py --runs 100 --strategy ddp
    .venv/bin/python bench/exit_loop.py --runs 100 --strategy fsdp
    .venv/bin/python bench/exit_loop.py --runs 20 --script tests/train_then_exit.py

Each launch is ``python -m torch.distributed.run --standalone --nproc-per-node 2 SCRIPT --epochs 1
--strategy S`` (SCRIPT: ``examples/train_distributed.py`` unless ``--script`` names another that
takes those options; more arguments for it go after ``--``), with a wall-clock limit per launch
(the whole launch is killed past it). A launch passes when torchrun exits 0; a failed one is
reported with the signal or exit code of the rank torchrun names as the root cause, and whether
stderr holds "terminate called" (gloo's abort at exit). The last failure's stderr tail is printed.
Exits 1 when any launch failed.
"""

from __future__ import annotations

import argparse
import collections
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
EXAMPLE = ROOT / "examples" / "train_distributed.py"
_LAUNCH_ENV = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")


def _cause(returncode: int | None, stderr: str) -> str:
    """A short label for a failed launch: the signal or exit code of the root-cause rank."""
    note = " (terminate called)" if "terminate called" in stderr else ""
    if returncode is None:
        return "timeout" + note
    root = stderr[stderr.find("Root Cause"):] if "Root Cause" in stderr else stderr
    died = re.search(r"Signal \d+ \((SIG\w+)\)", root)
    if died:
        return died.group(1) + note
    code = re.search(r"exitcode\s*:\s*(-?\d+)", root)
    if code:
        return f"rank exitcode {code.group(1)}{note}"
    return f"torchrun exit {returncode}{note}"


def run_once(script: Path, strategy: str, extra: list[str],
             limit: float) -> tuple[int | None, str]:
    """One torchrun launch: ``(exit code, or None past the limit; stderr)``."""
    env = {k: v for k, v in os.environ.items() if k not in _LAUNCH_ENV}
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node",
           "2", str(script), "--epochs", "1", "--strategy", strategy, *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        _, stderr = proc.communicate(timeout=limit)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)  # torchrun and its ranks
        _, stderr = proc.communicate()
        return None, stderr
    return proc.returncode, stderr


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=30)
    p.add_argument("--strategy", default="ddp", choices=["ddp", "fsdp"])
    p.add_argument("--script", type=Path, default=EXAMPLE)
    p.add_argument("--limit", type=float, default=120.0, help="seconds per launch")
    p.add_argument("extra", nargs="*", help="more arguments for the script (after --)")
    args = p.parse_args(argv)
    if args.runs < 1:
        p.error(f"--runs must be >= 1; got {args.runs}")
    if not args.script.is_file():
        p.error(f"--script {str(args.script)!r} is not a file")
    causes: collections.Counter = collections.Counter()
    last_failure = ""
    start = time.monotonic()
    for i in range(1, args.runs + 1):
        code, stderr = run_once(args.script, args.strategy, args.extra, args.limit)
        if code != 0:
            cause = _cause(code, stderr)
            causes[cause] += 1
            last_failure = stderr
            print(f"run {i}: FAILED ({cause})", flush=True)
        elif i % 10 == 0:
            print(f"run {i}: ok", flush=True)
    failed = sum(causes.values())
    print(f"{args.script.name} {args.strategy}: {args.runs - failed}/{args.runs} exited 0 "
          f"({time.monotonic() - start:.0f} s)" + (f"; failures: {dict(causes)}" if failed else ""))
    if last_failure:
        print("--- stderr of the last failed launch (tail) ---\n" + last_failure[-2000:])
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
