{{/*
The Deployment of one server. Call with (dict "root" $ "component" "scorer" "device" "npu" "args" <server flags>).
The scorer also gets its accelerator: device resource, placement, runtime environment and host mounts.
*/}}
{{- define "specdecode.deployment" -}}
{{- $root := .root }}
{{- $c := .component }}
{{- $v := index $root.Values $c }}
{{- $ctx := dict "root" $root "component" $c }}
{{- $mountsModels := include "specdecode.mountsModels" $ctx }}
{{- $accType := "cpu" }}
{{- $acc := dict }}
{{- if eq $c "scorer" }}
{{- $accType = $v.accelerator.type }}
{{- if ne $accType "cpu" }}
{{- $acc = index $v.accelerator $accType }}
{{- end }}
{{- end }}
{{- /* resources, with the accelerator's extended resource in requests and limits */}}
{{- $resources := deepCopy $v.resources }}
{{- if $acc }}
{{- $devices := dict $acc.resourceName (int $v.accelerator.count) }}
{{- $_ := set $resources "requests" (merge (deepCopy $devices) ($resources.requests | default dict)) }}
{{- $_ := set $resources "limits" (merge (deepCopy $devices) ($resources.limits | default dict)) }}
{{- end }}
{{- $nodeSelector := merge (deepCopy ($v.nodeSelector | default dict)) (deepCopy ($acc.nodeSelector | default dict)) }}
{{- $tolerations := concat ($acc.tolerations | default list) ($v.tolerations | default list) }}
{{- $groups := list }}
{{- if eq $accType "npu" }}
{{- $groups = $acc.supplementalGroups | default list }}
{{- end }}
{{- $args := concat .args (include "specdecode.securityArgs" $ctx | fromJsonArray) ($v.extraArgs | default list) }}
apiVersion: apps/v1
kind: Deployment
metadata:
  name: {{ include "specdecode.componentName" $ctx }}
  namespace: {{ $root.Release.Namespace }}
  labels:
    {{- include "specdecode.componentLabels" $ctx | nindent 4 }}
