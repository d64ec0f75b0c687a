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
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
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

{{/* Refuses values that would deploy something other than what they say. */}}
{{- define "xfer.checkValues" -}}
{{- if or (hasKey .Values.config "insecure") (hasKey .Values.config "tls") }}
{{- fail "config.insecure and config.tls are gone: mTLS is set with tls.* (tls.enabled=false for plaintext, tls.existingSecret or tls.certManager for the certificate); see values.yaml" }}
{{- end }}
{{- if not (kindIs "bool" .Values.tls.enabled) }}
{{- fail (printf "tls.enabled must be true or false (got %v)" .Values.tls.enabled) }}
{{- end }}
{{- $label := `[a-z0-9]([-a-z0-9]{0,61}[a-z0-9])?` }}
{{- with .Values.tls.trustDomain }}
{{- if not (regexMatch (printf `^%s(\.%s)*$` $label $label) .) }}
{{- fail (printf "tls.trustDomain %q is not a lowercase DNS name" .) }}
{{- end }}
{{- end }}
{{- if eq (include "xfer.tlsMode" .) "certManager" }}
{{- if not .Values.tls.trustDomain }}
{{- fail "tls.trustDomain is needed with cert-manager: it is part of the agents' URI SAN" }}
{{- end }}
{{- if not .Values.tls.certManager.issuerRef.name }}
{{- fail "tls.certManager.issuerRef.name is required (or set tls.existingSecret)" }}
{{- end }}
{{- end }}
{{- range .Values.tls.dnsRoles }}
{{- if not (has .role (list "node" "client" "admin")) }}
{{- fail (printf "tls.dnsRoles: role must be node, client or admin (got %q)" .role) }}
{{- end }}
{{- if ne (len (regexFindAll `\*` .pattern -1)) 1 }}
{{- fail (printf "tls.dnsRoles: pattern %q must contain exactly one *" .pattern) }}
{{- end }}
{{- end }}
{{- $p := .Values.config.ports }}
{{- $ports := list ($p.grpc | int) ($p.metrics | int) ($p.data | int) ($p.health | int) }}
{{- if ne (len ($ports | uniq)) 4 }}
{{- fail (printf "config.ports must be four different ports (got %v)" $ports) }}
{{- end }}
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

[limits]
max_regions = {{ $c.limits.maxRegions | int }}
max_registered_bytes = {{ $c.limits.maxRegisteredBytes | quote }}
max_transfers = {{ $c.limits.maxTransfers | int }}

[shutdown]
grace = {{ $c.shutdown.grace | quote }}
{{- end }}
{{- end }}
