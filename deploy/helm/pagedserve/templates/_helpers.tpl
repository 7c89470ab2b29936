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

{{/*
The OpenAI gateway's objects: its own name label, so that neither Triton's Service nor
its Deployment selects the gateway's pods (and the other way round).
*/}}
{{- define "pagedserve.gateway.fullname" -}}
{{- printf "%s-gateway" (include "pagedserve.fullname" . | trunc 55 | trimSuffix "-") }}
{{- end }}

{{- define "pagedserve.gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-gateway" (include "pagedserve.name" . | trunc 55 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pagedserve.gateway.labels" -}}
helm.sh/chart: {{ include "pagedserve.chart" . }}
{{ include "pagedserve.gateway.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: gateway
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
The Secret holding the gateway's API key: the one named in values, else the chart's.
*/}}
{{- define "pagedserve.gateway.secretName" -}}
{{- default (include "pagedserve.gateway.fullname" .) .Values.gateway.apiKey.existingSecret }}
{{- end }}

{{- define "pagedserve.gateway.image" -}}
{{- if .Values.gateway.image.repository }}
{{- printf "%s:%s" .Values.gateway.image.repository (default .Chart.AppVersion .Values.gateway.image.tag | toString) }}
{{- else }}
{{- include "pagedserve.image" . }}
{{- end }}
{{- end }}

{{/*
Triton's readiness probe path: the engine's model unless set.
*/}}
{{- define "pagedserve.readinessPath" -}}
{{- default (printf "/v2/models/%s/ready" .Values.modelName) .Values.probes.readiness.path }}
{{- end }}

{{/*
Environment of every container that runs the image: its home and caches at the
writable volumes below (the image sets the same defaults, docker/Dockerfile).
*/}}
{{- define "pagedserve.writableEnv" -}}
- name: HOME
  value: {{ .Values.home.path | quote }}
- name: PAGEDSERVE_CACHE_DIR
  value: {{ .Values.cache.path | quote }}
- name: TORCHINDUCTOR_CACHE_DIR
  value: {{ printf "%s/inductor" .Values.cache.path | quote }}
- name: TRITON_CACHE_DIR
  value: {{ printf "%s/triton" .Values.cache.path | quote }}
- name: HF_HOME
  value: {{ printf "%s/huggingface" .Values.cache.path | quote }}
- name: CUDA_CACHE_PATH
  value: {{ printf "%s/cuda" .Values.cache.path | quote }}
{{- end }}

{{/*
The writable places on a read-only root filesystem: mounts, and the pod's volumes.
*/}}
{{- define "pagedserve.writableMounts" -}}
- name: tmp
  mountPath: /tmp
- name: home
  mountPath: {{ .Values.home.path }}
- name: cache
  mountPath: {{ .Values.cache.path }}
{{- end }}

{{- define "pagedserve.writableVolumes" -}}
- name: tmp
  emptyDir:
    sizeLimit: {{ .Values.tmp.sizeLimit }}
- name: home
  emptyDir:
    sizeLimit: {{ .Values.home.sizeLimit }}
- name: cache
{{- if .Values.cache.volume }}
  {{- toYaml .Values.cache.volume | nindent 2 }}
{{- else }}
  emptyDir:
    sizeLimit: {{ .Values.cache.sizeLimit }}
{{- end }}
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
{{- $expose := .Values.service.expose }}
{{- if not (or $expose.http $expose.grpc $expose.metrics) }}
{{- fail "service.expose: offer at least one of http, grpc, metrics" }}
{{- end }}
{{- if and .Values.serviceMonitor.enabled (not $expose.metrics) }}
{{- fail "serviceMonitor.enabled scrapes the Service's metrics port: set service.expose.metrics=true" }}
{{- end }}
{{- if not .Values.modelName }}
{{- fail "modelName: name the Triton model that hosts the engine (llm)" }}
{{- end }}
{{- if .Values.gateway.enabled }}
{{- if not $expose.grpc }}
{{- fail "gateway.enabled calls Triton's gRPC port through the Service: set service.expose.grpc=true" }}
{{- end }}
{{- $key := .Values.gateway.apiKey }}
{{- if and $key.existingSecret $key.value }}
{{- fail "gateway.apiKey: give existingSecret or value, not both" }}
{{- end }}
{{- if not (or $key.existingSecret $key.value) }}
{{- fail "gateway.enabled needs an API key: gateway.apiKey.existingSecret (a Secret you created) or gateway.apiKey.value (the chart creates the Secret)" }}
{{- end }}
{{- if and $key.value (lt (len (toString $key.value)) 16) }}
{{- fail "gateway.apiKey.value: use at least 16 characters (e.g. openssl rand -hex 32)" }}
{{- end }}
{{- if not $key.secretKey }}
{{- fail "gateway.apiKey.secretKey: name the Secret's key that holds the API key" }}
{{- end }}
{{- end }}
{{- end }}
