"""Preemption of tentative holds in a pool (reservoir.core.preemption): a class's policy
(`PreemptionPolicy`), the pool's request naming an envelope (`PreemptionRequest`), and the
envelope's own decision on it (`Preemption`)."""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum

from pydantic import Field

from reservoir.core.model.common import MAX_NAME_LENGTH, MESSAGE_LENGTH, Model

MAX_PREEMPTIONS = 16  # requests a pool keeps at once: enough for one head's victims
PREEMPTOR_LENGTH = 63 + 1 + MAX_NAME_LENGTH  # namespace/name


class PreemptionPolicy(StrEnum):
    """Whether envelopes of a priority class may take room from lower classes' holds."""

    NEVER = "Never"
    PREEMPT_LOWER_PRIORITY = "PreemptLowerPriority"


class PreemptionOutcome(StrEnum):
    PREEMPTED = "Preempted"
    REFUSED = "Refused"


class PreemptionRequest(Model):
    """The pool asks an envelope it admitted to give its room to a waiting envelope of a
    higher class. The envelope decides (`Preemption`): the pool never releases a claim."""

    envelope: str = Field(max_length=MAX_NAME_LENGTH, description="The envelope asked.")
    namespace: str = Field(max_length=63, description="Its namespace.")
    preemptor: str = Field(
        max_length=PREEMPTOR_LENGTH,
        description="namespace/name of the waiting envelope that needs the room.",
    )
    preemptor_uid: str = Field(max_length=64, description="Its UID.")
    priority_class: str = Field(max_length=63, description="The preemptor's priority class.")
    requested_at: datetime = Field(description="When the pool asked.")


class Preemption(Model):
    """An envelope's decision on its pool's preemption request, recorded once per request:
    Preempted (every claim it held was Tentative: each released once with reason
    Preempted, and the envelope closed) or Refused (something it holds is past a commit
    point, or may be: nothing moved)."""

    outcome: PreemptionOutcome = Field(description="Preempted or Refused.")
    preemptor: str = Field(
        max_length=PREEMPTOR_LENGTH, description="namespace/name of the envelope it was for."
    )
    preemptor_uid: str = Field(max_length=64, description="Its UID.")
    priority_class: str = Field(max_length=63, description="The preemptor's priority class.")
    decided_at: datetime = Field(description="When this envelope decided.")
    message: str = Field(default="", max_length=MESSAGE_LENGTH, description="Why, in words.")
