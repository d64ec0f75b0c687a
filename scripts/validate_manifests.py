#!/usr/bin/env python3
"""Validate rendered Kubernetes manifests offline. Driven by scripts/validate-manifests.

usage: validate_manifests.py --servicemonitor-schema FILE --k8s-version V [--k8s-version V...]
                             NAME=RENDERED.yaml [NAME=RENDERED.yaml ...]

Per source (one rendered kustomize build or helm template):
  * every built-in object against the Kubernetes OpenAPI-derived JSON schemas shipped by the
    kubernetes-validate package, in strict mode (unknown fields are errors), for each version;
  * every ServiceMonitor against the vendored (trimmed) CRD schema;
  * any other kind is an error (nothing may go unvalidated);
  * cross-references: each ServiceMonitor selects >= 1 Service (namespace + labels) and each of its
    endpoint ports is a port name of every Service it selects; Service selectors match the
    DaemonSet's pod labels and its targetPorts are container port names; ConfigMap and
    ServiceAccount references resolve; gRPC probes hit the container's grpc port; agent.toml
    parses as TOML and uses only known keys.
Exits 1 if anything fails.
"""

from __future__ import annotations

import argparse
import json
import sys
import tomllib

import jsonschema
import kubernetes_validate
import yaml

# Keys of agent.toml (fixed by the agent's config.rs; see DESIGN.md and deploy/kubernetes/configmap.yaml).
AGENT_TOML_KEYS = {
    "node_name": None, "listen": None, "metrics_listen": None, "data_listen": None,
    "fabric": None, "state_dir": None, "insecure": None,
    "log": {"format", "level"},
    "transfer": {"chunk_size", "depth", "qps", "timeout"},
    "verbs": {"device", "port", "gid_index", "grant_mode"},
    "tls": {"cert", "key", "ca"},
    "limits": {"max_regions", "max_registered_bytes", "max_transfers"},
    "shutdown": {"grace"},
}


def ident(obj: dict) -> str:
    md = obj.get("metadata") or {}
    ns = md.get("namespace")
    return f"{obj.get('kind')}/{(ns + '/') if ns else ''}{md.get('name')}"


def labels_match(selector: dict, labels: dict) -> bool:
    for k, v in (selector.get("matchLabels") or {}).items():
        if labels.get(k) != v:
            return False
    for expr in selector.get("matchExpressions") or []:
        key, op, vals = expr["key"], expr["operator"], expr.get("values") or []
        if op == "In" and labels.get(key) not in vals:
            return False
        if op == "NotIn" and key in labels and labels[key] in vals:
            return False
        if op == "Exists" and key not in labels:
            return False
        if op == "DoesNotExist" and key in labels:
            return False
    return True


