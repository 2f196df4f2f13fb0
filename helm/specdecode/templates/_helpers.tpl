{{/*
Chart name, truncated to 63 characters (the DNS label limit).
*/}}
{{- define "specdecode.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Full name: <release>-<chart>, or the release name when it already contains the chart name.
Truncated to 50 characters so that "<fullname>-orchestrator" stays within 63.
*/}}
{{- define "specdecode.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 50 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 50 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
Chart name and version, for the helm.sh/chart label.
*/}}
{{- define "specdecode.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Common labels.
*/}}
{{- define "specdecode.labels" -}}
helm.sh/chart: {{ include "specdecode.chart" . }}
{{ include "specdecode.selectorLabels" . }}
{{- if .Chart.AppVersion }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
{{- end }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: {{ include "specdecode.name" . }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Selector labels (release-wide).
*/}}
{{- define "specdecode.selectorLabels" -}}
app.kubernetes.io/name: {{ include "specdecode.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
Name of a component's resources. Call with (dict "root" $ "component" "scorer").
*/}}
{{- define "specdecode.componentName" -}}
{{- printf "%s-%s" (include "specdecode.fullname" .root) .component }}
{{- end }}

{{/*
Labels of a component's resources. Call with (dict "root" $ "component" "scorer").
*/}}
{{- define "specdecode.componentLabels" -}}
{{ include "specdecode.labels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
Selector labels of a component's pods. Call with (dict "root" $ "component" "scorer").
*/}}
{{- define "specdecode.componentSelectorLabels" -}}
{{ include "specdecode.selectorLabels" .root }}
app.kubernetes.io/component: {{ .component }}
{{- end }}

{{/*
In-cluster address (DNS name and port) of a component's Service.
Call with (dict "root" $ "component" "scorer").
*/}}
{{- define "specdecode.address" -}}
{{- $values := index .root.Values .component }}
{{- printf "%s.%s.svc:%d" (include "specdecode.componentName" .) .root.Release.Namespace (int $values.port) }}
{{- end }}

{{/*
Image reference: [global.imageRegistry/]repository, then @digest or :tag. A component's override
(repository, tag, digest) replaces the top-level image's; the top-level digest is kept only
when the override names neither a repository nor a tag.
Call with (dict "root" $ "image" <override with repository, tag and digest>).
*/}}
{{- define "specdecode.image" -}}
{{- $repository := .root.Values.image.repository }}
{{- $tag := default .root.Chart.AppVersion .root.Values.image.tag }}
{{- $digest := .root.Values.image.digest }}
{{- with .image }}
{{- if or .repository .tag .digest }}{{ $digest = .digest }}{{ end }}
{{- if .repository }}{{ $repository = .repository }}{{ end }}
{{- if .tag }}{{ $tag = .tag }}{{ end }}
{{- end }}
{{- with (.root.Values.global | default dict).imageRegistry }}
{{- $repository = printf "%s/%s" (trimSuffix "/" .) $repository }}
{{- end }}
{{- if $digest }}
{{- printf "%s@%s" $repository $digest }}
{{- else }}
{{- printf "%s:%s" $repository (toString $tag) }}
{{- end }}
{{- end }}

{{/*
Service account name.
*/}}
{{- define "specdecode.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "specdecode.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
Pod security context. Call with (dict "root" $ "groups" <extra supplemental groups>).
*/}}
{{- define "specdecode.podSecurityContext" -}}
{{- $sc := .root.Values.securityContext }}
{{- $groups := concat $sc.supplementalGroups (.groups | default list) | uniq }}
runAsNonRoot: true
runAsUser: {{ $sc.runAsUser }}
runAsGroup: {{ $sc.runAsGroup }}
fsGroup: {{ $sc.fsGroup }}
{{- with $groups }}
supplementalGroups:
  {{- toYaml . | nindent 2 }}
{{- end }}
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Container security context: non-root, read-only root filesystem, no privilege escalation,
all capabilities dropped, seccomp RuntimeDefault.
*/}}
{{- define "specdecode.containerSecurityContext" -}}
runAsNonRoot: true
runAsUser: {{ .Values.securityContext.runAsUser }}
runAsGroup: {{ .Values.securityContext.runAsGroup }}
allowPrivilegeEscalation: false
privileged: false
readOnlyRootFilesystem: true
capabilities:
  drop:
    - ALL
