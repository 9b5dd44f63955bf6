"""The pinned KEDA release's ScaledObject CRD (deploy/keda/keda.sh_scaledobjects.yaml, the release's file byte for
byte) as the JSON schema the deploy tests validate ScaledObjects against.

The file's git blob id is pinned here, so an edit to it fails a test instead of quietly loosening the check. The
schema is the CRD's `openAPIV3Schema` with one change, made in code rather than in the file: every object that lists
its properties refuses others (`additionalProperties: false`), as `kubectl apply` does with its default strict field
validation; without it a misspelt field (coolDownPeriod) would pass here and be refused at apply time."""
from __future__ import annotations

import copy
import hashlib
from pathlib import Path

import yaml

KEDA = Path(__file__).parents[2] / "deploy/keda"
VERSION = (KEDA / "VERSION").read_text().strip()
CRD = KEDA / "keda.sh_scaledobjects.yaml"
# `git -C kedacore/keda rev-parse v2.16.1:config/crd/bases/keda.sh_scaledobjects.yaml`; `git hash-object` of CRD
CRD_BLOB = "5d8c9ae234d20333b83dab9ed69fb993e8bafc84"


def blob_id(data: bytes) -> str:
    """The id git gives a file with these bytes (what `git hash-object` prints)."""
    return hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()


def strict(schema: dict) -> dict:
    """`schema` with `additionalProperties: false` on every object that lists properties and allows no others
    (x-kubernetes-preserve-unknown-fields, or an additionalProperties of its own, left as the CRD says)."""
    schema = copy.deepcopy(schema)
    stack = [schema]
    while stack:
        node = stack.pop()
        if "properties" in node and "additionalProperties" not in node \
                and not node.get("x-kubernetes-preserve-unknown-fields"):
            node["additionalProperties"] = False
        for key in ("properties", "patternProperties"):
            stack.extend(node.get(key, {}).values())
        for key in ("items", "additionalProperties", "not"):
            if isinstance(node.get(key), dict):
                stack.append(node[key])
        for key in ("anyOf", "allOf", "oneOf"):
            stack.extend(node.get(key, []))
    return schema


def scaled_object_schema() -> dict:
    """The strict JSON schema of a ScaledObject of the pinned release's v1alpha1."""
    crd = yaml.safe_load(CRD.read_bytes())
    (served,) = [v for v in crd["spec"]["versions"] if v["name"] == "v1alpha1"]
    return strict(served["schema"]["openAPIV3Schema"])
