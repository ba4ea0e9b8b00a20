"""A live application trained online (examples/online.yaml, docs/explorer.md#online).

A scripted "user" asks the quickstart's question (reverse the digits: `rev 472=`) through the
official `openai` client pointed at the explorer's endpoint, and judges the answer with its own
feedback rule: the share of digits in their right place, 1 when the answer is the number
reversed. Each question is asked `--group-size` times (one episode each, grouped by the
question's key); each episode is opened before its call and rewarded after the answer is
judged. Nothing here is tandem's code beyond the two episode calls.

    .venv/bin/tandem up examples/online.yaml &
    .venv/bin/python examples/online_app.py --url-file runs/online/openai/explorer-0.url \\
        --data examples/data/reversal-train.jsonl --group-size 8

It runs until the endpoint goes away (the run ended) or `--seconds`; each round's mean reward
and accuracy (answers exactly right) go to `--log` as a JSON line.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from pathlib import Path
from typing import Any

import openai


async def open_episode(client: openai.AsyncOpenAI, group: str) -> str:
    """A new episode in `group`; its id is the API key its calls carry."""
    episode = await client.post("/episodes", body={"group": group}, cast_to=object)
    return episode["id"]


async def attach_reward(client: openai.AsyncOpenAI, episode: str, reward: float,
                        **components: float) -> dict[str, Any]:
    """Close `episode` with its reward (and named components)."""
    body: dict[str, Any] = {"reward": reward}
    if components:
        body["components"] = components
    return await client.post(f"/episodes/{episode}/reward", body=body, cast_to=object)


async def ask(client: openai.AsyncOpenAI, row: dict[str, Any],
              group: str) -> tuple[float, float]:
    """One conversation: open, ask, judge, reward; (reward, right)."""
    episode = await open_episode(client, group)
    reply = await client.with_options(api_key=episode).completions.create(
        model="policy", prompt=row["prompt"], max_tokens=6)
    reward, right = feedback(reply.choices[0].text.strip(), row["answer"])
    await attach_reward(client, episode, reward, right=right)
    return reward, right


def feedback(answer: str, truth: str) -> tuple[float, float]:
    """The user's rule: (reward, right). The reward is the share of digits in their right place
    (1 when the answer is right: a partial answer earns partial credit); right is 1 or 0."""
    if answer == truth:
        return 1.0, 1.0
    if len(answer) != len(truth):
        return 0.0, 0.0
    return sum(a == b for a, b in zip(answer, truth)) / len(truth), 0.0


async def main(url: str, rows: list[dict[str, Any]], *, group_size: int, questions: int,
               seconds: float, log: Path | None, seed: int) -> int:
    rng = random.Random(seed)
    client = openai.AsyncOpenAI(base_url=url, api_key="online-app", max_retries=5, timeout=60)
    deadline = time.monotonic() + seconds
    out = log.open("a") if log is not None else None
    rounds = 0
    try:
        while time.monotonic() < deadline:
            chosen = rng.sample(rows, questions)
            try:
                judged = await asyncio.gather(*(
                    ask(client, row, f"{row['id']}/{rounds}")
                    for row in chosen for _ in range(group_size)))
            except (openai.APIConnectionError, openai.NotFoundError):
                break  # the run ended: its endpoint is gone
            line = {"round": rounds, "time": round(time.time(), 3),
                    "reward_mean": sum(r for r, _ in judged) / len(judged),
                    "accuracy": sum(a for _, a in judged) / len(judged), "episodes": len(judged)}
            print(json.dumps(line), flush=True)
            if out is not None:
                out.write(json.dumps(line) + "\n")
                out.flush()
            rounds += 1
    finally:
        await client.close()
        if out is not None:
            out.close()
    return 0 if rounds else 1


def wait_for_url(url_file: Path, timeout: float) -> str:
    """The endpoint's base URL, once the explorer has written it."""
    deadline = time.monotonic() + timeout
    while not url_file.exists() or not url_file.read_text().strip():
        if time.monotonic() > deadline:
            raise SystemExit(f"online_app: {url_file} did not appear within {timeout:g}s "
                             "(--wait); is the run up?")
        time.sleep(0.2)
    return url_file.read_text().strip()


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--url-file", type=Path, required=True,
                        help="run_dir/openai/<explorer>.url")
    parser.add_argument("--data", type=Path, required=True, help="JSONL rows: prompt, answer")
    parser.add_argument("--group-size", type=int, default=8,
                        help="episodes per question: the run's explorers[].repeat_times")
    parser.add_argument("--questions", type=int, default=8, help="questions per round")
    parser.add_argument("--seconds", type=float, default=3600.0, help="stop after this long")
    parser.add_argument("--wait", type=float, default=120.0,
                        help="seconds to wait for the url file")
    parser.add_argument("--log", type=Path, help="append each round's mean reward here")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    data = [json.loads(line) for line in args.data.read_text().splitlines() if line.strip()]
    sys.exit(asyncio.run(main(wait_for_url(args.url_file, args.wait), data,
                              group_size=args.group_size, questions=args.questions,
                              seconds=args.seconds, log=args.log, seed=args.seed)))
