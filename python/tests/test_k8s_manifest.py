"""Unit tests of k8s_manifest, the reader of deploy/kubernetes/elasticps.yaml: Kubernetes'
$(VAR) expansion, the environment's resolution (values, fieldRef, secrets) and the refusal of
anything it does not understand. No cluster and no elasticps binary needed."""

from __future__ import annotations

import base64
import copy

import pytest
import yaml

from conftest import REPO
from k8s_manifest import expand, pod_commands, resolve_env

MANIFEST = REPO / "deploy" / "kubernetes" / "elasticps.yaml"


def manifest_docs():
    with open(MANIFEST, encoding="utf-8") as f:
        return [d for d in yaml.safe_load_all(f) if d is not None]


def kind(docs, k):
    (doc,) = [d for d in docs if d["kind"] == k]
    return doc


def container(docs):
    return kind(docs, "StatefulSet")["spec"]["template"]["spec"]["containers"][0]


def write(tmp_path, docs):
    path = tmp_path / "manifest.yaml"
    path.write_text(yaml.safe_dump_all(docs), encoding="utf-8")
    return path


# --- $(VAR) expansion, as kubernetes/third_party/forked/golang/expansion does it -------------


@pytest.mark.parametrize(
    "text, expected",
    [
        ("$(A)", "alpha"),
        ("x$(A)y$(B)z", "xalphaybetaz"),
        ("$(A)$(A)", "alphaalpha"),
        # Unknown variables are left as they are.
        ("$(MISSING)", "$(MISSING)"),
        ("$(A)-$(MISSING)", "alpha-$(MISSING)"),
        ("$()", "$()"),
        # $$ escapes: one $, and $$(A) is the literal $(A).
        ("$$", "$"),
        ("$$(A)", "$(A)"),
        ("$$$(A)", "$alpha"),
        ("$$$$(A)", "$$(A)"),
        # A $ that starts no reference stays.
        ("$A", "$A"),
        ("cost: 5$", "cost: 5$"),
        ("$", "$"),
        ("${A}", "${A}"),
        # An unterminated reference is copied, and scanning goes on after "$(".
        ("$(A", "$(A"),
        ("$(A $$ $(B", "$(A $ $(B"),
        # The name is everything up to the first ")".
        ("$($(A)", "$($(A)"),
        ("$(A))", "alpha)"),
        ("$(A B)", "$(A B)"),
        ("", ""),
        ("no dollars", "no dollars"),
    ],
)
def test_expand(text, expected):
    assert expand(text, {"A": "alpha", "B": "beta"}) == expected


def test_expand_does_not_rescan_substituted_values():
    assert expand("$(A)", {"A": "$(B)", "B": "beta"}) == "$(B)"
    assert expand("$(A)", {"A": "$$"}) == "$$"


def test_env_value_sees_only_earlier_variables():
    env = resolve_env(
        [
            {"name": "LATER_REF", "value": "$(NS)"},
            {"name": "NS", "valueFrom": {"fieldRef": {"fieldPath": "metadata.namespace"}}},
            {"name": "POD", "valueFrom": {"fieldRef": {"fieldPath": "metadata.name"}}},
            {"name": "HOST", "value": "$(POD).svc.$(NS):$(PORT)"},
            {"name": "ESCAPED", "value": "$$(POD)"},
        ],
        docs=[],
        pod_name="elasticps-2",
        namespace="team",
    )
    assert env == {
        "LATER_REF": "$(NS)",
        "NS": "team",
        "POD": "elasticps-2",
        "HOST": "elasticps-2.svc.team:$(PORT)",
        "ESCAPED": "$(POD)",
    }


def test_env_redefinition_replaces_and_valuefrom_is_not_expanded():
    docs = [{"kind": "Secret", "metadata": {"name": "s"}, "stringData": {"k": "$(A)"}}]
    env = resolve_env(
        [
            {"name": "A", "value": "one"},
            {"name": "A", "value": "$(A)-two"},
            {"name": "S", "valueFrom": {"secretKeyRef": {"name": "s", "key": "k"}}},
        ],
        docs=docs,
        pod_name="p",
        namespace="default",
    )
    assert env == {"A": "one-two", "S": "$(A)"}


