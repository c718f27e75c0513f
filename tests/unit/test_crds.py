"""The checked-in CRDs are exactly what the models generate, and they stay structural."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from reservoir import crdgen

CRDS = Path(__file__).resolve().parents[2] / "crds"


def test_checked_in_crds_match_the_models() -> None:
    assert crdgen.main(["--check", str(CRDS)]) == 0, "run `make crds` and commit the result"


def walk(node: Any, path: str = "") -> list[tuple[str, dict[str, Any]]]:
    found: list[tuple[str, dict[str, Any]]] = []
    if isinstance(node, dict):
        found.append((path, node))
        for key, value in node.items():
            found += walk(value, f"{path}.{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            found += walk(value, f"{path}[{index}]")
    return found


def test_every_field_has_a_description_so_kubectl_explain_teaches_it() -> None:
    for manifest in crdgen.crds().values():
        schema = manifest["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
        for path, node in walk(schema["properties"]["spec"]) + walk(schema["properties"]["status"]):
            for name, field in node.get("properties", {}).items():
                assert field.get("description"), f"{path}.{name} has no description"


def test_schemas_are_structural_and_bounded() -> None:
    for manifest in crdgen.crds().values():
        schema = manifest["spec"]["versions"][0]["schema"]["openAPIV3Schema"]["properties"]
        for path, node in walk(schema["spec"], ".spec") + walk(schema["status"], ".status"):
            assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
            if node.get("type") == "object" and "additionalProperties" in node:
                assert "maxProperties" in node, f"{path}: unbounded map"
            if node.get("type") == "array":
                assert "maxItems" in node, f"{path}: unbounded list"
            if node.get("type") == "string" and "enum" not in node and "format" not in node:
                assert "maxLength" in node, f"{path}: unbounded string"