seccompProfile:
  type: RuntimeDefault
{{- end }}

{{/*
Whether a component's pods mount the models volume ("true" or "").
Call with (dict "root" $ "component" "proposer").
*/}}
{{- define "specdecode.mountsModels" -}}
{{- if ne .root.Values.models.source "none" }}
{{- if eq .component "proposer" }}
{{- if ne .root.Values.proposer.model "ngram" }}true{{ end }}
{{- else }}true{{ end }}
{{- end }}
{{- end }}

{{/*
The scorer's --device: scorer.device, else derived from the accelerator type.
*/}}
{{- define "specdecode.scorerDevice" -}}
{{- if .Values.scorer.device }}
{{- .Values.scorer.device }}
{{- else }}
{{- get (dict "npu" "npu" "nvidia" "cuda" "cpu" "cpu") .Values.scorer.accelerator.type }}
{{- end }}
{{- end }}

{{/*
Native gRPC probes against grpc.health.v1.Health. Call with (dict "root" $ "values" <component values>).
*/}}
{{- define "specdecode.probes" -}}
{{- $probes := mergeOverwrite (deepCopy .root.Values.probes) (deepCopy (.values.probes | default dict)) }}
{{- $tls := .root.Values.tls }}
{{- range $kind := list "startup" "readiness" "liveness" }}
{{- $p := index $probes $kind }}
{{ $kind }}Probe:
  {{- if $tls.enabled }}
  # The kubelet's gRPC probes cannot speak TLS: the same health check, over mutual TLS.
  exec:
    command:
      - python
      - -m
      - specdecode.serving.probe
      - --address
      - {{ printf "127.0.0.1:%v" $.values.port | quote }}
      - --server-name
      - {{ printf "%s.%s.svc" (include "specdecode.componentName" (dict "root" $.root "component" $.component)) $.root.Release.Namespace | quote }}
      - --tls-ca
      - {{ printf "%s/ca.crt" $tls.mountPath | quote }}
      - --tls-cert
      - {{ printf "%s/tls.crt" $tls.mountPath | quote }}
      - --tls-key
      - {{ printf "%s/tls.key" $tls.mountPath | quote }}
      - --service
      - {{ $.root.Values.grpc.healthService | quote }}
      - --timeout
      - {{ $p.timeoutSeconds | quote }}
  {{- else }}
  grpc:
    port: {{ $.values.port }}
    service: {{ $.root.Values.grpc.healthService | quote }}
  {{- end }}
  initialDelaySeconds: {{ $p.initialDelaySeconds }}
  periodSeconds: {{ $p.periodSeconds }}
  timeoutSeconds: {{ $p.timeoutSeconds }}
  failureThreshold: {{ $p.failureThreshold }}
  {{- if ne $kind "startup" }}
  successThreshold: 1
  {{- end }}
{{- end }}
{{- end }}

{{/*
Environment every server container gets: downward API, OpenTelemetry, caches.
Call with (dict "root" $ "component" "scorer" "device" "npu").
*/}}
{{- define "specdecode.serverEnv" -}}
{{- $root := .root }}
{{- $otel := $root.Values.otel }}
- name: K8S_POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: K8S_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
- name: K8S_POD_UID
  valueFrom:
    fieldRef:
      fieldPath: metadata.uid
- name: K8S_NODE_NAME
  valueFrom:
    fieldRef:
      fieldPath: spec.nodeName
