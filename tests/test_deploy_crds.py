"""Custom resources in deploy/k8s: JobSet (the learner gang), KEDA's ScaledObject and
TriggerAuthentication, Kueue's LocalQueue, the Prometheus Operator's PodMonitor and
PrometheusRule, cert-manager's Issuer and Certificate. kubernetes-validate has no schemas
for them, so each is checked against the minimal schema below (the fields these manifests
use, their types and enums, nothing unknown), and a JobSet's Job template is validated
strictly as a batch/v1 Job."""

from __future__ import annotations

from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from deploy_tools import DEPLOY, K8S_VERSION, by_key, kustomize

_str = {"type": "string", "minLength": 1}
_int = {"type": "integer", "minimum": 0}
_meta = {"type": "object", "required": ["name"], "properties": {"name": _str}}
_strings = {"type": "array", "items": _str}


def _object(required: list[str], properties: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": required,
        "additionalProperties": False,
        "properties": properties,
    }


def _resource(api_version: str, spec: dict[str, Any]) -> dict[str, Any]:
    return {
        "type": "object",
        "required": ["apiVersion", "kind", "metadata", "spec"],
        "properties": {"apiVersion": {"const": api_version}, "metadata": _meta, "spec": spec},
    }


SCALED_OBJECT = _resource(
    "keda.sh/v1alpha1",
    _object(
        ["scaleTargetRef", "triggers"],
        {
            "scaleTargetRef": _object(["name"], {"apiVersion": _str, "kind": _str, "name": _str}),
            "idleReplicaCount": _int,
            "minReplicaCount": _int,
            "maxReplicaCount": {"type": "integer", "minimum": 1},
            "pollingInterval": _int,
            "cooldownPeriod": _int,
            "advanced": {"type": "object"},
            "triggers": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    ["type", "metadata"],
                    {
                        "type": _str,
                        "authenticationRef": _meta,
                        "metadata": {"type": "object", "additionalProperties": {"type": "string"}},
                    },
                ),
            },
        },
    ),
)
TRIGGER_AUTH = _resource(
    "keda.sh/v1alpha1",
    _object(
        [],
        {
            "secretTargetRef": {
                "type": "array",
                "items": _object(
                    ["parameter", "name", "key"], {"parameter": _str, "name": _str, "key": _str}
                ),
            }
        },
    ),
)
JOBSET = _resource(  # jobset.x-k8s.io/v1alpha2 (JobSet >= 0.6: failurePolicy.rules)
    "jobset.x-k8s.io/v1alpha2",
    _object(
        ["replicatedJobs"],
        {
            "network": _object(
                [],
                {
                    "enableDNSHostnames": {"type": "boolean"},
                    "subdomain": _str,
                    "publishNotReadyAddresses": {"type": "boolean"},
                },
            ),
            "failurePolicy": _object(
                [],
                {
                    "maxRestarts": _int,
                    "restartStrategy": {"enum": ["Recreate", "BlockingRecreate"]},
                    "rules": {
                        "type": "array",
                        "items": _object(
                            ["name", "action"],
                            {
                                "name": _str,
                                "action": {
                                    "enum": [
                                        "FailJobSet",
                                        "RestartJobSet",
                                        "RestartJobSetAndIgnoreMaxRestarts",
                                    ]
                                },
                                "onJobFailureReasons": _strings,
                                "targetReplicatedJobs": _strings,
                            },
                        ),
                    },
                },
            ),
            "successPolicy": _object(
                ["operator"],
                {"operator": {"enum": ["All", "Any"]}, "targetReplicatedJobs": _strings},
            ),
            "startupPolicy": {"type": "object"},
            "suspend": {"type": "boolean"},
            "ttlSecondsAfterFinished": _int,
            "replicatedJobs": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    ["name", "template"],
                    {
                        "name": _str,
                        "replicas": {"type": "integer", "minimum": 1},
                        "template": _object(
                            ["spec"], {"metadata": {"type": "object"}, "spec": {"type": "object"}}
                        ),
                    },
                ),
            },
        },
    ),
)
_selector = _object(
    [],
    {
        "matchLabels": {"type": "object", "additionalProperties": {"type": "string"}},
        "matchExpressions": {
            "type": "array",
            "items": _object(
                ["key", "operator"],
                {
                    "key": _str,
                    "operator": {"enum": ["In", "NotIn", "Exists", "DoesNotExist"]},
                    "values": _strings,
                },
            ),
        },
    },
)
LOCAL_QUEUE = _resource("kueue.x-k8s.io/v1beta1", _object(["clusterQueue"], {"clusterQueue": _str}))
_relabeling = _object(
    [],
    {
        "sourceLabels": _strings,
        "targetLabel": _str,
        "replacement": {"type": "string"},
        "regex": _str,
        "action": _str,
    },
)
POD_MONITOR = _resource(  # monitoring.coreos.com/v1 (Prometheus Operator)
    "monitoring.coreos.com/v1",
    _object(
        ["selector", "podMetricsEndpoints"],
        {
            "selector": _selector,
            "namespaceSelector": {"type": "object"},
            "podMetricsEndpoints": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    ["port"],
                    {
                        "port": _str,
                        "path": _str,
                        "interval": {"type": "string", "pattern": r"^[0-9]+[smh]$"},
                        "relabelings": {"type": "array", "items": _relabeling},
                    },
                ),
            },
        },
    ),
)
_rule = _object(
    ["expr"],
    {
        "alert": _str,
        "record": _str,
        "expr": _str,
        "for": _str,
        "labels": {"type": "object"},
        "annotations": {"type": "object"},
    },
)
PROMETHEUS_RULE = _resource(
    "monitoring.coreos.com/v1",
    _object(
        ["groups"],
        {
            "groups": {
                "type": "array",
                "minItems": 1,
                "items": _object(
                    ["name", "rules"],
                    {"name": _str, "interval": _str, "rules": {"type": "array", "items": _rule}},
                ),
            }
        },
    ),
)
_issuer_ref = _object(["name"], {"name": _str, "kind": {"enum": ["Issuer", "ClusterIssuer"]}})
CERTIFICATE = _resource(  # cert-manager.io/v1
    "cert-manager.io/v1",
    _object(
        ["secretName", "issuerRef"],
        {
            "secretName": _str,
            "issuerRef": _issuer_ref,
            "isCA": {"type": "boolean"},
            "commonName": _str,
            "dnsNames": _strings,
            "usages": {
                "type": "array",
                "items": {
                    "enum": [
                        "server auth",
                        "client auth",
                        "digital signature",
                        "key encipherment",
                        "cert sign",
                    ]
                },
            },
            "duration": {"type": "string", "pattern": "^[0-9]+h$"},
            "renewBefore": {"type": "string", "pattern": "^[0-9]+h$"},
            "privateKey": _object(
                [],
                {
                    "algorithm": {"enum": ["RSA", "ECDSA", "Ed25519"]},
                    "size": _int,
                    "rotationPolicy": {"enum": ["Never", "Always"]},
                },
            ),
        },
    ),
)
ISSUER = _resource(
    "cert-manager.io/v1",
    {
        "type": "object",
        "minProperties": 1,
        "maxProperties": 1,
        "additionalProperties": False,
        "properties": {
            "selfSigned": {"type": "object"},
            "ca": _object(["secretName"], {"secretName": _str}),
        },
    },
)
SCHEMAS = {
    "Certificate": CERTIFICATE,
    "Issuer": ISSUER,
    "ScaledObject": SCALED_OBJECT,
    "TriggerAuthentication": TRIGGER_AUTH,
    "JobSet": JOBSET,
    "LocalQueue": LOCAL_QUEUE,
    "PodMonitor": POD_MONITOR,
    "PrometheusRule": PROMETHEUS_RULE,
}


