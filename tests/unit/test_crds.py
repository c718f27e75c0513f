"""The checked-in CRDs are exactly what the models generate, and they stay structural."""

from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

import pytest
import yaml

from reservoir import crdgen
from reservoir.core import scheduling
from reservoir.core.model import (
    API_VERSION_PATTERN,
    COMPENSATION_KEY,
    DEVICE_ATTRIBUTE_VALUE,
    KIND_NAME,
    NAMESPACE_NAME,
    OBJECT_NAME,
    OPERATION_URL,
    REQUEST_ID,
    SECRET_KEY,
    SPECULATION_GROUP,
)
from reservoir.core.quantity import MAX_QUANTITY, QUANTITY_PATTERN, parse_quantity
from reservoir.core.scheduling import (
    LABEL_KEY,
    LABEL_VALUE,
    NODE_NAME,
    SCHEDULING_WORST_CASE_BYTES,
    SPEC_WORST_CASE_BYTES,
)

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


def all_schemas() -> list[tuple[str, dict[str, Any]]]:
    """The openAPIV3Schema of every CRD crdgen writes (kopf's peering CRDs included)."""
    found = []
    for manifest in crdgen.manifests().values():
        for doc in manifest if isinstance(manifest, list) else [manifest]:
            if doc.get("kind") == "CustomResourceDefinition":
                for version in doc["spec"]["versions"]:
                    found.append((doc["metadata"]["name"], version["schema"]["openAPIV3Schema"]))
    assert len(found) == 5, "three kinds and kopf's two peering kinds"
    return found


KEY_BOUND = re.compile(r"self\.all\(k, size\(k\) <= (\d+)")


def map_key_bound(node: dict[str, Any]) -> int | None:
    """The longest key a map may have, from its CEL rule `self.all(k, size(k) <= N ...)`:
    a structural schema has no maxLength for keys."""
    bounds = [
        int(found.group(1))
        for rule in node.get("x-kubernetes-validations", [])
        if (found := KEY_BOUND.match(rule["rule"]))
    ]
    return min(bounds) if bounds else None


def test_schemas_are_structural_and_bounded() -> None:
    """Issue 21: a claim whose schemaless affinity nested 2,000 levels deep was stored and
    killed the operator's watch. Every field of every CRD is typed (no
    preserve-unknown-fields), every list has maxItems, every map maxProperties, every string
    a maxLength or an enum, and every map a user writes a CEL bound on its keys."""
    for kind, schema in all_schemas():
        assert "x-kubernetes-preserve-unknown-fields" not in str(schema), kind
        for path, node, _, _ in schema_nodes(schema):
            assert "$ref" not in node and "anyOf" not in node and "title" not in node, path
            where = f"{kind} {path}"
            kind_of = node.get("type")
            assert kind_of in ("object", "array", "string", "integer", "boolean"), where
            if kind_of == "object" and path != ".metadata":  # the API server bounds metadata
                assert "properties" in node or "additionalProperties" in node, f"{where}: untyped"
            if "additionalProperties" in node:
                assert isinstance(node["additionalProperties"], dict), where
                assert "maxProperties" in node, f"{where}: unbounded map"
                if not path.startswith(".status"):  # keys the operator writes: names, UIDs
                    assert map_key_bound(node), f"{where}: unbounded map keys"
            if kind_of == "array":
                assert "maxItems" in node, f"{where}: unbounded list"
            if (
                kind_of == "string"
                and "enum" not in node
                and path
                not in (
                    ".apiVersion",
                    ".kind",
                )
            ):
                assert "maxLength" in node, f"{where}: unbounded string"


def test_crdgen_refuses_a_schemaless_field() -> None:
    with pytest.raises(ValueError, match="preserve-unknown-fields"):
        crdgen._clean({"type": "object", "x-kubernetes-preserve-unknown-fields": True}, {})


# Keys of the maps the operator records (ledger entries by UID, counts by phase, resource
# names): at most 63 characters, written only from names and UIDs the API server checked.
STATUS_KEY_LENGTH = 64


def worst_case_bytes(node: dict[str, Any], path: str = "") -> int:
    """The most bytes the JSON of a value of this schema can take: every list and map full,
    every string at its maxLength, a patterned string's characters one byte each (two where
    its pattern allows `"` or `\\`), any other character as a 6-byte escape. An
    over-estimate."""
    if "enum" in node:
        return max(len(json.dumps(value)) for value in node["enum"])
    kind = node.get("type")
    if kind == "string":
        pattern = node.get("pattern")
        per_char = 6 if pattern is None else 2 if "\\x21" in pattern or "[^" in pattern else 1
        return 2 + per_char * node["maxLength"]
    if kind == "integer":
        return 20
    if kind == "boolean":
        return 5
    if kind == "array":
        return 2 + node["maxItems"] * (worst_case_bytes(node["items"], path) + 1)
    assert kind == "object", path
    assert "properties" in node or "additionalProperties" in node, f"{path}: schemaless"
    total = 2
    for name, child in node.get("properties", {}).items():
        total += len(name) + 4 + worst_case_bytes(child, f"{path}.{name}")
    if "additionalProperties" in node:
        key = map_key_bound(node) or STATUS_KEY_LENGTH
        value = worst_case_bytes(node["additionalProperties"], f"{path}.*")
        total += node["maxProperties"] * (key + 4 + value)  # a key's characters are ASCII
    return total