- name: OTEL_SERVICE_NAME
  value: {{ printf "%s-%s" $otel.serviceNamePrefix .component | quote }}
{{- $attrs := list "k8s.namespace.name=$(K8S_NAMESPACE)" "k8s.pod.name=$(K8S_POD_NAME)" "k8s.pod.uid=$(K8S_POD_UID)" "k8s.node.name=$(K8S_NODE_NAME)" }}
{{- $attrs = append $attrs (printf "k8s.deployment.name=%s" (include "specdecode.componentName" .)) }}
{{- $attrs = append $attrs (printf "k8s.container.name=%s" .component) }}
{{- $attrs = append $attrs "service.instance.id=$(K8S_POD_NAME)" }}
{{- $attrs = append $attrs (printf "service.version=%s" $root.Chart.AppVersion) }}
{{- range $k, $v := $otel.resourceAttributes }}
{{- $attrs = append $attrs (printf "%s=%s" $k (toString $v)) }}
{{- end }}
- name: OTEL_RESOURCE_ATTRIBUTES
  value: {{ join "," $attrs | quote }}
{{- if $otel.endpoint }}
- name: OTEL_EXPORTER_OTLP_ENDPOINT
  value: {{ $otel.endpoint | quote }}
- name: OTEL_EXPORTER_OTLP_PROTOCOL
  value: {{ $otel.protocol | quote }}
{{- else }}
- name: OTEL_TRACES_EXPORTER
  value: "none"
{{- end }}
- name: OTEL_TRACES_SAMPLER
  value: {{ $otel.sampler | quote }}
- name: OTEL_TRACES_SAMPLER_ARG
  value: {{ $otel.samplerArg | toString | quote }}
{{ include "specdecode.cacheEnv" $root }}
{{- if $root.Values.offline }}
- name: HF_HUB_OFFLINE
  value: "1"
- name: TRANSFORMERS_OFFLINE
  value: "1"
{{- end }}
{{- if ne .device "npu" }}
# torch_npu (in images built with the [npu] extra) must not autoload where there is no NPU.
- name: TORCH_DEVICE_BACKEND_AUTOLOAD
  value: "0"
{{- end }}
{{- end }}

{{/*
Writable HOME and caches on the emptyDirs (the root filesystem is read-only).
*/}}
{{- define "specdecode.cacheEnv" -}}
- name: HOME
  value: /tmp
- name: XDG_CACHE_HOME
  value: /cache
- name: HF_HOME
  value: /cache/huggingface
{{- end }}