def job_of(jobset: dict[str, Any], index: int) -> dict[str, Any]:
    """The batch/v1 Job a JobSet's replicated Job `index` stamps out."""
    template = jobset["spec"]["replicatedJobs"][index]["template"]
    name = f"{jobset['metadata']['name']}-{jobset['spec']['replicatedJobs'][index]['name']}-0"
    metadata = {**template.get("metadata", {}), "name": name}
    return {"apiVersion": "batch/v1", "kind": "Job", "metadata": metadata, "spec": template["spec"]}


def validate_crd(obj: dict[str, Any], version: str) -> bool:
    """Validate a custom resource (False: not one, left to kubernetes-validate)."""
    schema = SCHEMAS.get(obj["kind"])
    if schema is None:
        return False
    jsonschema.validate(obj, schema)
    if obj["kind"] == "JobSet":
        for index in range(len(obj["spec"]["replicatedJobs"])):
            kubernetes_validate.validate(job_of(obj, index), version, strict=True)
    return True


def test_the_schemas_reject_what_the_controllers_would() -> None:
    objects = by_key(kustomize(DEPLOY / "k8s" / "overlays" / "single-node-keda"))
    scaled, jobset = objects[("ScaledObject", "rollout")], objects[("JobSet", "learner")]
    broken_scaled = [
        {**scaled, "spec": {**scaled["spec"], "maxReplicas": 4}},  # the HPA's spelling
        {**scaled, "spec": {**scaled["spec"], "triggers": []}},
        {
            **scaled,
            "spec": {
                **scaled["spec"],
                "triggers": [{"type": "redis-streams", "metadata": {"streamLength": 8}}],
            },
        },  # not a string
    ]
    policy = jobset["spec"]["failurePolicy"]
    broken_jobsets = [
        {**jobset, "spec": {**jobset["spec"], "failurePolicy": {**policy, "restartStrategy": "x"}}},
        {**jobset, "spec": {**jobset["spec"], "replicatedJob": []}},
    ]
    for obj in broken_scaled + broken_jobsets:
        with pytest.raises(jsonschema.ValidationError):
            validate_crd(obj, K8S_VERSION)
    job = jobset["spec"]["replicatedJobs"][0]["template"]["spec"]
    bad_job = {
        **job,
        "template": {**job["template"], "spec": {**job["template"]["spec"], "restartPolicy": 3}},
    }
    bad = {
        **jobset,
        "spec": {
            **jobset["spec"],
            "replicatedJobs": [
                {**jobset["spec"]["replicatedJobs"][0], "template": {"spec": bad_job}}
            ],
        },
    }
    with pytest.raises(kubernetes_validate.ValidationError):
        validate_crd(bad, K8S_VERSION)
