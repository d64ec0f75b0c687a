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

{{/* agent.toml. Integers go through `int`: Helm reads numeric values as floats. */}}
{{- define "xfer.agentToml" -}}
{{- if .Values.configOverride }}
{{- .Values.configOverride }}
{{- else }}
{{- $c := .Values.config -}}
# Rendered by the xfer Helm chart. node_name comes from XFER_NODE_NAME (spec.nodeName).
node_name = ""
listen = "0.0.0.0:{{ $c.ports.grpc | int }}"
metrics_listen = "0.0.0.0:{{ $c.ports.metrics | int }}"
data_listen = "0.0.0.0:{{ $c.ports.data | int }}"
fabric = {{ $c.fabric | quote }}
state_dir = "/var/lib/xfer"
insecure = {{ $c.insecure }}

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

[tls]
cert = {{ $c.tls.cert | quote }}
key = {{ $c.tls.key | quote }}
ca = {{ $c.tls.ca | quote }}

[limits]
max_regions = {{ $c.limits.maxRegions | int }}
max_registered_bytes = {{ $c.limits.maxRegisteredBytes | quote }}
max_transfers = {{ $c.limits.maxTransfers | int }}

[shutdown]
grace = {{ $c.shutdown.grace | quote }}
{{- end }}
{{- end }}