{{/*
The emptyDir volumes behind /tmp and /cache.
*/}}
{{- define "specdecode.scratchVolumes" -}}
- name: tmp
  emptyDir:
    {{- with .Values.scratch.tmpSizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
- name: cache
  emptyDir:
    {{- with .Values.scratch.cacheSizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}

{{/*
Mounts of the scratch volumes.
*/}}
{{- define "specdecode.scratchMounts" -}}
- name: tmp
  mountPath: /tmp
- name: cache
  mountPath: /cache
{{- end }}

{{/*
The models volume for the chosen models.source.
*/}}
{{- define "specdecode.modelsVolume" -}}
{{- $m := .Values.models }}
- name: models
{{- if eq $m.source "pvc" }}
  persistentVolumeClaim:
    claimName: {{ $m.pvc.claimName }}
    readOnly: true
{{- else if eq $m.source "hostPath" }}
  hostPath:
    path: {{ $m.hostPath.path }}
    type: {{ $m.hostPath.type }}
{{- else if eq $m.source "initContainer" }}
  emptyDir:
    {{- with $m.emptyDir.medium }}
    medium: {{ . }}
    {{- end }}
    {{- with $m.emptyDir.sizeLimit }}
    sizeLimit: {{ . }}
    {{- end }}
{{- end }}
{{- end }}

{{/*
Checks on values that the schema cannot express; rendering fails with a clear message.
*/}}
{{- define "specdecode.validate" -}}
{{- $v := .Values }}
{{- $needed := add (int $v.drainGraceSeconds) (int $v.preStopSleepSeconds) }}
{{- if le (int $v.terminationGracePeriodSeconds) (int $needed) }}
{{- fail (printf "terminationGracePeriodSeconds (%d) must be greater than drainGraceSeconds (%d) + preStopSleepSeconds (%d) = %d: the servers drain in-flight requests for drainGraceSeconds after SIGTERM, which comes after the preStop sleep, and Kubernetes kills them terminationGracePeriodSeconds after termination starts" (int $v.terminationGracePeriodSeconds) (int $v.drainGraceSeconds) (int $v.preStopSleepSeconds) (int $needed)) }}
{{- end }}
{{- if and (eq $v.models.source "pvc") (not $v.models.pvc.claimName) }}
{{- fail "models.source is pvc but models.pvc.claimName is empty: name an existing PersistentVolumeClaim" }}
{{- end }}
{{- if and (eq $v.models.source "hostPath") (not $v.models.hostPath.path) }}
{{- fail "models.source is hostPath but models.hostPath.path is empty: name the model directory on the node" }}
{{- end }}
{{- range $c := list "proposer" "scorer" "orchestrator" }}
{{- $cv := index $v $c }}
{{- if and $cv.pdb.enabled (ne (toString $cv.pdb.minAvailable) "") (ne (toString $cv.pdb.maxUnavailable) "") }}
{{- fail (printf "%s.pdb: set minAvailable or maxUnavailable, not both (set the other to \"\")" $c) }}
{{- end }}
{{- if and $cv.pdb.enabled (eq (toString $cv.pdb.minAvailable) "") (eq (toString $cv.pdb.maxUnavailable) "") }}
{{- fail (printf "%s.pdb is enabled: set minAvailable or maxUnavailable" $c) }}
{{- end }}
{{- with $cv.autoscaling }}
{{- if .enabled }}
{{- if gt (int .minReplicas) (int .maxReplicas) }}
{{- fail (printf "%s.autoscaling.minReplicas (%d) is greater than maxReplicas (%d)" $c (int .minReplicas) (int .maxReplicas)) }}
{{- end }}
{{- $sequences := and (gt (int (.runningSequencesPerPod | default 0)) 0) $v.prometheusAdapter.enabled }}
{{- if and (ne $c "scorer") (eq (int .targetCPUUtilizationPercentage) 0) (eq (int .targetMemoryUtilizationPercentage) 0) (not $sequences) }}
{{- if eq $c "orchestrator" }}
{{- fail "orchestrator.autoscaling is enabled but has no target it can use: runningSequencesPerPod needs prometheusAdapter.enabled=true (prometheus-adapter serving specdecode_running_sequences, see the chart README), or set targetCPUUtilizationPercentage or targetMemoryUtilizationPercentage" }}
{{- end }}
{{- fail (printf "%s.autoscaling is enabled but has no target: set targetCPUUtilizationPercentage or targetMemoryUtilizationPercentage" $c) }}
{{- end }}
{{- if and (eq $c "scorer") (eq .mode "hpa") (not $v.prometheusAdapter.enabled) }}
{{- fail "scorer.autoscaling.mode is hpa, whose External metric needs prometheusAdapter.enabled=true (prometheus-adapter serving specdecode_waiting_requests, see the chart README); or use mode keda" }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- include "specdecode.validateRoutes" . }}
{{- range $c := list "proposer" "scorer" "orchestrator" }}
{{- $cv := index $v $c }}
{{- if eq (int $cv.port) (int $cv.metricsPort) }}
{{- fail (printf "%s.port and %s.metricsPort are both %d: give them different ports" $c $c (int $cv.port)) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The Secret with the servers' certificate (tls.crt, tls.key, ca.crt).
*/}}
{{- define "specdecode.tlsSecretName" -}}
{{- .Values.tls.secretName | default (printf "%s-tls" (include "specdecode.fullname" .)) }}
{{- end }}

{{/*
Server flags for TLS (and the orchestrator's bearer tokens). Call with (dict "root" $ "component" "scorer");
renders a JSON list, read back with fromJsonArray.
*/}}
{{- define "specdecode.securityArgs" -}}
{{- $root := .root }}
{{- $args := list }}
{{- if $root.Values.tls.enabled }}
{{- $dir := $root.Values.tls.mountPath }}
{{- $args = list "--tls-cert" (printf "%s/tls.crt" $dir) "--tls-key" (printf "%s/tls.key" $dir) }}
{{- if eq .component "orchestrator" }}
{{- $args = concat $args (list "--service-tls-ca" (printf "%s/ca.crt" $dir)) }}
{{- else }}
{{- $args = concat $args (list "--tls-ca" (printf "%s/ca.crt" $dir)) }}
{{- end }}
{{- end }}
{{- if and (eq .component "orchestrator") $root.Values.auth.tokenSecret }}
{{- $args = concat $args (list "--auth-token-file" (printf "/etc/specdecode/auth/%s" $root.Values.auth.tokenKey)) }}
{{- end }}
{{- toJson $args }}
{{- end }}

{{/*
PromQL label matchers that pick this release's series (alerts, the KEDA trigger).
*/}}
{{- define "specdecode.metricsSelector" -}}
{{- .Values.metrics.prometheusRule.selector | default (printf "namespace=%q, job=~%q" .Release.Namespace (printf "%s-.*" (include "specdecode.fullname" .))) }}
{{- end }}

{{/*
Checks on the orchestrator's routes (Gateway API, InferencePool).
*/}}
{{- define "specdecode.validateRoutes" -}}
{{- $o := .Values.orchestrator }}
{{- $gw := $o.gateway }}
{{- if $gw.enabled }}
{{- if and (not $gw.parentRefs) (not $gw.create.enabled) }}
{{- fail "orchestrator.gateway is enabled but attaches to no Gateway: set orchestrator.gateway.parentRefs or orchestrator.gateway.create.enabled" }}
{{- end }}
{{- if and $gw.http.enabled (eq (int $o.httpPort) 0) }}
{{- fail "orchestrator.gateway.http routes the HTTP API, which is off (orchestrator.httpPort 0): set httpPort or gateway.http.enabled=false" }}
{{- end }}
{{- if $gw.create.enabled }}
{{- if not (and $gw.create.className $gw.create.tlsSecretName) }}
{{- fail "orchestrator.gateway.create needs className (your GatewayClass) and tlsSecretName (the listeners' certificate)" }}
{{- end }}
{{- range $route := list "http" "grpc" }}
{{- if and (index $gw $route).enabled (not (index $gw $route).hostnames) }}
{{- fail (printf "orchestrator.gateway.%s.hostnames: the chart's Gateway gives each host name an HTTPS listener; name at least one" $route) }}
{{- end }}
{{- end }}
{{- end }}
{{- end }}
{{- if and $o.ingress.enabled $o.ingress.http.enabled (eq (int $o.httpPort) 0) }}
{{- fail "orchestrator.ingress.http routes the HTTP API, which is off (orchestrator.httpPort 0): set httpPort or ingress.http.enabled=false" }}
{{- end }}
{{- if $o.inferencePool.enabled }}
{{- if eq (int $o.httpPort) 0 }}
{{- fail "orchestrator.inferencePool pools the HTTP API, which is off (orchestrator.httpPort 0)" }}
{{- end }}
{{- if not $o.inferencePool.endpointPicker.name }}
{{- fail "orchestrator.inferencePool.endpointPicker.name: name the endpoint picker's Service" }}
{{- end }}
{{- end }}
{{- end }}
