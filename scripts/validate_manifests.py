#!/usr/bin/env python3
"""Validate rendered Kubernetes manifests offline. Driven by scripts/validate-manifests.

usage: validate_manifests.py --agent XFER-AGENT --crd-schema FILE [--crd-schema FILE...]
                             --k8s-version V [...] [--plaintext NAME...] [--defaults NAME...]
                             [--no-schema] [--expect-error NAME=TEXT...] NAME=RENDERED.yaml [...]

Per source (one rendered kustomize build, helm template or file of cert-manager objects):
  * every built-in object against the Kubernetes OpenAPI-derived JSON schemas shipped by the
    kubernetes-validate package, in strict mode (unknown fields are errors), for each version;
  * every custom resource (ServiceMonitor, cert-manager Certificate/Issuer) against the vendored,
    trimmed CRD schema given with --crd-schema (matched on its apiVersion/kind consts);
  * any other kind is an error (nothing may go unvalidated);
  * cross-references: each ServiceMonitor selects >= 1 Service (namespace + labels) and each of its
    endpoint ports is a port name of every Service it selects; Service selectors match the
    DaemonSet's pod labels and its targetPorts are container port names; ServiceAccount refs
    resolve; every volumeMount names a volume, every volume is mounted, no mount is nested in
    another; `--config` names a key of a mounted ConfigMap;
  * agent.toml (the ConfigMap the DaemonSet runs with): parses as TOML, and the agent itself
    accepts it: `XFER-AGENT --config agent.toml --print-config` (the agent refuses unknown keys,
    bad types and enum values by name, and a plaintext non-loopback listener without
    allow_plaintext_network), so no key list is kept here; the TLS files are replaced by empty
    stand-ins through XFER_TLS__* (which volume provides them is checked below);
    listen/data_listen/metrics_listen/health_listen ports are the container ports grpc/data/
    metrics/health; every gRPC probe targets health_listen's port (kubelet cannot do mTLS);
    mTLS is on (insecure = false, stated explicitly) unless the source is a declared --plaintext
    opt-in, which must set insecure = true AND allow_plaintext_network = true; a plaintext agent
    with a non-loopback listener without allow_plaintext_network is an error (the agent exits 64);
    with mTLS, tls.cert/key/ca are files that the read-only `tls` volume provides at those paths
    (csi.cert-manager.io attributes or Secret keys), and a csi-driver certificate carries the node
    URI SAN in tls.trust_domain, the DNS SAN tls.server_name, serverAuth + clientAuth;
  * the pod: dnsPolicy ClusterFirstWithHostNet exactly when hostNetwork (else ClusterFirst),
    hostPorts only with hostNetwork (and equal to the container ports), a Multus networks
    annotation only without hostNetwork; Guaranteed QoS (cpu and memory requests == limits in
    every container); the memory limit >= [limits] max_registered_bytes + 1Gi; a system-*
    priorityClassName comes with a ResourceQuota in its namespace scoped to that class;
  * cert-manager objects: Certificates name an Issuer in the same source, CA Issuers a CA
    Certificate's Secret, URI SANs are spiffe://TD/xfer/{node,client,admin}/NAME; across sources,
    the Issuer the --defaults sources' csi volumes use and their trust domain match these objects.
Exits 1 if anything fails.
"""

from __future__ import annotations

import argparse
import ipaddress
import json
import os
import posixpath
import re
import subprocess
import sys
import tempfile
import tomllib

import jsonschema
import kubernetes_validate
import yaml

