"""What each pod of deploy/kubernetes/elasticps.yaml would run, read from the manifest.

No Kubernetes API server is available to the tests, so they run each pod's command line and
environment themselves (on network-namespace hosts named like the pods). This module is the
bridge: it loads the multi-document manifest, finds the StatefulSet, its headless Service and
the Secret, and for pod ordinal ``i`` returns what Kubernetes would start::

    for pod in pod_commands(REPO / "deploy/kubernetes/elasticps.yaml"):
        pod.name      # "elasticps-0"
        pod.dns_name  # "elasticps-0.elasticps.default.svc.cluster.local"
        pod.argv      # command + args, with $(VAR) expanded as Kubernetes does
        pod.env       # the container's env: values, fieldRef, secretKeyRef resolved
        pod.workdir   # the container's workingDir

It understands only what the manifest uses and raises ``ValueError`` naming the field on
anything else (an ``envFrom``, a ``valueFrom`` kind it does not resolve, a second container,
a pod-spec field that would change names or the environment...), so the manifest cannot drift
away from what the tests run without them failing.
"""

from __future__ import annotations

import base64
import binascii
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Mapping, Optional, Union

import yaml

#: The cluster's DNS domain (kubelet --cluster-domain); the default of every distribution.
CLUSTER_DOMAIN = "cluster.local"

#: StatefulSet spec fields read here.
STATEFULSET_FIELDS = {"serviceName", "replicas", "selector", "template"}
#: StatefulSet spec fields that change neither the pods' names nor what they run
#: (``ordinals`` would: it is refused).
IGNORED_STATEFULSET_FIELDS = {
    "podManagementPolicy",
    "updateStrategy",
    "revisionHistoryLimit",
    "minReadySeconds",
    "persistentVolumeClaimRetentionPolicy",
    "volumeClaimTemplates",
}

#: Container fields that change nothing about the process started or its environment.
IGNORED_CONTAINER_FIELDS = {
    "name",
    "image",
    "imagePullPolicy",
    "ports",
    "resources",
    "readinessProbe",
    "livenessProbe",
    "startupProbe",
    "terminationMessagePath",
    "terminationMessagePolicy",
    "securityContext",
    "volumeMounts",
}
#: Container fields read here.
CONTAINER_FIELDS = {"command", "args", "env", "workingDir"}

#: Pod-spec fields that change neither the pods' names nor their processes.
IGNORED_POD_FIELDS = {
    "terminationGracePeriodSeconds",
    "securityContext",
    "nodeSelector",
    "affinity",
    "tolerations",
    "topologySpreadConstraints",
    "serviceAccountName",
    "imagePullSecrets",
    "priorityClassName",
    "volumes",
}
#: Pod-spec fields read here.
POD_FIELDS = {"containers", "enableServiceLinks"}


@dataclass(frozen=True)
class PodCommand:
    """What one pod of the StatefulSet runs."""

    #: The pod's ordinal, 0..replicas-1.
    ordinal: int
    #: The pod's name, which is also its hostname: ``elasticps-0``.
    name: str
    #: Its stable DNS name through the headless Service.
    dns_name: str
    #: The container's command followed by its args, after ``$(VAR)`` expansion.
    argv: List[str]
    #: The container's environment as its ``env`` list defines it (in order; values resolved).
    env: Dict[str, str]
    #: The container's working directory (None: the image's).
    workdir: Optional[str]


def expand(text: str, env: Mapping[str, str]) -> str:
    """Kubernetes' ``$(VAR)`` expansion (third_party/forked/golang/expansion in kubernetes).

    ``$(VAR)`` becomes ``env[VAR]`` when VAR is defined and stays ``$(VAR)`` when it is not;
    ``$$`` becomes ``$`` (so ``$$(VAR)`` is the literal ``$(VAR)``); any other ``$`` (``$x``,
    a trailing ``$``, a ``$(`` with no ``)``) stays as it is.
    """
    out = []
    i = 0
    n = len(text)
    while i < n:
        c = text[i]
        if c != "$" or i + 1 == n:
            out.append(c)
            i += 1
            continue
        nxt = text[i + 1]
        if nxt == "$":
            out.append("$")
            i += 2
        elif nxt == "(":
            close = text.find(")", i + 2)
            if close < 0:
                # An unterminated reference: "$(" copied, the rest scanned as usual.
                out.append("$(")
                i += 2
            else:
                name = text[i + 2 : close]
                out.append(env[name] if name in env else f"$({name})")
                i = close + 1
        else:
            out.append("$" + nxt)
            i += 2
    return "".join(out)