class Checker:
    def __init__(self, sm_schema: dict, versions: list[str]):
        self.sm_validator = jsonschema.Draft7Validator(sm_schema)
        self.versions = versions
        self.errors: list[str] = []

    def err(self, source: str, msg: str) -> None:
        self.errors.append(f"[{source}] {msg}")

    def check_source(self, source: str, path: str) -> int:
        with open(path, encoding="utf-8") as f:
            try:
                docs = [d for d in yaml.safe_load_all(f) if d is not None]
            except yaml.YAMLError as e:
                self.err(source, f"YAML parse error: {e}")
                return 0
        if not docs:
            self.err(source, "rendered no objects")
            return 0
        kinds: dict[str, int] = {}
        for obj in docs:
            if not isinstance(obj, dict) or not obj.get("apiVersion") or not obj.get("kind"):
                self.err(source, f"not a Kubernetes object: {str(obj)[:80]!r}")
                continue
            if not (obj.get("metadata") or {}).get("name"):
                self.err(source, f"{obj['kind']} without metadata.name")
            kinds[obj["kind"]] = kinds.get(obj["kind"], 0) + 1
            self.check_schema(source, obj)
        self.check_refs(source, docs)
        summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        print(f"  {source}: {len(docs)} objects ({summary})")
        return len(docs)

    def check_schema(self, source: str, obj: dict) -> None:
        if obj["apiVersion"] == "monitoring.coreos.com/v1" and obj["kind"] == "ServiceMonitor":
            for e in sorted(self.sm_validator.iter_errors(obj), key=lambda e: list(e.path)):
                loc = ".".join(str(p) for p in e.path) or "<root>"
                self.err(source, f"{ident(obj)}: {loc}: {e.message}")
            return
        for version in self.versions:
            try:
                kubernetes_validate.validate(obj, version, strict=True)
            except kubernetes_validate.SchemaNotFoundError:
                self.err(source, f"{ident(obj)}: no schema for {obj['apiVersion']} {obj['kind']} "
                                 f"in Kubernetes {version} (unknown kind, or removed API)")
                return
            except kubernetes_validate.ValidationError as e:
                loc = ".".join(str(p) for p in e.path) or "<root>"
                self.err(source, f"{ident(obj)}: Kubernetes {version}: {loc}: {e.message}")
            except kubernetes_validate.InvalidSchemaError as e:
                self.err(source, f"{ident(obj)}: invalid schema: {e}")

    def check_refs(self, source: str, docs: list[dict]) -> None:
        def of(kind):
            return [d for d in docs if isinstance(d, dict) and d.get("kind") == kind]

        def ns(o):
            return (o.get("metadata") or {}).get("namespace") or "default"

        services, monitors, daemonsets = of("Service"), of("ServiceMonitor"), of("DaemonSet")
        configmaps = {(ns(c), c["metadata"]["name"]): c for c in of("ConfigMap")}
        accounts = {(ns(s), s["metadata"]["name"]) for s in of("ServiceAccount")}
        if not daemonsets:
            self.err(source, "no DaemonSet rendered")

        for sm in monitors:
            spec = sm.get("spec") or {}
            nsel = spec.get("namespaceSelector") or {}
            if nsel.get("any"):
                allowed = None
            else:
                allowed = set(nsel.get("matchNames") or [ns(sm)])
            selected = [s for s in services
                        if (allowed is None or ns(s) in allowed)
                        and labels_match(spec.get("selector") or {}, s["metadata"].get("labels") or {})]
            if not selected:
                self.err(source, f"{ident(sm)}: selects no Service (selector "
                                 f"{json.dumps(spec.get('selector'))}, namespaces {sorted(allowed or [])})")
            for ep in spec.get("endpoints") or []:
                port = ep.get("port")
                for svc in selected:
                    names = {p.get("name") for p in svc["spec"].get("ports") or []}
                    if port not in names:
                        self.err(source, f"{ident(sm)}: endpoint port {port!r} is not a port name of "
                                         f"{ident(svc)} (has {sorted(n for n in names if n)})")
            if selected:
                ports = [ep.get("port") for ep in spec.get("endpoints") or []]
                print(f"    {ident(sm)} -> {', '.join(ident(s) for s in selected)} port(s) {ports}: ok")

        for ds in daemonsets:
            tmpl = ds["spec"]["template"]
            pod_labels = tmpl["metadata"].get("labels") or {}
            pod = tmpl["spec"]
            if not labels_match(ds["spec"]["selector"], pod_labels):
                self.err(source, f"{ident(ds)}: spec.selector does not match the pod template labels")
            sa = pod.get("serviceAccountName")
            if sa and (ns(ds), sa) not in accounts:
                self.err(source, f"{ident(ds)}: serviceAccountName {sa!r} is not rendered here")
            if not pod.get("hostNetwork") or pod.get("dnsPolicy") != "ClusterFirstWithHostNet":
                self.err(source, f"{ident(ds)}: expected hostNetwork: true with dnsPolicy ClusterFirstWithHostNet")
            for vol in pod.get("volumes") or []:
                cm = (vol.get("configMap") or {}).get("name")
                if cm:
                    if (ns(ds), cm) not in configmaps:
                        self.err(source, f"{ident(ds)}: volume {vol['name']!r} refers to missing ConfigMap {cm!r}")
                    else:
                        self.check_agent_toml(source, configmaps[(ns(ds), cm)])
            cports = {}
            for c in pod["containers"]:
                for p in c.get("ports") or []:
                    cports[p.get("name")] = p["containerPort"]
                caps = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
                if "IPC_LOCK" not in caps:
                    self.err(source, f"{ident(ds)}: container {c['name']} lacks capability IPC_LOCK")
                for probe in ("readinessProbe", "livenessProbe"):
                    g = (c.get(probe) or {}).get("grpc")
                    if not g:
                        self.err(source, f"{ident(ds)}: container {c['name']} has no gRPC {probe}")
                    elif g.get("port") != cports.get("grpc"):
                        self.err(source, f"{ident(ds)}: {probe} port {g.get('port')} != grpc port {cports.get('grpc')}")
            for svc in services:
                if ns(svc) != ns(ds) or not svc["spec"].get("selector"):
                    continue
                if not labels_match({"matchLabels": svc["spec"]["selector"]}, pod_labels):
                    self.err(source, f"{ident(svc)}: selector does not match {ident(ds)} pod labels")
                    continue
                for p in svc["spec"].get("ports") or []:
                    tp = p.get("targetPort", p.get("port"))
                    if isinstance(tp, str) and tp not in cports:
                        self.err(source, f"{ident(svc)}: targetPort {tp!r} is not a container port name of {ident(ds)}")
                    if isinstance(tp, int) and tp not in cports.values():
                        self.err(source, f"{ident(svc)}: targetPort {tp} is not a container port of {ident(ds)}")

    def check_agent_toml(self, source: str, cm: dict) -> None:
        text = (cm.get("data") or {}).get("agent.toml")
        if text is None:
            self.err(source, f"{ident(cm)}: no agent.toml key")
            return
        try:
            conf = tomllib.loads(text)
        except tomllib.TOMLDecodeError as e:
            self.err(source, f"{ident(cm)}: agent.toml is not valid TOML: {e}")
            return
        for key, val in conf.items():
            if key not in AGENT_TOML_KEYS:
                self.err(source, f"{ident(cm)}: agent.toml: unknown key {key!r}")
            elif AGENT_TOML_KEYS[key] is None:
                if isinstance(val, dict):
                    self.err(source, f"{ident(cm)}: agent.toml: {key!r} must be a value, not a table")
            elif not isinstance(val, dict):
                self.err(source, f"{ident(cm)}: agent.toml: {key!r} must be a table")
            else:
                for sub in val:
                    if sub not in AGENT_TOML_KEYS[key]:
                        self.err(source, f"{ident(cm)}: agent.toml: unknown key {key}.{sub}")
        for key in ("depth", "qps", "max_regions", "max_transfers", "port", "gid_index"):
            for table in conf.values():
                if isinstance(table, dict) and key in table and not isinstance(table[key], int):
                    self.err(source, f"{ident(cm)}: agent.toml: {key} must be an integer, got {table[key]!r}")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--servicemonitor-schema", required=True)
    ap.add_argument("--k8s-version", action="append", required=True)
    ap.add_argument("sources", nargs="+", metavar="NAME=FILE")
    args = ap.parse_args()
    with open(args.servicemonitor_schema, encoding="utf-8") as f:
        sm_schema = json.load(f)
    jsonschema.Draft7Validator.check_schema(sm_schema)
    checker = Checker(sm_schema, args.k8s_version)
    print(f"validating against Kubernetes {', '.join(args.k8s_version)} (strict) "
          f"+ {args.servicemonitor_schema} for ServiceMonitor")
    total = 0
    for spec in args.sources:
        name, _, path = spec.partition("=")
        total += checker.check_source(name, path)
    if checker.errors:
        print(f"\nFAILED: {len(checker.errors)} problem(s):", file=sys.stderr)
        for e in checker.errors:
            print(f"  {e}", file=sys.stderr)
        return 1
    print(f"OK: {total} objects from {len(args.sources)} sources valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
