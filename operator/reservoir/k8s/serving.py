"""The serving classes this operator knows (reservoir.core.serving_classes): the built-in
ones, and the administrator's, installed once at start from `--serving-classes FILE` before
any envelope is read. Every reader of an envelope's spec that decides on its policy or
priority reads it through `effective`, so the class is laid under the envelope's own
fields in one place."""

from __future__ import annotations

from collections.abc import Mapping

from reservoir.core.model import ReservationEnvelopeSpec
from reservoir.core.serving_classes import BUILT_IN, ServingClass, effective_spec

_installed: dict[str, ServingClass] = dict(BUILT_IN)


def install(classes: Mapping[str, ServingClass]) -> None:
    """At start: the classes from the administrator's file (built-in ones included)."""
    _installed.clear()
    _installed.update(classes)


def known() -> Mapping[str, ServingClass]:
    return _installed


def effective(spec: ReservationEnvelopeSpec) -> ReservationEnvelopeSpec:
    """The spec with its serving class applied (UnknownServingClassError if it names none)."""
    return effective_spec(spec, _installed)