MULTUS = "k8s.v1.cni.cncf.io/networks"
# Priority classes that clusters may admit only where a ResourceQuota scoped to them exists.
SYSTEM_PRIORITY = ("system-node-critical", "system-cluster-critical")
# Kubernetes quantity suffixes (memory) -> bytes.
QUANTITY = {"": 1, "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12, "P": 10**15, "E": 10**18,
            "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40, "Pi": 2**50, "Ei": 2**60}
# Listener key -> the container port name it must match.
LISTENERS = {"listen": "grpc", "data_listen": "data", "metrics_listen": "metrics", "health_listen": "health"}
ROLES = ("node", "client", "admin")
LABEL = r"[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?"
DNS_NAME = re.compile(rf"^{LABEL}(\.{LABEL})*$")
CSI_DRIVER = "csi.cert-manager.io"
CSI = "csi.cert-manager.io/"
# Variables csi-driver expands in common-name, dns-names and uri-sans (pkg/requestgen/generator.go).
CSI_VARIABLES = {"POD_NAME", "POD_NAMESPACE", "POD_UID", "SERVICE_ACCOUNT_NAME"}
CSI_EXPANDED = ("common-name", "dns-names", "uri-sans")


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


def split_hostport(value) -> tuple[str, int] | None:
    """'0.0.0.0:7470' / '[::]:7470' -> (host, port); None if it is not host:port."""
    if not isinstance(value, str):
        return None
    m = re.fullmatch(r"\[([^\]]+)\]:(\d+)|([^:\[\]]+):(\d+)", value)
    if not m:
        return None
    host = m.group(1) or m.group(3)
    port = int(m.group(2) or m.group(4))
    return (host, port) if 0 < port < 65536 else None


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def under(path: str, mount: str) -> bool:
    path, mount = posixpath.normpath(path), posixpath.normpath(mount)
    return path == mount or path.startswith(mount.rstrip("/") + "/")


def quantity_bytes(q) -> float | None:
    """A Kubernetes memory quantity ('18Gi', '20G', 1073741824) in bytes; None if unparsable."""
    m = re.fullmatch(r"([0-9]+(?:\.[0-9]+)?)([a-zA-Z]*)", str(q))
    return float(m.group(1)) * QUANTITY[m.group(2)] if m and m.group(2) in QUANTITY else None


def size_bytes(s) -> float | None:
    """An agent size ('16GiB', '512MiB', 4096) in bytes, per xfer-common's parse_size: k/m/g/t/p/e
    (with or without i, iB) are binary, KB/MB/... decimal. None if unparsable."""
    m = re.fullmatch(r"([0-9][0-9_]*(?:\.[0-9]+)?)\s*([a-zA-Z]*)", str(s).strip())
    if not m:
        return None
    unit = m.group(2).lower()
    powers = "kmgtpe"
    if unit in ("", "b"):
        mult = 1
    elif len(unit) == 2 and unit[1] == "b" and unit[0] in powers:
        mult = 1000 ** (powers.index(unit[0]) + 1)
    elif unit[:1] in powers and unit[1:] in ("", "i", "ib"):
        mult = 1024 ** (powers.index(unit[0]) + 1)
    else:
        return None
    return float(m.group(1).replace("_", "")) * mult


def csv(value) -> list[str]:
    return [s.strip() for s in str(value or "").split(",") if s.strip()]


def spiffe(uri: str) -> tuple[str, str, str] | None:
    """spiffe://TD/xfer/ROLE/NAME -> (TD, ROLE, NAME)."""
    m = re.fullmatch(r"spiffe://([^/]+)/xfer/([a-z]+)/([^/]+)", uri)
    return (m.group(1), m.group(2), m.group(3)) if m else None


class Checker:
    def __init__(self, crd_schemas: list[dict], versions: list[str], plaintext: set[str], defaults: set[str],
                 schema: bool, agent: str):
        self.crd = {}
        for s in crd_schemas:
            props = s["properties"]
            self.crd[(props["apiVersion"]["const"], props["kind"]["const"])] = jsonschema.Draft7Validator(s)
        self.versions = versions
        self.plaintext = plaintext
        self.defaults = defaults
        self.schema = schema
        self.agent = agent
        self.errors: list[str] = []
        self.notes: list[str] = []  # what each source was found to do, printed under its summary
        # For the cross-source checks: (source, issuer kind, issuer name, trust domain) of every
        # csi-driver volume, and every cert-manager object.
        self.csi_uses: list[tuple[str, str, str, str]] = []
        self.cm_objects: list[tuple[str, dict]] = []

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
            if self.schema:
                self.check_schema(source, obj)
        docs = [d for d in docs if isinstance(d, dict)]
        # Files users apply on their own (cert-manager objects, the chart's namespace, the example
        # application pod) are checked against the schemas only: no DaemonSet to wire up.
        if not all(d.get("apiVersion") == "cert-manager.io/v1" or d.get("kind") in ("Namespace", "Pod") for d in docs):
            self.check_refs(source, docs)
        self.check_cert_manager(source, docs)
        summary = ", ".join(f"{n} {k}" for k, n in sorted(kinds.items()))
        print(f"  {source}: {len(docs)} objects ({summary})")
        for note in self.notes:
            print(f"    {note}")
        self.notes.clear()
        return len(docs)

    def check_schema(self, source: str, obj: dict) -> None:
        crd = self.crd.get((obj["apiVersion"], obj["kind"]))
        if crd is not None:
            for e in sorted(crd.iter_errors(obj), key=lambda e: list(e.path)):
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
            return [d for d in docs if d.get("kind") == kind]

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
                self.notes.append(f"{ident(sm)} -> {', '.join(ident(s) for s in selected)} port(s) {ports}: ok")

        for ds in daemonsets:
            tmpl = ds["spec"]["template"]
            pod_labels = tmpl["metadata"].get("labels") or {}
            pod = tmpl["spec"]
            if not labels_match(ds["spec"]["selector"], pod_labels):
                self.err(source, f"{ident(ds)}: spec.selector does not match the pod template labels")
            sa = pod.get("serviceAccountName")
            if sa and (ns(ds), sa) not in accounts:
                self.err(source, f"{ident(ds)}: serviceAccountName {sa!r} is not rendered here")
            self.check_pod_network(source, ds, tmpl)
            self.check_qos(source, ds, pod)
            prio = pod.get("priorityClassName")
            if prio in SYSTEM_PRIORITY and not any(
                    ns(q) == ns(ds) and quota_admits(q, prio) for q in of("ResourceQuota")):
                self.err(source, f"{ident(ds)}: priorityClassName {prio} but no ResourceQuota in {ns(ds)} scoped to "
                                 f"it: clusters that limit system-* classes (GKE by default) refuse the pods")
            volumes = {v["name"]: v for v in pod.get("volumes") or []}
            for vol in volumes.values():
                cm = (vol.get("configMap") or {}).get("name")
                if cm and (ns(ds), cm) not in configmaps:
                    self.err(source, f"{ident(ds)}: volume {vol['name']!r} refers to missing ConfigMap {cm!r}")
            mounted = set()
            cports = {}
            for c in pod["containers"]:
                mounts = c.get("volumeMounts") or []
                for m in mounts:
                    mounted.add(m["name"])
                    if m["name"] not in volumes:
                        self.err(source, f"{ident(ds)}: container {c['name']} mounts {m['name']!r}, which is not a volume")
                    for other in mounts:
                        if other is not m and under(m["mountPath"], other["mountPath"]):
                            self.err(source, f"{ident(ds)}: mount {m['name']!r} ({m['mountPath']}) is nested in "
                                             f"{other['name']!r} ({other['mountPath']}): its mount point cannot be created")
                for p in c.get("ports") or []:
                    cports[p.get("name")] = p["containerPort"]
                caps = ((c.get("securityContext") or {}).get("capabilities") or {}).get("add") or []
                if "IPC_LOCK" not in caps:
                    self.err(source, f"{ident(ds)}: container {c['name']} lacks capability IPC_LOCK")
            for name in volumes:
                if name not in mounted:
                    self.err(source, f"{ident(ds)}: volume {name!r} is mounted by no container")
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
            agent = pod["containers"][0]
            conf = self.agent_config(source, ds, agent, volumes, configmaps, ns(ds))
            if conf is not None:
                self.check_agent_conf(source, ds, agent, volumes, conf)
                self.check_memory(source, ds, agent, conf)

    def check_pod_network(self, source: str, ds: dict, tmpl: dict) -> None:
        pod = tmpl["spec"]
        host = pod.get("hostNetwork") is True
        dns = pod.get("dnsPolicy", "ClusterFirst")
        want = "ClusterFirstWithHostNet" if host else "ClusterFirst"
        if dns != want:
            self.err(source, f"{ident(ds)}: dnsPolicy {dns} with hostNetwork {host}: want {want} "
                             f"(ClusterFirstWithHostNet only with hostNetwork; else cluster DNS is lost or unused)")
        for c in pod.get("containers") or []:
            for p in c.get("ports") or []:
                if "hostPort" not in p:
                    continue
                if not host:
                    self.err(source, f"{ident(ds)}: port {p.get('name')} has hostPort {p['hostPort']} without "
                                     f"hostNetwork: the agent has its own pod address there")
                elif p["hostPort"] != p["containerPort"]:
                    self.err(source, f"{ident(ds)}: port {p.get('name')}: hostPort {p['hostPort']} != containerPort "
                                     f"{p['containerPort']} (required with hostNetwork)")
        networks = ((tmpl.get("metadata") or {}).get("annotations") or {}).get(MULTUS)
        if networks is not None:
            if host:
                self.err(source, f"{ident(ds)}: {MULTUS} with hostNetwork: true: Multus ignores hostNetwork pods")
            value = networks.strip()
            if value.startswith("["):
                try:
                    sel = json.loads(value)
                    ok = bool(sel) and all(isinstance(n, dict) and n.get("name") for n in sel)
                except json.JSONDecodeError:
                    ok = False
            else:
                ok = bool(value) and all(re.fullmatch(r"([a-z0-9-.]+/)?[a-z0-9-.]+(@[A-Za-z0-9_.-]+)?", n.strip())
                                         for n in value.split(","))
            if not ok:
                self.err(source, f"{ident(ds)}: {MULTUS} {networks!r} is neither `[ns/]name[@iface],...` nor a JSON "
                                 f"list of objects with a name")
            else:
                self.notes.append(f"{ident(ds)}: pod network (hostNetwork false, {dns}) + Multus {value}")
        elif host:
            self.notes.append(f"{ident(ds)}: hostNetwork, {dns}, hostPorts = containerPorts")
        else:
            self.notes.append(f"{ident(ds)}: pod network (hostNetwork false, {dns}), no hostPorts")

    def check_qos(self, source: str, ds: dict, pod: dict) -> None:
        """Guaranteed QoS: every container has cpu and memory limits, and requests equal to them."""
        problems = []
        for c in (pod.get("initContainers") or []) + (pod.get("containers") or []):
            res = c.get("resources") or {}
            limits, requests = res.get("limits") or {}, res.get("requests") or {}
            for r in ("cpu", "memory"):
                if r not in limits:
                    problems.append(f"container {c['name']} has no {r} limit")
                elif str(requests.get(r, limits[r])) != str(limits[r]):
                    problems.append(f"container {c['name']} requests {r} {requests[r]} != limit {limits[r]}")
        if problems:
            self.err(source, f"{ident(ds)}: not Guaranteed QoS ({'; '.join(problems)}): the kubelet evicts "
                             f"Burstable pods first under memory pressure")
        else:
            self.notes.append(f"{ident(ds)}: Guaranteed QoS, priorityClassName {pod.get('priorityClassName') or '<none>'}")

    def check_memory(self, source: str, ds: dict, c: dict, conf: dict) -> None:
        limit = ((c.get("resources") or {}).get("limits") or {}).get("memory")
        registered = (conf.get("limits") or {}).get("max_registered_bytes")
        if limit is None or registered is None:
            return
        lb, rb = quantity_bytes(limit), size_bytes(registered)
        if lb is None or rb is None:
            self.err(source, f"{ident(ds)}: cannot compare memory limit {limit!r} with max_registered_bytes {registered!r}")
        elif lb < rb + 2**30:
            self.err(source, f"{ident(ds)}: memory limit {limit} is below [limits] max_registered_bytes {registered} "
                             f"+ 1Gi: registered regions are charged to the pod, which would be OOM-killed first")

    def agent_config(self, source, ds, c, volumes, configmaps, namespace) -> dict | None:
        """The agent.toml the container runs with: `--config PATH` under a ConfigMap mount."""
        args = (c.get("command") or []) + (c.get("args") or [])
        path = next((args[i + 1] for i, a in enumerate(args[:-1]) if a == "--config"), None)
        if path is None:
            self.err(source, f"{ident(ds)}: container {c['name']} has no --config argument")
            return None
        for m in c.get("volumeMounts") or []:
            cm = (volumes.get(m["name"]) or {}).get("configMap")
            if cm and posixpath.dirname(path) == posixpath.normpath(m["mountPath"]) and not m.get("subPath"):
                obj = configmaps.get((namespace, cm.get("name")))
                if obj is None:
                    return None  # reported above
                key = posixpath.basename(path)
                items = cm.get("items")
                if items:
                    key = next((i["key"] for i in items if i["path"] == key), None)
                text = (obj.get("data") or {}).get(key) if key else None
                if text is None:
                    self.err(source, f"{ident(ds)}: --config {path}: {ident(obj)} has no such key")
                    return None
                try:
                    conf = tomllib.loads(text)
                except tomllib.TOMLDecodeError as e:
                    self.err(source, f"{ident(obj)}: {key} is not valid TOML: {e}")
                    return None
                self.check_with_agent(source, ident(obj), key, text)
                return conf
        self.err(source, f"{ident(ds)}: --config {path} is not in a mounted ConfigMap")
        return None

    def check_with_agent(self, source: str, where: str, key: str, text: str) -> None:
        """The agent's own verdict on this file: the key list, types and enums are its own."""
        with tempfile.TemporaryDirectory(prefix="xfer-agent-toml-") as d:
            path = os.path.join(d, "agent.toml")
            with open(path, "w", encoding="utf-8") as f:
                f.write(text)
            env = {"PATH": os.environ.get("PATH", "/usr/bin:/bin")}
            for k in ("CERT", "KEY", "CA"):  # the agent checks these files exist
                stand_in = os.path.join(d, k.lower())
                open(stand_in, "w").close()
                env[f"XFER_TLS__{k}"] = stand_in
            r = subprocess.run([self.agent, "--config", path, "--print-config"], env=env,
                               capture_output=True, text=True, timeout=30)
        if r.returncode != 0:
            msg = " ".join(r.stderr.split()) or f"exit {r.returncode}"
            self.err(source, f"{where}: xfer-agent refuses {key}: {msg}")
        else:
            self.notes.append(f"{where}: {key} accepted by xfer-agent --print-config")

    def check_agent_conf(self, source: str, ds: dict, c: dict, volumes: dict, conf: dict) -> None:
        where = f"{ident(ds)} agent.toml"
        cports = {p.get("name"): p["containerPort"] for p in c.get("ports") or []}
        listeners = {}
        for key, pname in LISTENERS.items():
            if key not in conf:
                self.err(source, f"{where}: {key} is not set (the deploy pins every listener)")
                continue
            hp = split_hostport(conf[key])
            if hp is None:
                self.err(source, f"{where}: {key} = {conf[key]!r} is not HOST:PORT")
                continue
            listeners[key] = hp
            if cports.get(pname) != hp[1]:
                self.err(source, f"{where}: {key} port {hp[1]} != container port {pname!r} ({cports.get(pname)})")

        # Probes: kubelet cannot present a client certificate, so they go to health_listen.
        health = listeners.get("health_listen")
        for probe in ("startupProbe", "readinessProbe", "livenessProbe"):
            p = c.get(probe)
            if p is None and probe == "startupProbe":
                continue
            g = (p or {}).get("grpc")
            if not g:
                self.err(source, f"{ident(ds)}: container {c['name']} has no gRPC {probe}")
            elif health and g.get("port") != health[1]:
                self.err(source, f"{ident(ds)}: {probe} port {g.get('port')} != health_listen port {health[1]}")

        if health:
            self.notes.append(f"{ident(ds)}: probes -> health_listen :{health[1]}; listeners match container ports")

        # The local unix socket must live in a directory the node shares (a hostPath mount), or
        # no application pod could ever reach it.
        sock = conf.get("unix_listen")
        if sock:
            sdir = posixpath.dirname(posixpath.normpath(sock))
            mounts = {posixpath.normpath(m["mountPath"]): m["name"] for m in c.get("volumeMounts") or []}
            vname = mounts.get(sdir)
            if vname is None or "hostPath" not in (volumes.get(vname) or {}):
                self.err(source, f"{where}: unix_listen {sock} is not in a hostPath mount (applications on the node cannot reach it)")
            else:
                self.notes.append(f"{ident(ds)}: unix_listen {sock} on hostPath {volumes[vname]['hostPath'].get('path')}, "
                                  f"mode {conf.get('unix_mode', '0660')}")

        plaintext_optin = source in self.plaintext
        insecure = conf.get("insecure", True)  # the agent's default is plaintext
        allow = conf.get("allow_plaintext_network", False)
        if plaintext_optin:
            if conf.get("insecure") is not True or allow is not True:
                self.err(source, f"{where}: the plaintext opt-in must set insecure = true and "
                                 f"allow_plaintext_network = true (got {conf.get('insecure')!r}, {allow!r})")
            else:
                self.notes.append(f"{ident(ds)}: PLAINTEXT opt-in, insecure = true, allow_plaintext_network = true")
        elif conf.get("insecure") is not False:
            self.err(source, f"{where}: mTLS must be on: insecure = false explicitly (got "
                             f"{conf.get('insecure', '<unset: the agent defaults to plaintext>')!r})")
        if insecure and not allow:
            public = [k for k in ("listen", "data_listen") if k in listeners and not is_loopback(listeners[k][0])]
            if public:
                self.err(source, f"{where}: plaintext with non-loopback {', '.join(public)} needs "
                                 f"allow_plaintext_network = true (the agent exits 64)")
        if not insecure:
            self.check_tls(source, ds, c, volumes, conf.get("tls") or {})

    def check_tls(self, source: str, ds: dict, c: dict, volumes: dict, tls: dict) -> None:
        where = f"{ident(ds)} agent.toml [tls]"
        td = tls.get("trust_domain", "")
        if td and not DNS_NAME.match(td):
            self.err(source, f"{where}: trust_domain {td!r} is not a lowercase DNS name")
        for rule in tls.get("dns_roles") or []:
            pat, role = (rule.get("pattern"), rule.get("role")) if isinstance(rule, dict) else (None, None)
            labels = (pat or "").split(".")
            if role not in ROLES or labels.count("*") != 1 or (pat or "").count("*") != 1:
                self.err(source, f"{where}: dns_roles entry {rule!r}: needs role node|client|admin and "
                                 f"a pattern with one `*` label")
        # Which volume provides each file, under which file name.
        provided: dict[str, tuple[str, dict, str]] = {}  # key -> (volume name, volume, file name)
        for key in ("cert", "key", "ca"):
            path = tls.get(key) or ""
            if not path.startswith("/"):
                self.err(source, f"{where}: {key} = {path!r}: an absolute path is required with mTLS")
                continue
            m = next((m for m in c.get("volumeMounts") or []
                      if posixpath.dirname(posixpath.normpath(path)) == posixpath.normpath(m["mountPath"])), None)
            if m is None:
                self.err(source, f"{where}: {key} = {path}: no volume is mounted at {posixpath.dirname(path)}")
                continue
            if not m.get("readOnly"):
                self.err(source, f"{ident(ds)}: the TLS mount {m['name']!r} should be readOnly")
            provided[key] = (m["name"], volumes.get(m["name"]) or {}, posixpath.basename(path))
        if len({v[0] for v in provided.values()}) > 1:
            self.err(source, f"{where}: cert, key and ca come from different volumes "
                             f"({sorted({v[0] for v in provided.values()})})")
        for key, (vname, vol, fname) in provided.items():
            if "csi" in vol:
                attrs = vol["csi"].get("volumeAttributes") or {}
                default = {"cert": "tls.crt", "key": "tls.key", "ca": "ca.crt"}[key]
                attr = {"cert": "certificate-file", "key": "privatekey-file", "ca": "ca-file"}[key]
                want = attrs.get(CSI + attr, default)
                if fname != want:
                    self.err(source, f"{where}: {key} file {fname!r} is not what volume {vname!r} writes ({want!r})")
            elif "secret" in vol:
                items = vol["secret"].get("items")
                names = {i["path"] for i in items} if items else {"tls.crt", "tls.key", "ca.crt"}
                if fname not in names:
                    self.err(source, f"{where}: {key} file {fname!r} is not a key of Secret volume {vname!r} "
                                     f"(kubernetes.io/tls + ca.crt: tls.crt, tls.key, ca.crt)")
                if not vol["secret"].get("secretName"):
                    self.err(source, f"{ident(ds)}: Secret volume {vname!r} has no secretName")
            else:
                self.err(source, f"{where}: {key} comes from volume {vname!r}, which is neither a "
                                 f"{CSI_DRIVER} CSI volume nor a Secret")
        vols = {v[0]: v[1] for v in provided.values()}
        for vname, vol in vols.items():
            if "csi" in vol:
                self.check_csi(source, ds, vname, vol["csi"], tls)
            elif "secret" in vol:
                self.notes.append(f"{ident(ds)}: mTLS, Secret {vol['secret'].get('secretName')} (one identity for "
                                  f"all nodes), server name {tls.get('server_name') or '<peer host>'}")

    def check_csi(self, source: str, ds: dict, vname: str, csi: dict, tls: dict) -> None:
        where = f"{ident(ds)}: volume {vname!r}"
        attrs = csi.get("volumeAttributes") or {}
        if csi.get("driver") != CSI_DRIVER:
            self.err(source, f"{where}: driver {csi.get('driver')!r} is not {CSI_DRIVER}")
            return
        if csi.get("readOnly") is not True:
            self.err(source, f"{where}: csi-driver refuses volumes without readOnly: true")
        for k in attrs:
            if not k.startswith(CSI):
                self.err(source, f"{where}: attribute {k!r} is not a {CSI}* attribute")
        issuer = attrs.get(CSI + "issuer-name")
        if not issuer:
            self.err(source, f"{where}: {CSI}issuer-name is required")
        kind = attrs.get(CSI + "issuer-kind", "Issuer")
        group = attrs.get(CSI + "issuer-group", "cert-manager.io")
        for a in CSI_EXPANDED:
            for var in re.findall(r"\$\{?([A-Za-z_][A-Za-z0-9_]*)", attrs.get(CSI + a, "")):
                if var not in CSI_VARIABLES:
                    self.err(source, f"{where}: {CSI}{a} uses ${{{var}}}: csi-driver only expands {sorted(CSI_VARIABLES)}")
        for a, v in attrs.items():
            if "$" in v and a[len(CSI):] not in CSI_EXPANDED:
                self.err(source, f"{where}: {a} = {v!r}: csi-driver does not expand variables there")
        td = tls.get("trust_domain", "")
        uris = csv(attrs.get(CSI + "uri-sans"))
        ids = [spiffe(u) for u in uris]
        if len(uris) != 1 or ids[0] is None or ids[0][1] != "node":
            self.err(source, f"{where}: uri-sans must be exactly one spiffe://TD/xfer/node/NAME (got {uris})")
        elif not td:
            self.err(source, f"{where}: tls.trust_domain is empty: set it to the URI SAN's {ids[0][0]!r}")
        elif ids[0][0] != td:
            self.err(source, f"{where}: URI SAN trust domain {ids[0][0]!r} != tls.trust_domain {td!r}")
        server_name = tls.get("server_name", "")
        dns = csv(attrs.get(CSI + "dns-names"))
        if not server_name:
            self.err(source, f"{where}: tls.server_name is empty, but the per-pod certificates have no "
                             f"SAN for the node addresses peers dial (ip-sans takes no variables)")
        elif server_name not in dns:
            self.err(source, f"{where}: dns-names {dns} lack tls.server_name {server_name!r}")
        for ip in csv(attrs.get(CSI + "ip-sans")):
            try:
                ipaddress.ip_address(ip)
            except ValueError:
                self.err(source, f"{where}: ip-sans {ip!r} is not an IP address")
        usages = csv(attrs.get(CSI + "key-usages", "digital signature,key encipherment"))
        for need in ("server auth", "client auth"):
            if need not in usages:
                self.err(source, f"{where}: key-usages {usages} lack {need!r} (the agent is server and client)")
        cert_schema = self.crd.get(("cert-manager.io/v1", "Certificate"))
        if cert_schema is not None:
            allowed = set(cert_schema.schema["properties"]["spec"]["properties"]["usages"]["items"]["enum"])
            for u in usages:
                if u not in allowed:
                    self.err(source, f"{where}: key-usages {u!r} is not a cert-manager key usage")
        if issuer:
            self.csi_uses.append((source, f"{group}/{kind}", issuer, td))
            self.notes.append(f"{ident(ds)}: mTLS, {CSI_DRIVER} {kind}/{issuer}, {uris[0] if uris else '?'}, "
                              f"server name {server_name}")

    def check_cert_manager(self, source: str, docs: list[dict]) -> None:
        objs = [d for d in docs if d.get("apiVersion") == "cert-manager.io/v1"]
        if not objs:
            return
        issuers = {d["metadata"]["name"]: d for d in objs if d.get("kind") == "Issuer"}
        certs = [d for d in objs if d.get("kind") == "Certificate"]
        for cert in certs:
            spec = cert.get("spec") or {}
            ref = spec.get("issuerRef") or {}
            if ref.get("kind", "Issuer") == "Issuer" and ref.get("name") not in issuers:
                self.err(source, f"{ident(cert)}: issuerRef {ref.get('name')!r} is not an Issuer here")
            if spec.get("isCA"):
                continue
            uris = spec.get("uris") or []
            ids = [spiffe(u) for u in uris]
            if len(uris) != 1 or ids[0] is None or ids[0][1] not in ROLES or not DNS_NAME.match(ids[0][0]):
                self.err(source, f"{ident(cert)}: needs exactly one URI SAN spiffe://TD/xfer/ROLE/NAME (got {uris})")
            usages = spec.get("usages") or []
            role = ids[0][1] if ids and ids[0] else None
            if "client auth" not in usages:
                self.err(source, f"{ident(cert)}: usages {usages} lack 'client auth'")
            if role == "node" and "server auth" not in usages:
                self.err(source, f"{ident(cert)}: a node certificate needs 'server auth' too")
        ca_secrets = {(c.get("spec") or {}).get("secretName") for c in certs if (c.get("spec") or {}).get("isCA")}
        for name, iss in issuers.items():
            ca = (iss.get("spec") or {}).get("ca")
            if ca and ca.get("secretName") not in ca_secrets:
                self.err(source, f"{ident(iss)}: CA Secret {ca.get('secretName')!r} is made by no isCA Certificate here")
        self.cm_objects.extend((source, d) for d in objs)
        self.notes.append(f"cert-manager: {len(issuers)} Issuer(s), {len(certs)} Certificate(s), references resolve")

    def check_across(self) -> None:
        """The Issuer the manifests use and the trust domain of the example certificates."""
        if not self.cm_objects:
            return
        issuers = {(f"cert-manager.io/{d['kind']}", d["metadata"]["name"])
                   for _, d in self.cm_objects if d["kind"] in ("Issuer", "ClusterIssuer")}
        for source, kind, name, td in self.csi_uses:
            if source in self.defaults and (kind, name) not in issuers:
                self.err(source, f"csi volume's issuer {kind}/{name} is not the one deploy/cert-manager creates "
                                 f"({sorted(f'{k}/{n}' for k, n in issuers)})")
        tds = {td for source, _, _, td in self.csi_uses if td and source in self.defaults}
        for source, d in self.cm_objects:
            for uri in (d.get("spec") or {}).get("uris") or []:
                sid = spiffe(uri)
                if sid and tds and sid[0] not in tds:
                    self.err(source, f"{ident(d)}: trust domain {sid[0]!r} is not the agents' ({sorted(tds)})")


def quota_admits(quota: dict, priority_class: str) -> bool:
    for e in (((quota.get("spec") or {}).get("scopeSelector") or {}).get("matchExpressions") or []):
        if e.get("scopeName") == "PriorityClass" and e.get("operator") == "In" and priority_class in (e.get("values") or []):
            return True
    return False


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--crd-schema", action="append", default=[], help="trimmed CRD JSON schema (repeatable)")
    ap.add_argument("--k8s-version", action="append", required=True)
    ap.add_argument("--plaintext", action="append", default=[], metavar="NAME",
                    help="source NAME is the explicit plaintext opt-in (else mTLS is required)")
    ap.add_argument("--defaults", action="append", default=[], metavar="NAME",
                    help="source NAME is a shipped default: its csi issuer and trust domain must match "
                         "the cert-manager objects given")
    ap.add_argument("--no-schema", action="store_true", help="cross-checks only (for mutation tests)")
    ap.add_argument("--expect-error", action="append", default=[], metavar="NAME=TEXT",
                    help="source NAME (a known-bad mutant) must fail with an error containing TEXT; its "
                         "errors are then expected, not failures")
    ap.add_argument("--agent", required=True, metavar="XFER-AGENT",
                    help="xfer-agent binary that judges each agent.toml (--config FILE --print-config)")
    ap.add_argument("sources", nargs="+", metavar="NAME=FILE")
    args = ap.parse_args()
    schemas = []
    for path in args.crd_schema:
        with open(path, encoding="utf-8") as f:
            s = json.load(f)
        jsonschema.Draft7Validator.check_schema(s)
        schemas.append(s)
    names = {spec.partition("=")[0] for spec in args.sources}
    for flag in ("plaintext", "defaults"):
        if not set(getattr(args, flag)) <= names:
            ap.error(f"--{flag} names no source: {sorted(set(getattr(args, flag)) - names)}")
    expect = dict(e.partition("=")[::2] for e in args.expect_error)
    if not set(expect) <= names:
        ap.error(f"--expect-error names no source: {sorted(set(expect) - names)}")
    checker = Checker(schemas, args.k8s_version, set(args.plaintext), set(args.defaults), not args.no_schema,
                      args.agent)
    if checker.schema:
        kinds = ", ".join(k for _, k in checker.crd)
        print(f"validating against Kubernetes {', '.join(args.k8s_version)} (strict) + vendored CRD schemas ({kinds})")
    total = 0
    for spec in args.sources:
        name, _, path = spec.partition("=")
        total += checker.check_source(name, path)
    checker.check_across()

    def source_of(error: str) -> str:
        return error[1:error.index("]")]

    problems = [e for e in checker.errors if source_of(e) not in expect]
    for name, text in expect.items():
        got = [e for e in checker.errors if source_of(e) == name]
        if not any(text in e for e in got):
            problems.append(f"[{name}] should fail with {text!r}, got: {got or 'no error'}")
    if problems:
        print(f"\nFAILED: {len(problems)} problem(s):", file=sys.stderr)
        for e in problems:
            print(f"  {e}", file=sys.stderr)
        return 1
    if expect:
        print(f"OK: {len(expect)} known-bad sources failed as expected")
    else:
        print(f"OK: {total} objects from {len(args.sources)} sources valid")
    return 0


if __name__ == "__main__":
    sys.exit(main())
