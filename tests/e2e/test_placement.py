"""`placement`: what each process gets under auto and explicit placement, and that `tandem up`
starts each child with its share. That a started component really runs with it (torch's thread
count) is checked on the explorer and trainer starts of tests/test_cli_edge.py."""

from __future__ import annotations

from pathlib import Path

import pytest

from tandem.common.config import RunConfig
from tandem.common.config.placement import THREAD_ENV, resolve_placement
from tandem.master.up import Supervisor


def config(preset: str = "fully_async", n_explorers: int = 1, **placement) -> RunConfig:
    return RunConfig.model_validate({
        "sync": {"preset": preset},
        "explorers": [{"name": f"explorer-{i}"} for i in range(n_explorers)],
        "placement": placement,
    })


def threads(table) -> dict[str, int | None]:
    return {name: a.threads for name, a in table.items()}


def test_auto_splits_the_cores_when_trainer_and_explorers_overlap():
    for preset in ("fully_async", "one_step_off_policy"):
        assert threads(resolve_placement(config(preset), cores=8)) == {
            "master": 1, "buffer": 1, "reward": 1, "trainer": 4, "explorer-0": 4}
    assert threads(resolve_placement(config("multi_explorer_async", 2), cores=8)) == {
        "master": 1, "buffer": 1, "reward": 1, "trainer": 4, "explorer-0": 2, "explorer-1": 2}
    # an odd count leans to the trainer; nobody ever gets zero
    assert threads(resolve_placement(config(), cores=3))["trainer"] == 2
    assert set(threads(resolve_placement(config("multi_explorer_async", 3), cores=2)).values()
               ) == {1}


def test_auto_gives_every_core_to_each_side_when_they_alternate():
    table = resolve_placement(config("synchronous"), cores=8)
    assert (table["trainer"].threads, table["explorer-0"].threads) == (8, 8)
    # interval 4 lets the trainer train batch 0 while batch 1 rolls out: that overlaps
    overlapping = RunConfig.model_validate({"sync": {"preset": "synchronous", "interval": 4}})
    assert resolve_placement(overlapping, cores=8)["trainer"].threads == 4


def test_explicit_placement_wins_and_torchrun_ranks_share_the_trainer():
    table = resolve_placement(config(trainer={"threads": 6, "nproc": 2, "devices": "0,1"},
                                     explorers={"threads": 3, "devices": "2"},
                                     control={"threads": 2}), cores=8)
    assert table["trainer"].env() == {"OMP_NUM_THREADS": "6", "MKL_NUM_THREADS": "6",
                                      "CUDA_VISIBLE_DEVICES": "0,1"}
    assert table["explorer-0"].env()["CUDA_VISIBLE_DEVICES"] == "2"
    assert table["master"].threads == 2
    # auto threads per rank: the trainer's half of 8 cores over 2 torchrun processes
    assert resolve_placement(config(trainer={"nproc": 2}), cores=8)["trainer"].threads == 2


def test_inherit_leaves_the_environment_alone_except_what_is_set():
    table = resolve_placement(config(policy="inherit", trainer={"threads": 2}), cores=8)
    assert table["explorer-0"].env() == {}
    assert (table["trainer"].threads, table["master"].threads) == (2, 1)  # control's default


def test_bad_placement_is_refused_by_its_path():
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="placement.trainer.threads"):
        RunConfig.model_validate({"placement": {"trainer": {"threads": 0}}})


def test_tandem_up_starts_each_child_with_its_share(tmp_path):
    cfg = RunConfig.model_validate({
        "run_dir": str(tmp_path / "run"), "sync": {"preset": "fully_async"},
        "placement": {"cores": 4, "trainer": {"nproc": 2}}})
    sup = Supervisor(cfg, live=False)
    sup.prepare()
    env = {c.name: c.env for c in sup.children}
    assert {env[n][k] for n in ("master", "buffer") for k in THREAD_ENV} == {"1"}
    assert env["trainer"]["OMP_NUM_THREADS"] == "1"  # 2 cores over 2 ranks
    assert env["explorer-0"]["MKL_NUM_THREADS"] == "2"
    trainer = next(c for c in sup.children if c.name == "trainer")
    assert Path(trainer.argv[0]).name == "tandem-torchrun" and "--nproc-per-node=2" in trainer.argv
    rows = dict(sup.placement_rows())
    assert rows["placement"] == "auto over 4 cores"
    assert rows["  explorer-0"] == "2 threads"
