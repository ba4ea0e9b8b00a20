"""No file of a finished run holds a secret the run used, and the run's files are private.

A short `tandem up` run of the synchronous preset (weights by broadcast, so a weight group with
its member key) with Curve on every socket. While it runs, the test listens on the master's
`weights` topic, as an explorer does, for the group's rendezvous. Afterwards every file under
the run dir is searched for each secret: both Curve secret keys and the weight group's member
secret, as Z85 text and as raw bytes; and the run dir is 0700 with config and journal 0600.
Issue 32 item 5 found the group's secret in `run/master/journal.bin`, mode 0644.
"""

from __future__ import annotations

import asyncio
import os
import stat
import sys
from pathlib import Path

import pytest
import yaml
import zmq

from tandem.common.config.transport import TransportConfig
from tandem.common.errors import WaitTimeout
from tandem.common.messages.master import WeightsPublished
from tandem.common.pubsub import Subscriber
from tandem.common.rpc import RpcClient
from tandem.common.sockets import free_port
from tandem.master.quickstart import reversal_tasks, write_jsonl

sys.path.insert(0, str(Path(__file__).parents[1]))
from processes import run_group
from backstop import BACKSTOP

pytestmark = pytest.mark.slow
TANDEM = str(Path(sys.executable).parent / "tandem")


def _keys() -> dict[str, str]:
    server_public, server_secret = zmq.curve_keypair()
    client_public, client_secret = zmq.curve_keypair()
    return {"server_public": server_public.decode(), "server_secret": server_secret.decode(),
            "client_public": client_public.decode(), "client_secret": client_secret.decode()}


async def _rendezvous(master: str, publish: str, transport: TransportConfig, run):
    """The first weight-group rendezvous the master publishes, or None if the run ends first."""
    snapshot = RpcClient(master, peer="master", transport=transport, name="secret-probe")
    weights = Subscriber(publish, topics=["weights"], transport=transport, snapshot=snapshot)
    try:
        while not run.done():
            try:
                event = await weights.recv(1.0)
            except WaitTimeout:  # nothing yet (the master may not be up)
                continue
            if isinstance(event.body, WeightsPublished) and event.body.rendezvous is not None:
                return event.body.rendezvous
        return None
    finally:
        await weights.close()
        await snapshot.close()


async def test_no_file_of_a_run_holds_a_secret_and_the_run_dir_is_private(
        tmp_path, tiny_model_dir):
    keys = _keys()
    env_names = {"server_secret": "T_NSD_SERVER_SECRET", "client_secret": "T_NSD_CLIENT_SECRET"}
    # 127.0.0.2: an address `tandem up` keeps (it moves 127.0.0.1 ones to free ports)
    master, publish = (f"tcp://127.0.0.2:{free_port('127.0.0.2')}" for _ in range(2))
    train, _ = reversal_tasks(0)
    config = {
        "name": "secrets", "run_dir": str(tmp_path / "run"),
        "model": {"path": str(tiny_model_dir)},
        "sync": {"preset": "synchronous", "timeout": BACKSTOP},
        "master": {"total_steps": 3, "address": master, "publish_address": publish,
                   "taskset": {"path": str(write_jsonl(train[:32], tmp_path / "train.jsonl")),
                               "epochs": 10}},
        "explorers": [{"name": "explorer-0", "batch_size": 2, "repeat_times": 2,
                       "workflow_args": {"reward_fn": "k12", "answer_key": "truth"},
                       "sampling": {"max_tokens": 3}}],
        "trainer": {"groups_per_step": 2, "lr": 1e-3},
        "reward": {"functions": {"k12": 1.0}},
        "transport": {"liveness": BACKSTOP, "curve": {
            **keys, **{k: f"${{env:{v}}}" for k, v in env_names.items()}}},
        "logging": {"level": "debug"},  # the most a run ever writes
        "up": {"run_timeout": BACKSTOP},
    }
    source = tmp_path / "input.yaml"  # the user's file, outside the run dir
    source.write_text(yaml.safe_dump(config))
    env = {**os.environ, **{v: keys[k] for k, v in env_names.items()}}
    run = asyncio.ensure_future(asyncio.to_thread(
        run_group, [TANDEM, "up", str(source)], 420, env=env, cwd=tmp_path))
    transport = TransportConfig(curve=keys)
    rendezvous = await _rendezvous(master, publish, transport, run)
    done = await run
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    assert rendezvous is not None, "no weight group was announced"

    secrets = {"curve server secret": keys["server_secret"],
               "curve client secret": keys["client_secret"],
               "weight group member secret": rendezvous.member_secret}
    needles = {name: [text.encode(), zmq.utils.z85.decode(text.encode())]
               for name, text in secrets.items()}
    run_dir = tmp_path / "run"
    files = [p for p in run_dir.rglob("*") if p.is_file() and not p.is_symlink()]
    assert any(p.name == "journal.bin" for p in files) and any(p.suffix == ".out" for p in files)
    found = [f"{p.relative_to(run_dir)}: {name}" for p in files for name, forms in needles.items()
             if any(form in p.read_bytes() for form in forms)]
    assert found == []

    assert stat.S_IMODE(run_dir.stat().st_mode) == 0o700  # nobody else reaches any file in it
    for private in ("config.yaml", "master/journal.bin"):
        assert stat.S_IMODE((run_dir / private).stat().st_mode) == 0o600, private
