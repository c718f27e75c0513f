"""The checked-in CRDs are exactly what the models generate, and they stay structural."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml

from reservoir import crdgen
from reservoir.core.model import (
    API_VERSION_PATTERN,
    DEVICE_ATTRIBUTE_VALUE,
    KIND_NAME,
    NAMESPACE_NAME,
    OBJECT_NAME,
    OPERATION_URL,
    REQUEST_ID,
    SECRET_KEY,
)
from reservoir.core.quantity import MAX_QUANTITY, QUANTITY_PATTERN, parse_quantity

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


def checked_in_schemas() -> list[tuple[str, dict[str, Any]]]:
    """The openAPIV3Schema of every CRD version in crds/, read now."""
    found = []
    for file in sorted(CRDS.glob("*.yaml")):
        for doc in yaml.safe_load_all(file.read_text()):
            if doc and doc.get("kind") == "CustomResourceDefinition":
                for version in doc["spec"]["versions"]:
                    name = f"{doc['spec']['names']['kind']}/{version['name']}"
                    found.append((name, version["schema"]["openAPIV3Schema"]))
    assert len(found) >= 2, "both CRDs are in crds/"
    return found


def schema_nodes(
    node: dict[str, Any], path: str = "", parent: dict[str, Any] | None = None, name: str = ""
) -> list[tuple[str, dict[str, Any], dict[str, Any] | None, str]]:
    """Every schema node, with its dotted path, its parent node and its name there
    ("*" for a map's values, "[]" for list items)."""
    found = [(path, node, parent, name)]
    for key, child in node.get("properties", {}).items():
        found += schema_nodes(child, f"{path}.{key}", node, key)
    if isinstance(node.get("additionalProperties"), dict):
        found += schema_nodes(node["additionalProperties"], f"{path}.*", node, "*")
    if isinstance(node.get("items"), dict):
        found += schema_nodes(node["items"], f"{path}[]", node, "[]")
    return found


OTHER_GRAMMARS = {
    "provider.statusURL": OPERATION_URL,
    "provider.cancelURL": OPERATION_URL,
    "upstream.requestId": REQUEST_ID,
    "spec.result": REQUEST_ID,
    "upstream.ref.name": OBJECT_NAME,
    "upstream.ref.apiVersion": API_VERSION_PATTERN,
    "tokenSecret.name": OBJECT_NAME,
    "tokenSecret.key": SECRET_KEY,
    "upstream.ref.kind": KIND_NAME,
}


def test_every_quantity_in_the_crds_is_the_parsers_grammar_with_its_bound() -> None:
    """One definition: the schema's quantity pattern is the parser's, every quantity map a
    user writes (in a spec) carries the 1E bound the parser enforces, the maps the
    operator records (in a status) carry no CEL rule (`recorded_map`), and nothing else
    uses a pattern."""
    assert parse_quantity("1E") == MAX_QUANTITY
    quantity_maps = 0
    recorded_maps = 0
    for kind, schema in checked_in_schemas():
        for path, node, parent, name in schema_nodes(schema):
            if "pattern" not in node:
                continue
            if path.endswith("deviceAttributes.*"):  # another grammar: attribute values
                assert node["pattern"] == DEVICE_ATTRIBUTE_VALUE
                continue
            if path.endswith("spec.namespaces[]"):  # and a pool's namespace names
                assert node["pattern"] == NAMESPACE_NAME
                continue
            other = [g for suffix, g in OTHER_GRAMMARS.items() if path.endswith(suffix)]
            if other:  # URLs, idempotency keys and kinds
                assert node["pattern"] == other[0], f"{kind} {path}"
                continue
            assert node["pattern"] == QUANTITY_PATTERN, f"{kind} {path}: another grammar"
            assert node.get("type") == "string", f"{kind} {path}"
            assert name == "*" and parent is not None, f"{kind} {path}: a quantity outside a map"
            rules = [v["rule"] for v in parent.get("x-kubernetes-validations", [])]
            if path.startswith(".status."):
                assert not rules, f"{kind} {path}: a CEL rule on a recorded map"
                recorded_maps += 1
                continue
            bound = "self.all(k, quantity(self[k]).compareTo(quantity('1E')) <= 0)"
            assert bound in rules, f"{kind} {path}: no 1E bound on this map"
            quantity_maps += 1
    assert quantity_maps >= 5, "the walk found the spec's quantity maps"
    assert recorded_maps >= 10, "the walk found the status's quantity maps"


def test_no_transition_rule_sits_on_a_field_that_can_be_removed() -> None:
    """A transition rule (oldSelf) only runs when its field exists before and after a write.
    So the field, and each object above it, must be required or have a schema default that
    the API server fills back in; tests/integration/test_crd_rules.py shows it live."""
    transition_rules = 0
    for kind, schema in checked_in_schemas():
        nodes = {path: (node, parent, name) for path, node, parent, name in schema_nodes(schema)}
        for path, (node, _, _) in nodes.items():
            rules = [v["rule"] for v in node.get("x-kubernetes-validations", [])]
            if not any("oldSelf" in rule for rule in rules):
                continue
            transition_rules += 1
            assert "*" not in path.split(".") and "[]" not in path, (
                f"{kind} {path}: a transition rule under a map or list is skipped when its "
                "entry is removed"
            )
            step = path
            while step:  # the field, then each parent up to (not including) the root
                field, parent, name = nodes[step]
                assert parent is not None
                assert name in parent.get("required", []) or "default" in field, (
                    f"{kind} {path}: {step} is neither required nor defaulted, so removing it "
                    "skips the rule"
                )
                step = step.rsplit(".", 1)[0]
    assert transition_rules >= 8, "the walk found the transition rules"


CHART = CRDS.parent / "charts" / "reservoir"


def test_the_chart_carries_the_same_crds_and_policy_and_drift_there_is_caught(
    tmp_path: Path,
) -> None:
    """One source of truth: the chart's crds/ are crds/'s CRDs (and kopf's peering CRDs),
    its admission template is crds/'s policy named per release, and `--check` fails when
    any of them drifts."""
    for name in (*crdgen.crds(), "kopf.dev_peerings.yaml"):
        assert (CHART / "crds" / name).read_text() == (CRDS / name).read_text(), name
    template = (CHART / "templates" / "admission-policy.yaml").read_text()
    for document in crdgen.claim_admission_policy():
        for validation in document["spec"].get("validations", []):
            assert yaml.safe_dump(validation["expression"], width=100)[:60] in template

    crds, chart = tmp_path / "crds", tmp_path / "charts" / "reservoir"
    assert crdgen.main([str(crds)]) == 0  # generates both, the chart next to crds/
    assert crdgen.main(["--check", str(crds)]) == 0
    for drifted in (
        chart / "crds" / "reservoir.dev_branchclaims.yaml",
        chart / "crds" / "kopf.dev_peerings.yaml",
        chart / "templates" / "admission-policy.yaml",
    ):
        original = drifted.read_text()
        drifted.write_text(original + "# edited by hand\n")
        assert crdgen.main(["--check", str(crds)]) == 1, drifted
        drifted.unlink()
        assert crdgen.main(["--check", str(crds)]) == 1, drifted
        drifted.write_text(original)
    assert crdgen.main(["--check", str(crds), "--chart", str(tmp_path / "elsewhere")]) == 1
