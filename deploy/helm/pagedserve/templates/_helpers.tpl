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

{{/*
The gateway's container. "sidecar": in Triton's pod, calling that pod's Triton on localhost
(its /metrics passes that Triton's metrics through, as pickers scraping the pod's port read
them), with Triton's writable volumes and read-only mounts (the tokenizer is read from the
engine's `model` path); else its own Deployment's, calling Triton's Service.
*/}}
{{- define "pagedserve.gateway.container" -}}
{{- $root := .root }}
{{- $v := $root.Values }}
{{- $port := ternary "openai" "http" .sidecar }}
- name: gateway
  image: {{ include "pagedserve.gateway.image" $root | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  args:
    - pagedserve
    - openai
    - --host=0.0.0.0
    - --port={{ int $v.gateway.port }}
    {{- if .sidecar }}
    - --triton-url=localhost:8001
    {{- else }}
    - --triton-url={{ include "pagedserve.fullname" $root }}:{{ $v.service.ports.grpc }}
    {{- end }}
    - --model={{ $v.modelName }}
    {{- with $v.gateway.servedModelName }}
    - --served-model-name={{ . }}
    {{- end }}
    {{- range $v.gateway.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  ports:
    - name: {{ $port }}
      containerPort: {{ int $v.gateway.port }}
      protocol: TCP
  env:
    - name: PAGEDSERVE_API_KEY
      valueFrom:
        secretKeyRef:
          name: {{ include "pagedserve.gateway.secretName" $root }}
          key: {{ $v.gateway.apiKey.secretKey }}
    {{- if .sidecar }}
    {{- include "pagedserve.writableEnv" $root | nindent 4 }}
    {{- else }}
    - name: HOME
      value: {{ $v.home.path | quote }}
    {{- end }}
    {{- with $v.gateway.env }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  # /health answers 200 only while Triton's model is ready: readiness only.
  # Liveness: the port answers.
  readinessProbe:
    httpGet:
      path: /health
      port: {{ $port }}
    periodSeconds: 5
    failureThreshold: 3
    timeoutSeconds: 5
  livenessProbe:
    tcpSocket:
      port: {{ $port }}
    periodSeconds: 10
    failureThreshold: 6
    timeoutSeconds: 5
  {{- if .sidecar }}
  lifecycle:
    preStop:
      # Triton's own wait: leave the endpoints first, then finish open streams on SIGTERM.
      exec:
        command: ["sleep", "{{ int $v.shutdown.preStopSleepSecs }}"]
  {{- end }}
  {{- with $v.gateway.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $v.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    {{- if .sidecar }}
    {{- include "pagedserve.writableMounts" $root | nindent 4 }}
    {{- if $v.modelRepository.volume }}
    - name: model-repository
      mountPath: {{ $v.modelRepository.path }}
      readOnly: true
    {{- end }}
    {{- with $v.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
    {{- else }}
    - name: tmp
      mountPath: /tmp
    - name: home
      mountPath: {{ $v.home.path }}
    {{- end }}
{{- end }}

{{/*
The router's objects (vLLM's router in front of the gateway sidecars).
*/}}
{{- define "pagedserve.router.fullname" -}}
{{- printf "%s-router" (include "pagedserve.fullname" . | trunc 56 | trimSuffix "-") }}
{{- end }}

{{- define "pagedserve.router.selectorLabels" -}}
app.kubernetes.io/name: {{ printf "%s-router" (include "pagedserve.name" . | trunc 56 | trimSuffix "-") }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "pagedserve.router.labels" -}}
helm.sh/chart: {{ include "pagedserve.chart" . }}
{{ include "pagedserve.router.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/component: router
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end }}

{{/*
The gateway sidecar's port is the pod's OpenAI port: what the router and an InferencePool pick.
*/}}
{{- define "pagedserve.gateway.sidecar" -}}
{{- if and .Values.gateway.enabled (eq .Values.gateway.placement "sidecar") }}true{{ end }}
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
{{- if not (has .Values.gateway.placement (list "deployment" "sidecar")) }}
{{- fail (printf "gateway.placement must be deployment or sidecar, got %v" .Values.gateway.placement) }}
{{- end }}
{{- $sidecar := include "pagedserve.gateway.sidecar" . }}
{{- $router := .Values.router }}
{{- if $router.enabled }}
{{- if not $sidecar }}
{{- fail "router.enabled routes to each pod's OpenAI port: set gateway.enabled=true and gateway.placement=sidecar" }}
{{- end }}
{{- if not $router.image.repository }}
{{- fail "router.image.repository: vLLM's router publishes no image; build docker/router.Dockerfile (pagedserve repository) and push it where your nodes pull" }}
{{- end }}
{{- $policies := list "cache_aware" "round_robin" "random" "power_of_two" "consistent_hash" "sticky_least_loaded" "kv_aware" }}
{{- if not (has $router.policy $policies) }}
{{- fail (printf "router.policy must be one of %s, got %v" (join ", " $policies) $router.policy) }}
{{- end }}
{{- if and (eq $router.policy "kv_aware") (not $router.workerUrls) }}
{{- fail "router.policy=kv_aware needs each worker's KV-event endpoint (--kv-event-source URL=ENDPOINT), which pod discovery does not give: list router.workerUrls and pass the sources in router.extraArgs, or use cache_aware" }}
{{- end }}
{{- end }}
{{- if .Values.inferencePool.enabled }}
{{- if not $sidecar }}
{{- fail "inferencePool.enabled: the pool's port is each pod's OpenAI port: set gateway.enabled=true and gateway.placement=sidecar" }}
{{- end }}
{{- if not .Values.inferencePool.endpointPicker.name }}
{{- fail "inferencePool.endpointPicker.name: name the Service of the endpoint picker your cluster runs for this pool (e.g. llm-d's inference scheduler)" }}
{{- end }}
{{- end }}
{{- end }}