def load_documents(manifest_path: Union[str, Path]) -> List[Dict[str, Any]]:
    """The manifest's documents (empty documents dropped), each checked to be a mapping."""
    with open(manifest_path, encoding="utf-8") as f:
        docs = [d for d in yaml.safe_load_all(f) if d is not None]
    for i, d in enumerate(docs):
        if not isinstance(d, dict) or "kind" not in d:
            raise ValueError(f"{manifest_path}: document {i} is not a Kubernetes object (no kind)")
    return docs


def _only(docs: List[Dict[str, Any]], kind: str, name: Optional[str] = None) -> Dict[str, Any]:
    found = [d for d in docs if d.get("kind") == kind and (name is None or _name(d) == name)]
    what = kind if name is None else f"{kind} {name!r}"
    if len(found) != 1:
        raise ValueError(f"manifest: expected exactly one {what}, found {len(found)}")
    return found[0]


def _name(obj: Dict[str, Any]) -> str:
    name = (obj.get("metadata") or {}).get("name")
    if not isinstance(name, str) or not name:
        raise ValueError(f"{obj.get('kind')}: metadata.name is missing")
    return name


def _check_namespace(obj: Dict[str, Any], namespace: str) -> None:
    ns = (obj.get("metadata") or {}).get("namespace")
    if ns is not None and ns != namespace:
        raise ValueError(f"{obj['kind']} {_name(obj)}: metadata.namespace is {ns!r}, not {namespace!r}")


def _check_fields(where: str, obj: Dict[str, Any], known: set, ignored: set) -> None:
    for key in obj:
        if key not in known and key not in ignored:
            raise ValueError(f"{where}.{key}: not understood by k8s_manifest")


def secret_value(docs: List[Dict[str, Any]], name: str, key: str) -> str:
    """``stringData[key]`` (which wins, as on the API server) or base64-decoded ``data[key]`` of
    the manifest's Secret ``name``."""
    secret = _only(docs, "Secret", name)
    string_data = secret.get("stringData") or {}
    data = secret.get("data") or {}
    if key in string_data:
        value = string_data[key]
        if not isinstance(value, str):
            raise ValueError(f"Secret {name}: stringData.{key} is not a string")
        return value
    if key in data:
        try:
            return base64.b64decode(str(data[key]), validate=True).decode("utf-8")
        except (binascii.Error, UnicodeDecodeError) as e:
            raise ValueError(f"Secret {name}: data.{key} is not base64 of UTF-8 text: {e}") from None
    raise ValueError(f"Secret {name}: no key {key!r} in stringData or data")


def resolve_env(
    env_list: Optional[List[Dict[str, Any]]],
    docs: List[Dict[str, Any]],
    pod_name: str,
    namespace: str,
    secret: Optional[str] = None,
    where: str = "env",
) -> Dict[str, str]:
    """A container's ``env`` list as Kubernetes resolves it, in order: ``value`` is expanded
    with the variables defined before it; ``fieldRef`` metadata.name / metadata.namespace and
    ``secretKeyRef`` (from the manifest, or ``secret`` for every one) are taken verbatim; a
    later entry of the same name replaces the earlier one."""
    env: Dict[str, str] = {}
    for i, entry in enumerate(env_list or []):
        at = f"{where}[{i}]"
        if not isinstance(entry, dict) or not isinstance(entry.get("name"), str):
            raise ValueError(f"{at}.name: missing")
        _check_fields(at, entry, {"name", "value", "valueFrom"}, set())
        name = entry["name"]
        if "value" in entry and "valueFrom" in entry:
            raise ValueError(f"{at} ({name}): both value and valueFrom")
        if "valueFrom" in entry:
            env[name] = _value_from(entry["valueFrom"], docs, pod_name, namespace, secret, f"{at}.valueFrom", name)
        else:
            value = entry.get("value", "")
            if not isinstance(value, str):
                raise ValueError(f"{at}.value ({name}): not a string (quote it in the YAML)")
            env[name] = expand(value, env)
    return env


def _value_from(
    source: Any,
    docs: List[Dict[str, Any]],
    pod_name: str,
    namespace: str,
    secret: Optional[str],
    at: str,
    name: str,
) -> str:
    if not isinstance(source, dict) or len(source) != 1:
        raise ValueError(f"{at} ({name}): expected exactly one source")
    (kind, ref), = source.items()
    if kind == "fieldRef":
        _check_fields(f"{at}.fieldRef", ref, {"fieldPath"}, {"apiVersion"})
        path = ref.get("fieldPath")
        if path == "metadata.name":
            return pod_name
        if path == "metadata.namespace":
            return namespace
        raise ValueError(f"{at}.fieldRef.fieldPath ({name}): {path!r} not understood by k8s_manifest")
    if kind == "secretKeyRef":
        _check_fields(f"{at}.secretKeyRef", ref, {"name", "key"}, set())
        if secret is not None:
            return secret
        return secret_value(docs, ref.get("name"), ref.get("key"))
    raise ValueError(f"{at}.{kind} ({name}): not understood by k8s_manifest")