def test_kubernetes_docs_example():
    # https://kubernetes.io/docs/tasks/inject-data-application/define-interdependent-environment-variables/
    env = resolve_env(
        [
            {"name": "SERVICE_PORT", "value": "80"},
            {"name": "SERVICE_IP", "value": "172.17.0.1"},
            {"name": "UNCHANGED_REFERENCE", "value": "$(PROTOCOL)://$(SERVICE_IP):$(SERVICE_PORT)"},
            {"name": "PROTOCOL", "value": "https"},
            {"name": "SERVICE_ADDRESS", "value": "$(PROTOCOL)://$(SERVICE_IP):$(SERVICE_PORT)"},
            {"name": "ESCAPED_REFERENCE", "value": "$$(PROTOCOL)://$(SERVICE_IP):$(SERVICE_PORT)"},
        ],
        docs=[],
        pod_name="p",
        namespace="default",
    )
    assert env["UNCHANGED_REFERENCE"] == "$(PROTOCOL)://172.17.0.1:80"
    assert env["SERVICE_ADDRESS"] == "https://172.17.0.1:80"
    assert env["ESCAPED_REFERENCE"] == "$(PROTOCOL)://172.17.0.1:80"


# --- the manifest itself ----------------------------------------------------------------------


def test_manifest_pods():
    pods = pod_commands(MANIFEST)
    assert [p.name for p in pods] == [f"elasticps-{i}" for i in range(4)]
    rdzv = f"{pods[0].dns_name}:29400"
    assert pods[0].dns_name == "elasticps-0.elasticps.default.svc.cluster.local"
    for i, p in enumerate(pods):
        assert p.ordinal == i
        assert p.dns_name == f"elasticps-{i}.elasticps.default.svc.cluster.local"
        assert p.argv == [
            "elasticps", "launch", "--nnodes", "4", "--rdzv", rdzv,
            "--servers-per-node", "1", "--workers-per-node", "1", "--sync", "ssp:2",
            "--node-name", p.name, "--quiet",
            "--", "python3", "examples/python/train_mnist_torch.py", "--epochs", "3",
        ]  # fmt: skip
        assert p.env["POD_NAME"] == p.name
        assert p.env["POD_NAMESPACE"] == "default"
        assert p.env["ELASTICPS_SECRET"] == kind(manifest_docs(), "Secret")["stringData"]["secret"]
        assert p.workdir == "/opt/elasticps"
    # The script the pods run is the repository's (workingDir is the repo in the image).
    assert (REPO / pods[0].argv[pods[0].argv.index("python3") + 1]).is_file()


def test_namespace_replicas_and_secret_override():
    pods = pod_commands(MANIFEST, replicas=2, namespace="ml", secret="s3cr3t")
    assert [p.dns_name for p in pods] == [
        "elasticps-0.elasticps.ml.svc.cluster.local",
        "elasticps-1.elasticps.ml.svc.cluster.local",
    ]
    assert pods[1].argv[pods[1].argv.index("--rdzv") + 1] == "elasticps-0.elasticps.ml.svc.cluster.local:29400"
    assert all(p.env["ELASTICPS_SECRET"] == "s3cr3t" for p in pods)


# --- secrets ----------------------------------------------------------------------------------


def test_secret_from_base64_data(tmp_path):
    docs = manifest_docs()
    secret = kind(docs, "Secret")
    del secret["stringData"]
    secret["data"] = {"secret": base64.b64encode(b"from-data").decode()}
    assert pod_commands(write(tmp_path, docs))[0].env["ELASTICPS_SECRET"] == "from-data"


def test_secret_stringdata_wins_over_data(tmp_path):
    docs = manifest_docs()
    secret = kind(docs, "Secret")
    secret["stringData"] = {"secret": "from-stringData"}
    secret["data"] = {"secret": base64.b64encode(b"from-data").decode()}
    assert pod_commands(write(tmp_path, docs))[0].env["ELASTICPS_SECRET"] == "from-stringData"


