"""Write the task's data: `python -m digit_retry.data --out DIR`.

Every three-digit number once, shuffled with `--seed`; the first `--heldout` are held out
(train.jsonl, heldout.jsonl). The split is the one `tandem quickstart` makes with the same
seed, so the model it warm-starts has seen none of the held-out numbers. The columns are this
task's own (`uid`, `number`, `reversed`); the `digit_task` format maps them onto a task.
"""

from __future__ import annotations

import argparse
import json
import random
from pathlib import Path


def rows(seed: int = 0, heldout: int = 100) -> tuple[list[dict], list[dict]]:
    numbers = list(range(100, 1000))
    random.Random(seed).shuffle(numbers)
    table = [{"uid": f"n{n}", "number": n, "reversed": str(n)[::-1]} for n in numbers]
    return table[heldout:], table[:heldout]


def write(path: Path, table: list[dict]) -> None:
    path.write_text("".join(json.dumps(row) + "\n" for row in table), encoding="utf-8")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m digit_retry.data", description=__doc__)
    parser.add_argument("--out", type=Path, default=Path("data"), help="folder to write into")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--heldout", type=int, default=100, help="numbers held out")
    args = parser.parse_args(argv)
    train, heldout = rows(args.seed, args.heldout)
    args.out.mkdir(parents=True, exist_ok=True)
    write(args.out / "train.jsonl", train)
    write(args.out / "heldout.jsonl", heldout)
    print(f"{len(train)} training and {len(heldout)} held-out rows in {args.out}")


if __name__ == "__main__":
    main()