def pod_commands(
    manifest_path: Union[str, Path],
    replicas: Optional[int] = None,
    namespace: str = "default",
    secret: Optional[str] = None,
) -> List[PodCommand]:
    """What every pod of the manifest's StatefulSet runs, pod 0 first.

    ``replicas`` overrides the StatefulSet's; ``namespace`` is the one it is applied in;
    ``secret`` replaces the value of every ``secretKeyRef`` (default: the manifest's Secret).
    """
    docs = load_documents(manifest_path)
    sts = _only(docs, "StatefulSet")
    sts_name = _name(sts)
    _check_namespace(sts, namespace)
    spec = sts.get("spec") or {}
    _check_fields("spec", spec, STATEFULSET_FIELDS, IGNORED_STATEFULSET_FIELDS)

    service_name = spec.get("serviceName")
    if not isinstance(service_name, str):
        raise ValueError(f"StatefulSet {sts_name}: spec.serviceName is missing")
    service = _only(docs, "Service", service_name)
    _check_namespace(service, namespace)
    svc_spec = service.get("spec") or {}
    if svc_spec.get("clusterIP") != "None":
        raise ValueError(f"Service {service_name}: spec.clusterIP must be None (headless) for pod DNS names")

    template = spec.get("template") or {}
    labels = (template.get("metadata") or {}).get("labels") or {}
    _check_fields("spec.selector", spec.get("selector") or {}, {"matchLabels"}, set())
    selector = (spec.get("selector") or {}).get("matchLabels")
    for where, sel in (
        (f"StatefulSet {sts_name}: spec.selector.matchLabels", selector),
        (f"Service {service_name}: spec.selector", svc_spec.get("selector") or {}),
    ):
        if not sel or any(labels.get(k) != v for k, v in sel.items()):
            raise ValueError(f"{where} {sel} does not select the pod template's labels {labels}")

    if replicas is None:
        replicas = spec.get("replicas", 1)
    if not isinstance(replicas, int) or replicas < 0:
        raise ValueError(f"StatefulSet {sts_name}: spec.replicas {replicas!r} is not a count")

    _check_fields("spec.template.metadata", template.get("metadata") or {}, {"labels"}, {"annotations"})
    pod_spec = template.get("spec") or {}
    _check_fields("spec.template.spec", pod_spec, POD_FIELDS, IGNORED_POD_FIELDS)
    if pod_spec.get("enableServiceLinks") is not False:
        # Otherwise Kubernetes adds other Services' variables to the environment (and to
        # what $(VAR) expands), which this reader cannot know.
        raise ValueError("spec.template.spec.enableServiceLinks: must be false")
    containers = pod_spec.get("containers") or []
    if len(containers) != 1:
        raise ValueError(f"spec.template.spec.containers: expected exactly one container, found {len(containers)}")
    container = containers[0]
    _check_fields("spec.template.spec.containers[0]", container, CONTAINER_FIELDS, IGNORED_CONTAINER_FIELDS)
    command = container.get("command")
    if not command:
        raise ValueError("spec.template.spec.containers[0].command: missing (the image's entrypoint is unknown here)")
    argv_template = list(command) + list(container.get("args") or [])
    for j, a in enumerate(argv_template):
        if not isinstance(a, str):
            raise ValueError(f"spec.template.spec.containers[0].command/args[{j}]: {a!r} is not a string (quote it)")
    workdir = container.get("workingDir")

    pods = []
    for i in range(replicas):
        pod_name = f"{sts_name}-{i}"
        env = resolve_env(
            container.get("env"),
            docs,
            pod_name,
            namespace,
            secret,
            where="spec.template.spec.containers[0].env",
        )
        pods.append(
            PodCommand(
                ordinal=i,
                name=pod_name,
                dns_name=f"{pod_name}.{service_name}.{namespace}.svc.{CLUSTER_DOMAIN}",
                argv=[expand(a, env) for a in argv_template],
                env=env,
                workdir=workdir,
            )
        )
    return pods


if __name__ == "__main__":
    import json
    import sys

    path = sys.argv[1] if len(sys.argv) > 1 else Path(__file__).resolve().parents[2] / "deploy/kubernetes/elasticps.yaml"
    for pod in pod_commands(path):
        print(json.dumps({"name": pod.name, "dns_name": pod.dns_name, "argv": pod.argv, "env": pod.env, "workdir": pod.workdir}))
