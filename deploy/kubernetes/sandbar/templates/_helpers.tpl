{{/* The chart's name, at most 63 characters. */}}
{{- define "sandbar.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name; resources append -api, -node, ... to it, so it keeps room. */}}
{{- define "sandbar.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 52 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 52 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "sandbar.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels every resource carries. */}}
{{- define "sandbar.labels" -}}
helm.sh/chart: {{ include "sandbar.chart" . }}
app.kubernetes.io/name: {{ include "sandbar.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: sandbar
{{- end }}

{{/* Selector labels of one component: call with (dict "ctx" $ "component" "api"). */}}
{{- define "sandbar.selectorLabels" -}}
app.kubernetes.io/name: {{ include "sandbar.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{- define "sandbar.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{- define "sandbar.apiServiceAccountName" -}}
{{- if .Values.api.serviceAccount.create }}
{{- default (printf "%s-api" (include "sandbar.fullname" .)) .Values.api.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.api.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "sandbar.nodeServiceAccountName" -}}
{{- if .Values.node.serviceAccount.create }}
{{- default (printf "%s-node" (include "sandbar.fullname" .)) .Values.node.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.node.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The Secret holding the database URL, and its key. */}}
{{- define "sandbar.databaseSecretName" -}}
{{- if .Values.database.existingSecret }}
{{- .Values.database.existingSecret }}
{{- else }}
{{- printf "%s-database" (include "sandbar.fullname" .) }}
{{- end }}
{{- end }}

{{- define "sandbar.databaseSecretKey" -}}
{{- if .Values.database.existingSecret }}
{{- required "database.existingSecretKey names the key of the URL in database.existingSecret" .Values.database.existingSecretKey }}
{{- else }}
{{- print "url" }}
{{- end }}
{{- end }}

{{/* The Secret holding the cluster secret, and its key. */}}
{{- define "sandbar.clusterSecretName" -}}
{{- if .Values.clusterSecret.existingSecret }}
{{- .Values.clusterSecret.existingSecret }}
{{- else }}
{{- printf "%s-cluster" (include "sandbar.fullname" .) }}
{{- end }}
{{- end }}

{{- define "sandbar.clusterSecretKey" -}}
{{- if .Values.clusterSecret.existingSecret }}
{{- required "clusterSecret.existingSecretKey names the key of the secret in clusterSecret.existingSecret" .Values.clusterSecret.existingSecretKey }}
{{- else }}
{{- print "secret" }}
{{- end }}
{{- end }}

{{- define "sandbar.apiKeySecretName" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecret }}
{{- else }}
{{- printf "%s-api-key" (include "sandbar.fullname" .) }}
{{- end }}
{{- end }}

{{- define "sandbar.apiKeySecretKey" -}}
{{- if .Values.apiKey.existingSecret }}
{{- .Values.apiKey.existingSecretKey }}
{{- else }}
{{- print "api-key" }}
{{- end }}
{{- end }}

{{- define "sandbar.metricsSecretName" -}}
{{- if .Values.metrics.existingSecret }}
{{- .Values.metrics.existingSecret }}
{{- else }}
{{- printf "%s-metrics" (include "sandbar.fullname" .) }}
{{- end }}
{{- end }}

{{- define "sandbar.metricsSecretKey" -}}
{{- if .Values.metrics.existingSecret }}
{{- .Values.metrics.existingSecretKey }}
{{- else }}
{{- print "token" }}
{{- end }}
{{- end }}

{{/* Where the cluster secret file is read from, in API and node containers alike. */}}
{{- define "sandbar.secretDir" -}}
/run/sandbar-cluster
{{- end }}

{{/* Environment API hosts and nodes share: the database, the secret file, the settings. */}}
{{- define "sandbar.commonEnv" -}}
- name: SANDBAR_DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ include "sandbar.databaseSecretName" . }}
      key: {{ include "sandbar.databaseSecretKey" . }}
- name: SANDBAR_CLUSTER_SECRET_FILE
  value: {{ printf "%s/secret" (include "sandbar.secretDir" .) | quote }}
- name: SANDBAR_DOMAIN
  value: {{ .Values.domain | quote }}
{{- with .Values.registries.allow }}
- name: SANDBAR_ALLOW_REGISTRY
  value: {{ join "," . | quote }}
{{- end }}
{{- with .Values.registries.plainHttp }}
- name: SANDBAR_PLAIN_HTTP_REGISTRIES
  value: {{ join "," . | quote }}
{{- end }}
{{- if eq .Values.logFormat "json" }}
- name: SANDBAR_LOG_FORMAT
  value: json
{{- end }}
{{- with .Values.logLevel }}
- name: RUST_LOG
  value: {{ . | quote }}
{{- end }}
{{- if or .Values.apiKey.existingSecret .Values.apiKey.value }}
- name: SANDBAR_API_KEY
  valueFrom:
    secretKeyRef:
      name: {{ include "sandbar.apiKeySecretName" . }}
      key: {{ include "sandbar.apiKeySecretKey" . }}
{{- end }}
{{- if or .Values.metrics.existingSecret .Values.metrics.token }}
- name: SANDBAR_METRICS_TOKEN
  valueFrom:
    secretKeyRef:
      name: {{ include "sandbar.metricsSecretName" . }}
      key: {{ include "sandbar.metricsSecretKey" . }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* API containers need no privilege at all. */}}
{{- define "sandbar.apiContainerSecurityContext" -}}
allowPrivilegeEscalation: false
readOnlyRootFilesystem: true
runAsNonRoot: true
capabilities:
  drop:
    - ALL
{{- end }}

{{/* The node's health check, sent with the cluster secret to the address API hosts use. */}}
{{- define "sandbar.nodeHealthCommand" -}}
- /bin/sh
- -c
- >-
  printf 'header = "X-Sandbar-Node-Secret: %s"\n' "$(cat {{ include "sandbar.secretDir" . }}/secret)"
  | curl --config - --fail --silent --show-error --output /dev/null --max-time 4
  {{ printf "http://${NODE_IP}:%d/health" (int .Values.port) }}
{{- end }}
