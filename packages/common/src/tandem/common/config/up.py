"""The `up` section: how `tandem up` supervises a run's processes on one machine."""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from .base import Section


class UpConfig(Section):
    """Local multi-process mode."""

    restart: Literal["never", "on-failure"] = Field(
        default="never", description="on-failure: restart a component that dies, as a supervisor would")
    max_restarts: int = Field(default=3, ge=0, description="restarts per component before giving up")
    stop_timeout: float = Field(default=5.0, gt=0, description="seconds from SIGTERM to SIGKILL")
    trainer_stop_timeout: float = Field(
        default=300.0, gt=0, description="seconds from SIGTERM to SIGKILL for the trainer, which "
                                         "first finishes or abandons its step and writes its "
                                         "checkpoint (it is stopped with the explorers, "
                                         "before the buffer and the master)")
    start_timeout: float = Field(default=120.0, gt=0, description="seconds for every component to register")
    run_timeout: float | None = Field(default=None, gt=0, description="seconds the whole run may last")
    timeline: bool = Field(
        default=True, description="draw run_dir/timeline.png when the run ends (`tandem "
                                  "timeline RUN_DIR` draws it at any time from the trace)")
    launch: Literal["fork", "exec"] = Field(
        default="fork", description="fork: the trainer and the explorers are forked from a warm "
                                    "process that imported torch and transformers once "
                                    "(tandem.master.zygote), which saves seconds of start-up "
                                    "and shares those pages; exec: each starts as a fresh "
                                    "interpreter, for a platform without fork and "
                                    "PR_SET_CHILD_SUBREAPER (not Linux), or a library that "
                                    "must initialise in the component's own process before "
                                    "anything is imported")
    reward_service: bool | None = Field(
        default=None, description="start tandem-reward; default: when reward.service is true")
