{{/* Chart name, truncated to the 63 characters a DNS label allows. */}}
{{- define "dflash-gateway.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Full name: "<release>-<chart>", or the release name when it already contains the chart name.
Truncated to 56 characters so that "<fullname>-worker" stays a valid name. */}}
{{- define "dflash-gateway.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 56 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 56 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 56 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/* Name of the workers' StatefulSet and of their headless Service (the discovery target). */}}
{{- define "dflash-gateway.workerName" -}}
{{- printf "%s-worker" (include "dflash-gateway.fullname" .) }}
{{- end }}

{{/* "true" when the chart runs prefill and decode servers (workers.disaggregation.enabled). */}}
{{- define "dflash-gateway.pd" -}}
{{- and .Values.workers.enabled .Values.workers.disaggregation.enabled }}
{{- end }}

{{/* Name of a worker role's StatefulSet and headless Service: the whole workers' (workerName),
or "<fullname>-prefill" / "<fullname>-decode". Call with (dict "ctx" $ "role" "prefill"). */}}
{{- define "dflash-gateway.roleName" -}}
{{- if eq .role "whole" }}
{{- include "dflash-gateway.workerName" .ctx }}
{{- else }}
{{- printf "%s-%s" (include "dflash-gateway.fullname" .ctx) .role }}
{{- end }}
{{- end }}

{{/* A role's pod URLs (StatefulSet pods under their headless Service), one per replica:
http://<name>-<i>.<name>.<namespace>.svc.cluster.local:<port>. Call like roleName. */}}
{{- define "dflash-gateway.roleUrls" -}}
{{- $name := include "dflash-gateway.roleName" . }}
{{- $ns := .ctx.Release.Namespace }}
{{- $urls := list }}
{{- range $i := until (int (get .ctx.Values.workers .role).replicas) }}
{{- $urls = append $urls (printf "http://%s-%d.%s.%s.svc.cluster.local:%d" $name $i $name $ns (int $.ctx.Values.workers.port)) }}
{{- end }}
{{- toJson $urls }}
{{- end }}

{{- define "dflash-gateway.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* Labels on every resource. */}}
{{- define "dflash-gateway.labels" -}}
helm.sh/chart: {{ include "dflash-gateway.chart" . }}
app.kubernetes.io/name: {{ include "dflash-gateway.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: dflash-gateway
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/* Selector labels of one component (gateway | worker | test). Call with (dict "ctx" $ "component" "gateway"). */}}
{{- define "dflash-gateway.selectorLabels" -}}
app.kubernetes.io/name: {{ include "dflash-gateway.name" .ctx }}
app.kubernetes.io/instance: {{ .ctx.Release.Name }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/* The gateway's metrics port (its metrics_port setting) when the ServiceMonitor scrapes it:
gateway.settings.metrics_port, else metrics.port; empty without a ServiceMonitor. Prometheus
scrapes that port without a key, while /metrics on the API port needs a client key whenever
client keys are configured. */}}
{{- define "dflash-gateway.metricsPort" -}}
{{- if .Values.metrics.serviceMonitor.enabled }}
{{- .Values.gateway.settings.metrics_port | default .Values.metrics.port }}
{{- end }}
{{- end }}

{{/* The label selector the gateway lists EndpointSlices with: the label Kubernetes puts on every
EndpointSlice of a Service, naming the workers' headless Service - so exactly its slices match. */}}
{{- define "dflash-gateway.workerSelectorString" -}}
{{- printf "kubernetes.io/service-name=%s" (include "dflash-gateway.workerName" .) }}
{{- end }}

{{- define "dflash-gateway.serviceAccountName" -}}
{{- if .Values.gateway.serviceAccount.create }}
{{- default (include "dflash-gateway.fullname" .) .Values.gateway.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.gateway.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* image reference from {repository, tag, digest}; call with (dict "image" .Values.x.image "default" tag). */}}
{{- define "dflash-gateway.image" -}}
{{- if .image.digest }}
{{- printf "%s@%s" .image.repository .image.digest }}
{{- else }}
{{- printf "%s:%s" .image.repository (default .default .image.tag | toString) }}
{{- end }}
{{- end }}

{{/* Discovery mode actually used: static when external worker URLs are given; with
workers.disaggregation, workers.disaggregation.discovery. */}}
{{- define "dflash-gateway.discoveryMode" -}}
{{- if .Values.externalWorkers.urls }}static
{{- else if eq (include "dflash-gateway.pd" .) "true" }}{{ .Values.workers.disaggregation.discovery }}
{{- else }}{{ .Values.gateway.discovery.mode }}{{ end }}
{{- end }}

{{/* The label selector of one PD role's EndpointSlices (its headless Service's). Call like
roleName. */}}
{{- define "dflash-gateway.roleSelectorString" -}}
{{- printf "kubernetes.io/service-name=%s" (include "dflash-gateway.roleName" .) }}
{{- end }}

{{- define "dflash-gateway.discoveryNamespace" -}}
{{- default .Release.Namespace .Values.gateway.discovery.namespace }}
{{- end }}

{{/* Secret holding client API keys (chart-made or existing); empty when none. */}}
{{- define "dflash-gateway.apiKeysSecret" -}}
{{- if .Values.gateway.apiKeys.existingSecret }}{{ .Values.gateway.apiKeys.existingSecret }}
{{- else if .Values.gateway.apiKeys.keys }}{{ include "dflash-gateway.fullname" . }}-api-keys
{{- end }}
{{- end }}

{{/* Secret holding the workers' API key (chart-made or existing); empty when none. */}}
{{- define "dflash-gateway.workerKeySecret" -}}
{{- if .Values.gateway.workerApiKey.existingSecret }}{{ .Values.gateway.workerApiKey.existingSecret }}
{{- else if .Values.gateway.workerApiKey.value }}{{ include "dflash-gateway.fullname" . }}-worker-api-key
{{- end }}
{{- end }}

{{/* The model name clients send (and the helm test uses). */}}
{{- define "dflash-gateway.servedModel" -}}
{{- default .Values.workers.sglang.modelPath .Values.workers.sglang.servedModelName }}
{{- end }}

{{/* Checks that values fit together; fails the render with a clear message otherwise. */}}
{{- define "dflash-gateway.validate" -}}
{{- if and .Values.workers.enabled .Values.externalWorkers.urls }}
{{- fail "externalWorkers.urls needs workers.enabled=false (the gateway uses one worker source)" }}
{{- end }}
{{- if and (not .Values.workers.enabled) (not .Values.externalWorkers.urls) (not (.Values.gateway.settings.discovery)) }}
{{- fail "workers.enabled=false needs externalWorkers.urls or gateway.settings.discovery (else the gateway has no workers)" }}
{{- end }}
{{- if eq .Values.workers.engine "vllm" }}
{{- if ne (int .Values.workers.gpus) (int .Values.workers.vllm.tensorParallelSize) }}
{{- fail (printf "workers.gpus (%d) must equal workers.vllm.tensorParallelSize (%d): a DFlash worker uses exactly tp GPUs" (int .Values.workers.gpus) (int .Values.workers.vllm.tensorParallelSize)) }}
{{- end }}
{{- if .Values.workers.priorityScheduling }}
{{- fail "workers.priorityScheduling is SGLang's (--enable-priority-scheduling): the gateway does not send priorities to vLLM workers" }}
{{- end }}
{{- else if ne (int .Values.workers.gpus) (int .Values.workers.sglang.tpSize) }}
{{- fail (printf "workers.gpus (%d) must equal workers.sglang.tpSize (%d): a DFLASH worker uses exactly tp GPUs" (int .Values.workers.gpus) (int .Values.workers.sglang.tpSize)) }}
{{- end }}
{{- if eq (include "dflash-gateway.pd" .) "true" }}
{{- if ne .Values.workers.engine "sglang" }}
{{- fail "workers.disaggregation runs SGLang's prefill and decode servers: it needs workers.engine sglang" }}
{{- end }}
{{- if .Values.workers.autoscaling.keda.enabled }}
{{- fail "workers.autoscaling.keda scales whole workers: turn it off with workers.disaggregation" }}
{{- end }}
{{- range $role := list "prefill" "decode" }}
{{- if ne (int (get $.Values.workers $role).gpus) (int $.Values.workers.sglang.tpSize) }}
{{- fail (printf "workers.%s.gpus (%d) must equal workers.sglang.tpSize (%d): DFLASH PD needs the same TP size on both roles" $role (int (get $.Values.workers $role).gpus) (int $.Values.workers.sglang.tpSize)) }}
{{- end }}
{{- end }}
{{- if eq (int .Values.workers.prefill.bootstrapPort) (int .Values.workers.port) }}
{{- fail "workers.prefill.bootstrapPort must differ from workers.port" }}
{{- end }}
{{- end }}
{{- if le (int .Values.gateway.terminationGracePeriodSeconds) (add (int .Values.gateway.preStopSleepSeconds) (int .Values.gateway.drainSeconds)) }}
{{- fail "gateway.terminationGracePeriodSeconds must exceed gateway.preStopSleepSeconds + gateway.drainSeconds" }}
{{- end }}
{{- if and .Values.gateway.autoscaling.enabled (lt (int .Values.gateway.autoscaling.maxReplicas) (int .Values.gateway.autoscaling.minReplicas)) }}
{{- fail "gateway.autoscaling.maxReplicas must be >= minReplicas" }}
{{- end }}
{{- $classes := dict "low" 0 "normal" 1 "high" 2 }}
{{- $policies := dict "tenants.default" .Values.tenants.default }}
{{- range $name, $policy := .Values.tenants.keys }}
{{- $_ := set $policies (printf "tenants.keys.%s" $name) $policy }}
{{- end }}
{{- range $where, $policy := $policies }}
{{- if gt (int (get $classes (default "normal" $policy.priority))) (int (get $classes (default "normal" $policy.maxPriority))) }}
{{- fail (printf "%s: priority must not be above maxPriority" $where) }}
{{- end }}
{{- end }}
{{- end }}

{{/* One tenant policy of the values (camelCase) as gateway settings (tenants.*): only the fields
given. */}}
{{- define "dflash-gateway.tenantPolicy" -}}
{{- $out := dict }}
{{- range $from, $to := dict "weight" "weight" "priority" "priority" "maxPriority" "max_priority" "tokensPerMin" "tokens_per_min" "tokensPerDay" "tokens_per_day" }}
{{- if and (hasKey $ $from) (not (kindIs "invalid" (get $ $from))) }}
{{- $_ := set $out $to (get $ $from) }}
{{- end }}
{{- end }}
{{- toYaml $out }}
{{- end }}
