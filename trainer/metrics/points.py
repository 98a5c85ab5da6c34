"""A metric point, keyed ``<job_id>/<update>/<name>``, and the interface every sink implements."""

from __future__ import annotations

from collections.abc import Iterable
from datetime import UTC, datetime
from typing import Protocol

from pydantic import BaseModel, ConfigDict, Field


class MetricPoint(BaseModel):
    model_config = ConfigDict(extra="forbid")

    job_id: str
    update: int
    name: str
    value: float
    attempt: int
    lineage_id: str
    at: datetime = Field(default_factory=lambda: datetime.now(UTC))

    @property
    def key(self) -> str:
        return f"{self.job_id}/{self.update}/{self.name}"


class MetricSink(Protocol):
    def write(self, points: Iterable[MetricPoint]) -> None:
        """Upsert each point by its key."""

    def flush(self) -> None:
        """Make every point written so far durable (the rank calls it at each checkpoint)."""

    def read(self, job_id: str) -> list[MetricPoint]:
        """One point per key, ordered by (update, name)."""

    def close(self) -> None: ...


def points_of(job_id: str, update: int, attempt: int, lineage_id: str, values: dict[str, float]) -> list[MetricPoint]:
    return [MetricPoint(job_id=job_id, update=update, name=n, value=float(v), attempt=attempt, lineage_id=lineage_id)
            for n, v in values.items()]
