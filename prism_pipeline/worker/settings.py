"""Worker configuration: CLI flags win over `PRISM_*` environment variables, which win over defaults.

The engine's part (model, device, precision, tp, decision config, gate) is `EngineSettings`, the
one settings model every command loads its engine from."""

from __future__ import annotations

import os
import socket
from typing import Literal

from pydantic import Field, model_validator
from pydantic_settings import SettingsConfigDict

from prism_pipeline.core.engine_setup import EngineSettings
from prism_pipeline.core.seeds import SeedPolicy


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}"


class WorkerSettings(EngineSettings):
    """`prism run`'s settings: the engine's (`core.engine_setup.EngineSettings`), then the worker's."""

    model_config = SettingsConfigDict(env_prefix="PRISM_", extra="forbid")

    brokers: str = Field("localhost:9092", description="Kafka bootstrap servers, comma separated")
    input_topic: str = Field("prism.evidence", description="topic the evidence events are read from")
    output_topic: str = Field("prism.decisions", description="topic the decision records go to (compacted)")
    dlq_topic: str = Field("prism.dead-letters", description="topic for events that cannot be decided")
    group_id: str = Field(
        "prism-workers", description="Kafka consumer group (workers of one group share the partitions)"
    )

    batch_tokens: int = Field(8192, ge=1, description="token budget of one engine batch")
    max_wait_ms: float = Field(20.0, ge=0, description="longest an event waits for its batch to fill")
    max_batch_events: int = Field(64, ge=1, description="events in one engine batch at most")
    max_queued_batches: int = Field(4, ge=1, description="batches waiting for the engine before pausing")

    max_gate: float | None = Field(
        None,
        ge=0,
        le=1,
        description="highest AutoThink gate an event or question may ask for (unset: any; replay "
        "and backfill of the same records need the same value)",
    )
    seed_policy: SeedPolicy = Field(
        "event",
        description="seed of a record's thoughts: event (its seed, else derived from its id), id, or fixed",
    )
    fixed_seed: int = Field(0, ge=0, description="the seed of every event under --seed-policy fixed")

    max_questions: int = Field(64, ge=1, description="questions per event before it is dead-lettered")
    max_state_chars: int = Field(1_000_000, ge=1, description="state size before it is dead-lettered")

    exactly_once: bool = Field(
        False, description="transactional producer: records and offsets commit together"
    )
    transactional_id_prefix: str = Field(
        "prism", description="prefix of the transactional ids (exactly-once)"
    )

    metrics_port: int | None = Field(None, ge=0, le=65535, description="Prometheus port (unset: off)")
    worker_id: str = Field(
        default_factory=default_worker_id,
        description="this worker's name in logs and headers (default HOST-PID)",
    )
    commit_interval_ms: float = Field(200.0, gt=0, description="how often acknowledged offsets are committed")
    revoke_timeout_s: float = Field(
        30.0,
        gt=0,
        description="how long a revoke waits for the batch at the engine and its publishing (queued "
        "batches of a revoked partition are dropped and re-delivered); the group's rebalance "
        "timeout is this plus the session timeout",
    )
    stop_timeout_s: float = Field(
        30.0,
        gt=0,
        description="how long a SIGTERM's drain (decide, publish, commit) may take; then in-flight "
        "work is abandoned uncommitted (the next owner decides it again) and the exit status is 3",
    )
    auto_offset_reset: Literal["earliest", "latest"] = Field(
        "earliest", description="where a new consumer group starts reading"
    )
    max_poll_records: int = Field(500, ge=1, description="records one Kafka poll returns at most")
    session_timeout_ms: int = Field(
        10000, ge=1000, description="Kafka session timeout (no heartbeat: rebalance)"
    )
    heartbeat_interval_ms: int | None = Field(
        None,
        ge=100,
        description="Kafka consumer heartbeat interval, at most a third of the session timeout "
        "(unset: a third, at most 3000)",
    )
    max_poll_interval_ms: int = Field(
        300000, ge=1000, description="longest gap between polls before Kafka drops the worker"
    )

    @model_validator(mode="after")
    def _check(self) -> WorkerSettings:
        if len({self.input_topic, self.output_topic, self.dlq_topic}) != 3:
            raise ValueError("input, output and dead-letter topics must be three different topics")
        hb = self.heartbeat_interval_ms
        if hb is not None and hb * 3 > self.session_timeout_ms:
            # Kafka itself only refuses hb >= session; at more than a third, one late or lost
            # heartbeat on a loaded host already expels the member and rebalances the group.
            raise ValueError(
                f"heartbeat_interval_ms {hb} is more than a third of session_timeout_ms "
                f"{self.session_timeout_ms}: set it to at most {self.session_timeout_ms // 3}"
            )
        if self.rebalance_timeout_ms > self.max_poll_interval_ms:
            raise ValueError(
                f"revoke_timeout_s plus session_timeout_ms ({self.rebalance_timeout_ms} ms) exceeds "
                f"max_poll_interval_ms {self.max_poll_interval_ms}: a revoke would outlast the poll interval"
            )
        return self

    @property
    def heartbeat_ms(self) -> int:
        """The heartbeat interval the consumer uses (aiokafka's 3000 unless the session is short)."""
        if self.heartbeat_interval_ms is not None:
            return self.heartbeat_interval_ms
        return min(3000, self.session_timeout_ms // 3)

    @property
    def rebalance_timeout_ms(self) -> int:
        """How long the group waits for this member to rejoin in a rebalance.

        aiokafka's default is the session timeout, so a member whose revoke (finishing the batch at
        the engine, publishing, committing) takes longer than one session misses the join and is
        expelled (UnknownMemberId): with short sessions the group then rebalances in turn without
        end (RESULTS.md, issue #23). The member keeps heartbeating during its revoke, so a dead
        one is still found within a session; the join window is the revoke's budget plus a session.
        """
        return int(self.revoke_timeout_s * 1000) + self.session_timeout_ms

    def bootstrap_servers(self) -> list[str]:
        return [s.strip() for s in self.brokers.split(",") if s.strip()]