def test_the_worst_case_spec_is_far_below_a_megabyte() -> None:
    """A claim or an envelope at every bound of its spec stays small: what a tenant writes
    costs the operator's memory and watches a bounded amount, and a megabyte spec is
    refused by the schema (tests/integration/test_crd_validation.py shows it live). The
    figures are stated in reservoir.core.scheduling and reservoir.core.model."""
    sizes = {}
    for kind, schema in all_schemas():
        if "spec" in schema["properties"]:
            sizes[kind] = worst_case_bytes(schema["properties"]["spec"], ".spec")
    claim = crdgen.claim_crd()["spec"]["versions"][0]["schema"]["openAPIV3Schema"]
    placement = claim["properties"]["spec"]["properties"]["placement"]
    assert worst_case_bytes(placement) <= SCHEDULING_WORST_CASE_BYTES
    assert sizes["branchclaims.reservoir.dev"] <= SPEC_WORST_CASE_BYTES, sizes
    assert sizes["reservationenvelopes.reservoir.dev"] <= SPEC_WORST_CASE_BYTES, sizes
    assert sizes["reservationpools.reservoir.dev"] <= SPEC_WORST_CASE_BYTES, sizes


def test_every_status_has_a_finite_worst_case() -> None:
    """Status too is typed and bounded (the operator's ledger byte budget keeps it far
    below the bound: reservoir.core.ledgersize)."""
    for kind, schema in all_schemas():
        assert worst_case_bytes(schema["properties"]["status"], ".status") > 0, kind


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
    ".spec.envelope": OBJECT_NAME,
    ".spec.parent": OBJECT_NAME,
    "compensations[].key": COMPENSATION_KEY,
    ".spec.speculationGroup": SPECULATION_GROUP,
    ".spec.servingClass": SPECULATION_GROUP,  # the same grammar: a label value, not empty
    ".spec.priorityClassName": SPECULATION_GROUP,
    "priorityClasses.*.namespaces[]": NAMESPACE_NAME,
}
# The core/v1 scheduling types of a claim's placement hints (reservoir.core.scheduling).
SCHEDULING_GRAMMARS = {LABEL_KEY, LABEL_VALUE, scheduling.NAMESPACE_NAME, NODE_NAME}


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
            if path.startswith(".spec.placement.") and "deviceAttributes" not in path:
                assert node["pattern"] in SCHEDULING_GRAMMARS, f"{kind} {path}"
                continue
            if path.endswith("deviceAttributes.*"):  # another grammar: attribute values
                assert node["pattern"] == DEVICE_ATTRIBUTE_VALUE
                continue
            if path.endswith("spec.namespaces[]"):  # and a pool's namespace names
                assert node["pattern"] == NAMESPACE_NAME
                continue
            if path.endswith(".status.windows.*[].amount"):  # a window slice's one amount
                assert node["pattern"] == QUANTITY_PATTERN, f"{kind} {path}"
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
    """One source of truth: the chart's crds/ are crds/'s CRDs, kopf's peering CRDs and the
    claim's admission policy (there, not in templates/: the policy holds rules of the
    claim's API, and Helm installs crds/ once and never upgrades, rolls back or deletes
    it, as with the CRDs), and `--check` fails when any of them drifts."""
    names = set(crdgen.manifests())
    assert crdgen.CLAIM_POLICY_FILE in names and "kopf.dev_peerings.yaml" in names
    assert {p.name for p in (CHART / "crds").glob("*.yaml")} == names
    for name in names:
        assert (CHART / "crds" / name).read_text() == (CRDS / name).read_text(), name
    policy_file = sorted(p.name for p in CRDS.glob("*.yaml"))[0]
    assert policy_file == crdgen.CLAIM_POLICY_FILE, "applied first: in force before the CRD"
    assert not [
        t for t in (CHART / "templates").iterdir() if "branchclaims.reservoir.dev" in t.read_text()
    ], "the claim's policy is not a release's object"

    crds, chart = tmp_path / "crds", tmp_path / "charts" / "reservoir"
    assert crdgen.main([str(crds)]) == 0  # generates both, the chart next to crds/
    assert crdgen.main(["--check", str(crds)]) == 0
    for drifted in (
        chart / "crds" / "reservoir.dev_branchclaims.yaml",
        chart / "crds" / "kopf.dev_peerings.yaml",
        chart / "crds" / crdgen.CLAIM_POLICY_FILE,
    ):
        original = drifted.read_text()
        drifted.write_text(original + "# edited by hand\n")
        assert crdgen.main(["--check", str(crds)]) == 1, drifted
        drifted.unlink()
        assert crdgen.main(["--check", str(crds)]) == 1, drifted
        drifted.write_text(original)
    assert crdgen.main(["--check", str(crds), "--chart", str(tmp_path / "elsewhere")]) == 1