spec:
  {{- if not (and $v.autoscaling $v.autoscaling.enabled) }}
  replicas: {{ $v.replicaCount }}
  {{- end }}
  revisionHistoryLimit: 5
  {{- with $v.strategy }}
  strategy:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  selector:
    matchLabels:
      {{- include "specdecode.componentSelectorLabels" $ctx | nindent 6 }}
  template:
    metadata:
      {{- $annotations := merge (deepCopy ($v.podAnnotations | default dict)) (deepCopy ($root.Values.podAnnotations | default dict)) }}
      {{- if $root.Values.metrics.podAnnotations }}
      {{- $_ := set $annotations "prometheus.io/scrape" "true" }}
      {{- $_ := set $annotations "prometheus.io/port" (toString $v.metricsPort) }}
      {{- $_ := set $annotations "prometheus.io/path" "/metrics" }}
      {{- end }}
      {{- with $annotations }}
      annotations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      labels:
        {{- include "specdecode.componentLabels" $ctx | nindent 8 }}
        {{- with (merge (deepCopy ($v.podLabels | default dict)) (deepCopy ($root.Values.podLabels | default dict))) }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
    spec:
      serviceAccountName: {{ include "specdecode.serviceAccountName" $root }}
      automountServiceAccountToken: {{ $root.Values.serviceAccount.automountServiceAccountToken }}
      # No Docker-link variables: a Service named like <release>-proposer would otherwise inject
      # SPECDECODE_PROPOSER_PORT=tcp://..., which collides with the CLI's SPECDECODE_* settings.
      enableServiceLinks: false
      {{- with $root.Values.imagePullSecrets }}
      imagePullSecrets:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      securityContext:
        {{- include "specdecode.podSecurityContext" (dict "root" $root "groups" $groups) | trim | nindent 8 }}
      terminationGracePeriodSeconds: {{ $root.Values.terminationGracePeriodSeconds }}
      {{- if and (eq $accType "nvidia") $acc.runtimeClassName }}
      runtimeClassName: {{ $acc.runtimeClassName }}
      {{- end }}
      {{- with $v.priorityClassName }}
      priorityClassName: {{ . }}
      {{- end }}
      {{- $modelsInit := and $mountsModels (eq $root.Values.models.source "initContainer") }}
      {{- if or $modelsInit $v.initContainers }}
      initContainers:
      {{- end }}
      {{- if $modelsInit }}
      {{- $init := $root.Values.models.initContainer }}
        - name: prepare-models
          image: {{ include "specdecode.image" (dict "root" $root "image" $init.image) | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          {{- with $init.command }}
          command:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- with $init.args }}
          args:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          env:
            - name: MODELS_DIR
              value: {{ $root.Values.models.mountPath | quote }}
            - name: SPECDECODE_COMPONENT
              value: {{ $c | quote }}
            {{- include "specdecode.cacheEnv" $root | nindent 12 }}
            {{- with $init.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          resources:
            {{- toYaml $init.resources | nindent 12 }}
          securityContext:
            {{- include "specdecode.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            {{- include "specdecode.scratchMounts" $root | nindent 12 }}
            - name: models
              mountPath: {{ $root.Values.models.mountPath }}
      {{- end }}
      {{- with $v.initContainers }}
        {{- toYaml . | nindent 8 }}
      {{- end }}
      containers:
        - name: {{ $c }}
          image: {{ include "specdecode.image" (dict "root" $root "image" $v.image) | quote }}
          imagePullPolicy: {{ $root.Values.image.pullPolicy }}
          args:
            {{- range $args }}
            - {{ toString . | quote }}
            {{- end }}
          ports:
            - name: grpc
              containerPort: {{ $v.port }}
              protocol: TCP
            - name: metrics
              containerPort: {{ $v.metricsPort }}
              protocol: TCP
            {{- if $v.httpPort }}
            - name: http
              containerPort: {{ $v.httpPort }}
              protocol: TCP
            {{- end }}
          env:
            {{- include "specdecode.serverEnv" (dict "root" $root "component" $c "device" .device) | trim | nindent 12 }}
            {{- if eq $accType "npu" }}
            - name: ASCEND_RT_VISIBLE_DEVICES
              {{- $visible := $acc.visibleDevices }}
              {{- if not $visible }}
              {{- $ids := list }}
              {{- range $i := until (int $v.accelerator.count) }}
              {{- $ids = append $ids (toString $i) }}
              {{- end }}
              {{- $visible = join "," $ids }}
              {{- end }}
              value: {{ $visible | quote }}
            {{- end }}
            {{- with $acc.env }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $root.Values.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
            {{- with $v.extraEnv }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
          {{- with $v.envFrom }}
          envFrom:
            {{- toYaml . | nindent 12 }}
          {{- end }}
          {{- include "specdecode.probes" (dict "root" $root "values" $v "component" $c) | trim | nindent 10 }}
          {{- if $root.Values.preStopSleepSeconds }}
          lifecycle:
            preStop:
              exec:
                command:
                  - sleep
                  - {{ $root.Values.preStopSleepSeconds | quote }}
          {{- end }}
          resources:
            {{- toYaml $resources | nindent 12 }}
          securityContext:
            {{- include "specdecode.containerSecurityContext" $root | nindent 12 }}
          volumeMounts:
            {{- include "specdecode.scratchMounts" $root | nindent 12 }}
            {{- if $root.Values.tls.enabled }}
            - name: tls
              mountPath: {{ $root.Values.tls.mountPath }}
              readOnly: true
            {{- end }}
            {{- if and (eq $c "orchestrator") $root.Values.auth.tokenSecret }}
            - name: auth-tokens
              mountPath: /etc/specdecode/auth
              readOnly: true
            {{- end }}
            {{- if $mountsModels }}
            - name: models
              mountPath: {{ $root.Values.models.mountPath }}
              readOnly: true
              {{- if and (eq $root.Values.models.source "pvc") $root.Values.models.pvc.subPath }}
              subPath: {{ $root.Values.models.pvc.subPath }}
              {{- end }}
            {{- end }}
            {{- if eq $accType "npu" }}
            {{- range $acc.hostPathMounts }}
            - name: {{ .name }}
              mountPath: {{ .mountPath }}
              readOnly: true
            {{- end }}
            {{- end }}
            {{- if $v.shm.enabled }}
            - name: dshm
              mountPath: /dev/shm
            {{- end }}
            {{- with $v.extraVolumeMounts }}
            {{- toYaml . | nindent 12 }}
            {{- end }}
        {{- with $v.sidecars }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      volumes:
        {{- include "specdecode.scratchVolumes" $root | nindent 8 }}
        {{- if $root.Values.tls.enabled }}
        # Mounted whole (no subPath), so a renewed certificate reaches the running server.
        - name: tls
          secret:
            secretName: {{ include "specdecode.tlsSecretName" $root }}
        {{- end }}
        {{- if and (eq $c "orchestrator") $root.Values.auth.tokenSecret }}
        - name: auth-tokens
          secret:
            secretName: {{ $root.Values.auth.tokenSecret }}
        {{- end }}
        {{- if $mountsModels }}
        {{- include "specdecode.modelsVolume" $root | trim | nindent 8 }}
        {{- end }}
        {{- if eq $accType "npu" }}
        {{- range $acc.hostPathMounts }}
        - name: {{ .name }}
          hostPath:
            path: {{ .hostPath }}
            {{- with .type }}
            type: {{ . }}
            {{- end }}
        {{- end }}
        {{- end }}
        {{- if $v.shm.enabled }}
        # /dev/shm in memory: the container runtime's default is 64 MiB.
        - name: dshm
          emptyDir:
            medium: Memory
            {{- with $v.shm.sizeLimit }}
            sizeLimit: {{ . }}
            {{- end }}
        {{- end }}
        {{- with $v.extraVolumes }}
        {{- toYaml . | nindent 8 }}
        {{- end }}
      {{- with $nodeSelector }}
      nodeSelector:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $tolerations }}
      tolerations:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.affinity }}
      affinity:
        {{- toYaml . | nindent 8 }}
      {{- end }}
      {{- with $v.topologySpreadConstraints }}
      topologySpreadConstraints:
        {{- toYaml . | nindent 8 }}
      {{- end }}
{{- end }}
