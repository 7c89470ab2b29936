{{/*
Chart name, truncated to the 63 characters a DNS label allows.
*/}}
{{- define "pagedserve.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name of the release's objects: the release name, with the chart name appended
unless the release name already contains it.
*/}}
{{- define "pagedserve.fullname" -}}
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

{{- define "pagedserve.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels that select the release's pods (Deployment selector, Service, ServiceMonitor).
*/}}
{{- define "pagedserve.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pagedserve.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pagedserve.labels" -}}
helm.sh/chart: {{ include "pagedserve.chart" . }}
{{ include "pagedserve.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: tritonserver
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{- define "pagedserve.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "pagedserve.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "pagedserve.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag | toString) }}
{{- end }}

{{/*
Where the init container writes the repository copy with the engine settings.
*/}}
{{- define "pagedserve.runtimeRepositoryDir" -}}
/var/lib/pagedserve
{{- end }}

{{/*
The repository tritonserver is started with: the copy when engine settings are given,
else the source repository itself.
*/}}
{{- define "pagedserve.servedRepository" -}}
{{- if .Values.engine }}
{{- printf "%s/model_repository" (include "pagedserve.runtimeRepositoryDir" .) }}
{{- else }}
{{- .Values.modelRepository.path }}
{{- end }}
{{- end }}

{{/*
Seconds the kubelet waits between starting termination (preStop) and SIGKILL: the
preStop sleep, Triton's exit timeout for in-flight requests, and a margin.
*/}}
{{- define "pagedserve.terminationGracePeriodSeconds" -}}
{{- if kindIs "invalid" .Values.shutdown.terminationGracePeriodSeconds }}
{{- add (int .Values.shutdown.preStopSleepSecs) (int .Values.server.exitTimeoutSecs) 15 }}
{{- else }}
{{- int .Values.shutdown.terminationGracePeriodSeconds }}
{{- end }}
{{- end }}

{{/*
Fail rendering on settings that cannot work together.
*/}}
{{- define "pagedserve.validate" -}}
{{- $tp := int (default 1 (get (.Values.engine | default dict) "tensor_parallel_size")) }}
{{- $gpus := int .Values.gpu.count }}
{{- if and (gt $gpus 0) (gt $tp $gpus) }}
{{- fail (printf "engine.tensor_parallel_size=%d needs one GPU per rank, but gpu.count=%d" $tp $gpus) }}
{{- end }}
{{- $shutdown := add (int .Values.shutdown.preStopSleepSecs) (int .Values.server.exitTimeoutSecs) }}
{{- if lt (int (include "pagedserve.terminationGracePeriodSeconds" .)) $shutdown }}
{{- fail (printf "shutdown.terminationGracePeriodSeconds must be at least shutdown.preStopSleepSecs + server.exitTimeoutSecs (%d)" $shutdown) }}
{{- end }}
{{- if and .Values.autoscaling.enabled (gt (int .Values.autoscaling.minReplicas) (int .Values.autoscaling.maxReplicas)) }}
{{- fail "autoscaling.minReplicas must not exceed autoscaling.maxReplicas" }}
{{- end }}
{{- if and .Values.autoscaling.enabled (not (or .Values.autoscaling.queue.enabled .Values.autoscaling.kvCacheUsage.enabled .Values.autoscaling.extraMetrics)) }}
{{- fail "autoscaling.enabled needs at least one metric: autoscaling.queue, autoscaling.kvCacheUsage or autoscaling.extraMetrics" }}
{{- end }}
{{- end }}
