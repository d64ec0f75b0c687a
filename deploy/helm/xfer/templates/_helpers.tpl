{{/* Chart name, truncated to the 63-character label limit. */}}
{{- define "xfer.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Fully qualified app name. */}}
{{- define "xfer.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 63 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 63 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "xfer.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Selector labels: stable across upgrades (DaemonSet selectors are immutable). */}}
{{- define "xfer.selectorLabels" -}}
app.kubernetes.io/name: {{ include "xfer.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: agent
{{- end }}

{{- define "xfer.labels" -}}
helm.sh/chart: {{ include "xfer.chart" . }}
{{ include "xfer.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: xfer
{{- end }}

{{- define "xfer.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "xfer.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "xfer.image" -}}
{{- printf "%s:%s" .Values.image.repository (toString (default .Chart.AppVersion .Values.image.tag)) }}
{{- end }}

{{/* Where the agent's certificate comes from: plaintext | existingSecret | certManager. */}}
{{- define "xfer.tlsMode" -}}
{{- if not .Values.tls.enabled }}plaintext
{{- else if .Values.tls.existingSecret }}existingSecret
{{- else }}certManager
{{- end }}
{{- end }}

{{/* The name agents verify peers' server certificates against (tls.server_name). */}}
{{- define "xfer.tlsServerName" -}}
{{- default (printf "%s.%s.svc" (include "xfer.fullname" .) .Release.Namespace) .Values.tls.serverName }}
{{- end }}

{{/*
Refuses values that would deploy something other than what they say. Types, enums, unknown keys
(typos) and the shape of single values are values.schema.json's job, checked before this runs;
what is left here needs more than one value, or arithmetic.
*/}}
{{- define "xfer.checkValues" -}}
{{- if eq (include "xfer.tlsMode" .) "certManager" }}
{{- if not .Values.tls.trustDomain }}
{{- fail "tls.trustDomain is needed with cert-manager: it is part of the agents' URI SAN" }}
{{- end }}
{{- if not .Values.tls.certManager.issuerRef.name }}
{{- fail "tls.certManager.issuerRef.name is required (or set tls.existingSecret)" }}
{{- end }}
{{- end }}
{{- $p := .Values.config.ports }}
{{- $ports := list ($p.grpc | int) ($p.metrics | int) ($p.data | int) ($p.health | int) }}
{{- if ne (len ($ports | uniq)) 4 }}
{{- fail (printf "config.ports must be four different ports (got %v)" $ports) }}
{{- end }}
{{- if and .Values.sharedMemory.exampleApp.enabled (or (eq .Values.sharedMemory.mode "none") (not .Values.localSocket.enabled)) }}
{{- fail "sharedMemory.exampleApp needs sharedMemory.mode hostPath or hostIPC and localSocket.enabled: the example application reaches the agent through the node's unix socket and shares its /dev/shm" }}
{{- end }}
{{- /* helm install --create-namespace makes a namespace without Pod Security labels, and the
       agent's pods (hostNetwork, hostPath) are then refused wherever the cluster's default level
       is not privileged. lookup sees the cluster only on a real install or upgrade (helm template
       gets nothing, so nothing is checked there). */}}
{{- $ns := lookup "v1" "Namespace" "" .Release.Namespace }}
{{- if $ns }}
{{- $enforce := get ($ns.metadata.labels | default dict) "pod-security.kubernetes.io/enforce" }}
{{- if and $enforce (ne $enforce "privileged") }}
{{- fail (printf "namespace %s enforces Pod Security level %q: the agent needs hostNetwork and hostPath, which only \"privileged\" admits. kubectl label --overwrite namespace %s pod-security.kubernetes.io/enforce=privileged (deploy/helm/namespace.yaml has every label)" .Release.Namespace $enforce .Release.Namespace) }}
{{- end }}
{{- end }}
{{- if and .Values.network.hostNetwork (include "xfer.multusNetworks" .) }}
{{- fail "network.multus.networks needs network.hostNetwork=false: Multus attaches no networks to hostNetwork pods" }}
{{- end }}
{{- $memory := (.Values.resources.limits | default dict).memory }}
{{- if and $memory (not .Values.configOverride) }}
{{- $limit := include "xfer.quantityBytes" $memory | float64 }}
{{- $registered := include "xfer.sizeBytes" .Values.config.limits.maxRegisteredBytes | float64 }}
{{- if lt $limit (addf $registered 1073741824.0) }}
{{- fail (printf "resources.limits.memory %v is below config.limits.maxRegisteredBytes %v + 1Gi: registered regions are charged to the pod, which would be OOM-killed before reaching the agent's own limit; raise the memory (requests and limits) or lower maxRegisteredBytes" $memory .Values.config.limits.maxRegisteredBytes) }}
{{- end }}
{{- end }}
{{- end }}

{{/* A Kubernetes quantity (18Gi, 20G, 1.5Ti, 1073741824) in bytes, as a float. */}}
{{- define "xfer.quantityBytes" -}}
{{- $q := toString . }}
{{- $num := regexFind `^[0-9]+(\.[0-9]+)?` $q }}
{{- $units := dict "" 1.0 "k" 1e3 "M" 1e6 "G" 1e9 "T" 1e12 "P" 1e15 "E" 1e18 "Ki" 1024.0 "Mi" 1048576.0 "Gi" 1073741824.0 "Ti" 1099511627776.0 "Pi" 1125899906842624.0 "Ei" 1152921504606846976.0 }}
{{- $unit := trimPrefix $num $q }}
{{- if or (not $num) (not (hasKey $units $unit)) }}
{{- fail (printf "%q is not a Kubernetes memory quantity (e.g. 18Gi)" $q) }}
{{- end }}
{{- mulf (float64 $num) (get $units $unit) }}
{{- end }}

{{/* An agent size (16GiB, 512MiB, 1g, 4096; k/m/g/t are binary, KB/MB/GB/TB decimal) in bytes. */}}
{{- define "xfer.sizeBytes" -}}
{{- $s := toString . | replace "_" "" | trim }}
{{- $num := regexFind `^[0-9]+(\.[0-9]+)?` $s }}
{{- $units := dict "" 1.0 "b" 1.0 "k" 1024.0 "kib" 1024.0 "ki" 1024.0 "m" 1048576.0 "mib" 1048576.0 "mi" 1048576.0 "g" 1073741824.0 "gib" 1073741824.0 "gi" 1073741824.0 "t" 1099511627776.0 "tib" 1099511627776.0 "ti" 1099511627776.0 "kb" 1e3 "mb" 1e6 "gb" 1e9 "tb" 1e12 }}
{{- $unit := trimPrefix $num $s | trim | lower }}
{{- if or (not $num) (not (hasKey $units $unit)) }}
{{- fail (printf "%q is not a size (e.g. 16GiB)" $s) }}
{{- end }}
{{- mulf (float64 $num) (get $units $unit) }}
{{- end }}

{{/* network.multus.networks as the k8s.v1.cni.cncf.io/networks annotation ("" = none). */}}
{{- define "xfer.multusNetworks" -}}
{{- $n := .Values.network.multus.networks }}
{{- if kindIs "string" $n }}
{{- $n }}
{{- else if and $n (kindIs "string" (first $n)) }}
{{- join "," $n }}
{{- else if $n }}
{{- toJson $n }}
{{- end }}
{{- end }}

{{/* "true" when every container's cpu and memory requests equal its limits (Guaranteed QoS). */}}
{{- define "xfer.guaranteed" -}}
{{- $r := .Values.resources }}
{{- $l := $r.limits | default dict }}
{{- $q := $r.requests | default dict }}
{{- if and $l.cpu $l.memory (eq (toString ($q.cpu | default $l.cpu)) (toString $l.cpu)) (eq (toString ($q.memory | default $l.memory)) (toString $l.memory)) }}true{{ end }}
{{- end }}

{{/* agent.toml. Integers go through `int`: Helm reads numeric values as floats. */}}
{{- define "xfer.agentToml" -}}
{{- if .Values.configOverride }}
{{- .Values.configOverride }}
{{- else }}
{{- $c := .Values.config -}}
{{- $t := .Values.tls -}}
# Rendered by the xfer Helm chart. node_name comes from XFER_NODE_NAME (spec.nodeName).
node_name = ""
listen = "0.0.0.0:{{ $c.ports.grpc | int }}"
metrics_listen = "0.0.0.0:{{ $c.ports.metrics | int }}"
data_listen = "0.0.0.0:{{ $c.ports.data | int }}"
# Plaintext, grpc.health.v1.Health only: kubelet's probes.
health_listen = "0.0.0.0:{{ $c.ports.health | int }}"
fabric = {{ $c.fabric | quote }}
state_dir = "/var/lib/xfer"
{{- if .Values.localSocket.enabled }}
# Applications on the node: xfer.v1.Agent, no TLS, callers by uid (client role).
unix_listen = "/run/xfer-socket/agent.sock"
unix_mode = {{ .Values.localSocket.mode | quote }}
{{- with .Values.localSocket.group }}
unix_group = {{ . | toString | quote }}
{{- end }}
{{- end }}
{{- if $t.enabled }}
# mTLS on gRPC and the data port.
insecure = false
allow_plaintext_network = false
{{- else }}
# tls.enabled=false: PLAINTEXT on the node network, explicitly allowed.
insecure = true
allow_plaintext_network = true
{{- end }}

[log]
format = {{ $c.log.format | quote }}
level = {{ $c.log.level | quote }}

[transfer]
chunk_size = {{ $c.transfer.chunkSize | quote }}
depth = {{ $c.transfer.depth | int }}
qps = {{ $c.transfer.qps | int }}
timeout = {{ $c.transfer.timeout | quote }}

[verbs]
device = {{ $c.verbs.device | quote }}
port = {{ $c.verbs.port | int }}
gid_index = {{ $c.verbs.gidIndex | int }}
grant_mode = {{ $c.verbs.grantMode | quote }}

{{- if $t.enabled }}

[tls]
cert = {{ printf "%s/tls.crt" (trimSuffix "/" $t.mountPath) | quote }}
key = {{ printf "%s/tls.key" (trimSuffix "/" $t.mountPath) | quote }}
ca = {{ printf "%s/ca.crt" (trimSuffix "/" $t.mountPath) | quote }}
server_name = {{ include "xfer.tlsServerName" . | quote }}
trust_domain = {{ $t.trustDomain | quote }}
{{- with $t.dnsRoles }}
dns_roles = [
{{- range . }}
  { pattern = {{ .pattern | quote }}, role = {{ .role | quote }} },
{{- end }}
]
{{- end }}
{{- end }}

{{- if ne .Values.sharedMemory.mode "none" }}

[regions]
# sharedMemory.mode={{ .Values.sharedMemory.mode }}: application pods open the shm objects the agent creates.
shm_mode = {{ .Values.sharedMemory.objectMode | quote }}
{{- with .Values.sharedMemory.group }}
shm_group = {{ . | toString | quote }}
{{- end }}
{{- end }}

[limits]
max_regions = {{ $c.limits.maxRegions | int }}
max_registered_bytes = {{ $c.limits.maxRegisteredBytes | quote }}
max_transfers = {{ $c.limits.maxTransfers | int }}

[shutdown]
grace = {{ $c.shutdown.grace | quote }}
{{- end }}
{{- end }}