def test_secret_missing_key_or_bad_base64_raises(tmp_path):
    docs = manifest_docs()
    kind(docs, "Secret")["stringData"] = {"other": "x"}
    with pytest.raises(ValueError, match="no key 'secret'"):
        pod_commands(write(tmp_path, docs))
    kind(docs, "Secret")["data"] = {"secret": "not base64!"}
    with pytest.raises(ValueError, match="data.secret"):
        pod_commands(write(tmp_path, docs))
    docs = [d for d in manifest_docs() if d["kind"] != "Secret"]
    with pytest.raises(ValueError, match="Secret 'elasticps-secret'"):
        pod_commands(write(tmp_path, docs))
    # An override needs no Secret in the manifest.
    assert pod_commands(write(tmp_path, docs), secret="x")[0].env["ELASTICPS_SECRET"] == "x"


# --- what it refuses --------------------------------------------------------------------------


def test_unknown_value_from_kind_raises(tmp_path):
    docs = manifest_docs()
    container(docs)["env"].append({"name": "X", "valueFrom": {"configMapKeyRef": {"name": "c", "key": "k"}}})
    with pytest.raises(ValueError, match=r"env\[4\]\.valueFrom\.configMapKeyRef \(X\)"):
        pod_commands(write(tmp_path, docs))


def test_unknown_field_path_raises(tmp_path):
    docs = manifest_docs()
    container(docs)["env"].append({"name": "IP", "valueFrom": {"fieldRef": {"fieldPath": "status.podIP"}}})
    with pytest.raises(ValueError, match=r"fieldPath \(IP\): 'status.podIP'"):
        pod_commands(write(tmp_path, docs))


@pytest.mark.parametrize(
    "mutate, field",
    [
        (lambda d: container(d).update(envFrom=[{"configMapRef": {"name": "c"}}]), r"containers\[0\]\.envFrom"),
        (lambda d: container(d).update(lifecycle={}), r"containers\[0\]\.lifecycle"),
        (lambda d: container(d).pop("command"), r"containers\[0\]\.command"),
        (lambda d: container(d)["command"].__setitem__(3, 4), r"command/args\[3\]"),
        (lambda d: container(d)["env"][0].update(value="x"), r"env\[0\] \(POD_NAME\): both"),
        (lambda d: container(d)["env"][3].update(value=1), r"env\[3\]\.value \(PYTHONUNBUFFERED\)"),
        (lambda d: pod_spec(d).update(hostname="h"), r"spec\.template\.spec\.hostname"),
        (lambda d: pod_spec(d).pop("enableServiceLinks"), r"enableServiceLinks"),
        (lambda d: pod_spec(d)["containers"].append(copy.deepcopy(container(d))), r"exactly one container"),
        (lambda d: kind(d, "StatefulSet")["spec"].update(ordinals={"start": 1}), r"spec\.ordinals"),
        (lambda d: kind(d, "StatefulSet")["spec"].update(serviceName="other"), r"Service 'other'"),
        (lambda d: kind(d, "Service")["spec"].pop("clusterIP"), r"clusterIP must be None"),
        (lambda d: kind(d, "Service")["spec"].update(selector={"app": "x"}), r"Service elasticps: spec\.selector"),
        (lambda d: kind(d, "StatefulSet")["metadata"].update(namespace="prod"), r"metadata\.namespace"),
        (lambda d: d.append(copy.deepcopy(kind(d, "StatefulSet"))), r"exactly one StatefulSet"),
    ],
)
def test_refuses_what_it_does_not_understand(tmp_path, mutate, field):
    docs = manifest_docs()
    mutate(docs)
    with pytest.raises(ValueError, match=field):
        pod_commands(write(tmp_path, docs))


def pod_spec(docs):
    return kind(docs, "StatefulSet")["spec"]["template"]["spec"]
