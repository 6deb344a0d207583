{{/*
Names and labels.
*/}}
{{- define "kv-bridge.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kv-bridge.fullname" -}}
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

{{- define "kv-bridge.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "kv-bridge.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kv-bridge.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "kv-bridge.labels" -}}
helm.sh/chart: {{ include "kv-bridge.chart" . }}
{{ include "kv-bridge.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- with .Values.commonLabels }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Labels every pod carrying the sidecar gets (the PodMonitor selects on them).
*/}}
{{- define "kv-bridge.sidecarPodLabels" -}}
kv-bridge/sidecar: "true"
kv-bridge/release: {{ .Release.Name }}
{{- end }}

{{- define "kv-bridge.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kv-bridge.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{- define "kv-bridge.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
vLLM's --kv-events-config value (compact JSON). vLLM binds the PUB socket only
for wildcard endpoints (tcp://*:PORT); a host name would make it connect.
*/}}
{{- define "kv-bridge.kvEventsConfig" -}}
{{- $cfg := dict "enable_kv_cache_events" true "publisher" "zmq" "endpoint" (printf "tcp://*:%d" (int .Values.kvEvents.port)) "topic" .Values.kvEvents.topic }}
{{- if gt (int .Values.kvEvents.replayPort) 0 }}
{{- $_ := set $cfg "replay_endpoint" (printf "tcp://*:%d" (int .Values.kvEvents.replayPort)) }}
{{- end }}
{{- $cfg = merge $cfg (deepCopy .Values.kvEvents.extraConfig) }}
{{- toJson $cfg }}
{{- end }}

{{/*
The NATS URL, rendered through tpl. Fails when neither url nor urlSecret is set.
*/}}
{{- define "kv-bridge.natsUrl" -}}
{{- $nats := .Values.bridge.nats }}
{{- if and (not $nats.url) (not $nats.urlSecret.name) }}
{{- fail "bridge.nats.url (or bridge.nats.urlSecret.name) is required: the kv-bridge image ships no embedded nats-server" }}
{{- end }}
{{- tpl $nats.url . }}
{{- end }}

{{/*
Secret files the sidecar reads, as a list of {secret, key, path} under
/etc/kv-bridge/nats. Returned as YAML: {"files": [...]}.
*/}}
{{- define "kv-bridge.secretFiles" -}}
{{- $nats := .Values.bridge.nats }}
{{- $files := list }}
{{- if $nats.credsSecret.name }}
{{- $files = append $files (dict "secret" $nats.credsSecret.name "key" $nats.credsSecret.key "path" "creds/nats.creds" "env" "KVB_NATS_CREDS_FILE") }}
{{- end }}
{{- if $nats.nkeySeedSecret.name }}
{{- $files = append $files (dict "secret" $nats.nkeySeedSecret.name "key" $nats.nkeySeedSecret.key "path" "nkey/seed.nk" "env" "KVB_NATS_NKEY_SEED_FILE") }}
{{- end }}
{{- if $nats.passwordSecret.name }}
{{- $files = append $files (dict "secret" $nats.passwordSecret.name "key" $nats.passwordSecret.key "path" "password/password" "env" "KVB_NATS_PASSWORD_FILE") }}
{{- end }}
{{- if $nats.tokenSecret.name }}
{{- $files = append $files (dict "secret" $nats.tokenSecret.name "key" $nats.tokenSecret.key "path" "token/token" "env" "KVB_NATS_TOKEN_FILE") }}
{{- end }}
{{- if $nats.tls.enabled }}
{{- if $nats.tls.caSecret.name }}
{{- $files = append $files (dict "secret" $nats.tls.caSecret.name "key" $nats.tls.caSecret.key "path" "tls/ca.crt" "env" "KVB_NATS_TLS_CA") }}
{{- end }}
{{- if $nats.tls.clientCertSecret.name }}
{{- $files = append $files (dict "secret" $nats.tls.clientCertSecret.name "key" $nats.tls.clientCertSecret.certKey "path" "tls/tls.crt" "env" "KVB_NATS_TLS_CERT") }}
{{- $files = append $files (dict "secret" $nats.tls.clientCertSecret.name "key" $nats.tls.clientCertSecret.keyKey "path" "tls/tls.key" "env" "KVB_NATS_TLS_KEY") }}
{{- end }}
{{- end }}
{{- toYaml (dict "files" $files) }}
{{- end }}

{{- define "kv-bridge.secretsMountPath" -}}
/etc/kv-bridge/nats
{{- end }}

{{/*
Per-pod credentials: where the pod's own .creds file is mounted (a directory
of its own: the projected secrets volume is read-only and cannot take a file
mounted inside it). Fails on settings that cannot work.
*/}}
{{- define "kv-bridge.podCredsPath" -}}
/etc/kv-bridge/pod/nats.creds
{{- end }}

{{- define "kv-bridge.podCreds" -}}
{{- $per := .Values.bridge.nats.credsPerPod }}
{{- if $per.secretName }}
{{- if .Values.bridge.nats.credsSecret.name }}
{{- fail "bridge.nats.credsPerPod and bridge.nats.credsSecret exclude each other: each pod has its own credentials, or all share one" }}
{{- end }}
{{- if and (eq .Values.mode "workload") (ne .Values.vllm.kind "StatefulSet") }}
{{- fail "bridge.nats.credsPerPod needs vllm.kind StatefulSet: the Secret's keys are the pod names, which a Deployment does not know in advance" }}
{{- end }}
{{- $per.secretName }}
{{- end }}
{{- end }}

{{/*
The sidecar's environment.
*/}}
{{- define "kv-bridge.sidecar.env" -}}
{{- $b := .Values.bridge }}
{{- $nats := $b.nats -}}
- name: POD_NAME
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
- name: POD_NAMESPACE
  valueFrom:
    fieldRef:
      fieldPath: metadata.namespace
{{- if $b.workerId }}
- name: KVB_WORKER_ID
  value: {{ $b.workerId | quote }}
{{- else }}
- name: KVB_WORKER_ID
  valueFrom:
    fieldRef:
      fieldPath: metadata.name
{{- end }}
{{- if $b.vllmUrl }}
- name: KVB_VLLM_URL
  value: {{ eq $b.vllmUrl "auto" | ternary (printf "http://127.0.0.1:%d" (int .Values.vllm.port)) $b.vllmUrl | quote }}
{{- else }}
- name: KVB_ZMQ_ENDPOINT
  value: {{ printf "tcp://127.0.0.1:%d" (int .Values.kvEvents.port) | quote }}
{{- if gt (int .Values.kvEvents.replayPort) 0 }}
- name: KVB_REPLAY_ENDPOINT
  value: {{ printf "tcp://127.0.0.1:%d" (int .Values.kvEvents.replayPort) | quote }}
{{- end }}
- name: KVB_DP_RANKS
  value: {{ $b.dpRanks | quote }}
- name: KVB_TOPIC
  value: {{ .Values.kvEvents.topic | quote }}
{{- end }}
- name: KVB_SUBJECT_PREFIX
  value: {{ $b.subjectPrefix | quote }}
- name: KVB_FORMAT
  value: {{ $b.format | quote }}
{{- with $b.groupKinds }}
- name: KVB_GROUP_KIND
  value: {{ join "," . | quote }}
{{- end }}
- name: KVB_KEEP_PLACEHOLDERS
  value: {{ $b.keepPlaceholders | quote }}
{{- if not (kindIs "invalid" $b.maxFrameBytes) }}
- name: KVB_MAX_FRAME_BYTES
  value: {{ $b.maxFrameBytes | int64 | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.maxBufferedBatches) }}
- name: KVB_MAX_BUFFERED_BATCHES
  value: {{ $b.maxBufferedBatches | int64 | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.maxBufferedBytes) }}
- name: KVB_MAX_BUFFERED_BYTES
  value: {{ $b.maxBufferedBytes | int64 | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.replayTimeout) }}
- name: KVB_REPLAY_TIMEOUT
  value: {{ $b.replayTimeout | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.coalesceMs) }}
- name: KVB_COALESCE_MS
  value: {{ $b.coalesceMs | quote }}
{{- end }}
- name: KVB_HTTP_HOST
  value: "0.0.0.0"
- name: KVB_HTTP_PORT
  value: {{ $b.httpPort | quote }}
- name: KVB_LOG_FORMAT
  value: {{ $b.logFormat | quote }}
- name: KVB_LOG_LEVEL
  value: {{ $b.logLevel | quote }}
- name: KVB_DRAIN_TIMEOUT
  value: {{ $b.drainTimeout | quote }}
{{- if $nats.urlSecret.name }}
- name: KVB_NATS_URL
  valueFrom:
    secretKeyRef:
      name: {{ $nats.urlSecret.name }}
      key: {{ $nats.urlSecret.key }}
{{- else }}
- name: KVB_NATS_URL
  value: {{ include "kv-bridge.natsUrl" . | quote }}
{{- end }}
{{- if $nats.user }}
- name: KVB_NATS_USER
  value: {{ $nats.user | quote }}
{{- end }}
{{- range (include "kv-bridge.secretFiles" . | fromYaml).files }}
- name: {{ .env }}
  value: {{ printf "%s/%s" (include "kv-bridge.secretsMountPath" $) .path | quote }}
{{- end }}
{{- if include "kv-bridge.podCreds" . }}
- name: KVB_NATS_CREDS_FILE
  value: {{ include "kv-bridge.podCredsPath" . | quote }}
{{- end }}
{{- if $b.jetstream.enabled }}
- name: KVB_JETSTREAM
  value: "true"
- name: KVB_STREAM_NAME
  value: {{ $b.jetstream.streamName | quote }}
{{- if not (kindIs "invalid" $b.jetstream.maxAge) }}
- name: KVB_STREAM_MAX_AGE
  value: {{ $b.jetstream.maxAge | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.jetstream.maxBytes) }}
- name: KVB_STREAM_MAX_BYTES
  value: {{ $b.jetstream.maxBytes | int64 | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.jetstream.maxMsgsPerSubject) }}
- name: KVB_STREAM_MAX_MSGS_PER_SUBJECT
  value: {{ $b.jetstream.maxMsgsPerSubject | int64 | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.jetstream.duplicateWindow) }}
- name: KVB_STREAM_DUPLICATE_WINDOW
  value: {{ $b.jetstream.duplicateWindow | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.jetstream.replicas) }}
- name: KVB_STREAM_REPLICAS
  value: {{ $b.jetstream.replicas | int64 | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.jetstream.maxPending) }}
- name: KVB_JS_MAX_PENDING
  value: {{ $b.jetstream.maxPending | int64 | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.jetstream.maxPendingBytes) }}
- name: KVB_JS_MAX_PENDING_BYTES
  value: {{ $b.jetstream.maxPendingBytes | int64 | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.jetstream.ackTimeout) }}
- name: KVB_JS_ACK_TIMEOUT
  value: {{ $b.jetstream.ackTimeout | quote }}
{{- end }}
{{- end }}
{{- /* Always set: the bridge keeps snapshots unless told otherwise, so a false must reach it. */}}
- name: KVB_SNAPSHOTS
  value: {{ $b.snapshots.enabled | quote }}
{{- if $b.snapshots.enabled }}
- name: KVB_SNAPSHOT_BUCKET
  value: {{ $b.snapshots.bucket | quote }}
{{- if not (kindIs "invalid" $b.snapshots.interval) }}
- name: KVB_SNAPSHOT_INTERVAL
  value: {{ $b.snapshots.interval | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.snapshots.events) }}
- name: KVB_SNAPSHOT_EVENTS
  value: {{ $b.snapshots.events | int64 | quote }}
{{- end }}
{{- if not (kindIs "invalid" $b.snapshots.logBytes) }}
- name: KVB_SNAPSHOT_LOG_BYTES
  value: {{ $b.snapshots.logBytes | int64 | quote }}
{{- end }}
{{- end }}
{{- with $b.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
The sidecar container: a native sidecar (an init container with
restartPolicy: Always), so it starts before vLLM, lives as long as the pod and
stops after vLLM.
*/}}
{{- define "kv-bridge.sidecar.container" -}}
{{- $b := .Values.bridge }}
{{- $secretFiles := (include "kv-bridge.secretFiles" . | fromYaml).files -}}
- name: kv-bridge
  image: {{ include "kv-bridge.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  restartPolicy: Always
  args:
    - run
    {{- range $b.extraArgs }}
    - {{ . | quote }}
    {{- end }}
  env:
    {{- include "kv-bridge.sidecar.env" . | nindent 4 }}
  {{- with $b.envFrom }}
  envFrom:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  ports:
    - name: kvb-metrics
      containerPort: {{ $b.httpPort }}
      protocol: TCP
  {{- if $b.startupProbe.enabled }}
  startupProbe:
    httpGet:
      path: /healthz
      port: kvb-metrics
    periodSeconds: {{ $b.startupProbe.periodSeconds }}
    timeoutSeconds: {{ $b.startupProbe.timeoutSeconds }}
    failureThreshold: {{ $b.startupProbe.failureThreshold }}
  {{- end }}
  {{- if $b.livenessProbe.enabled }}
  livenessProbe:
    httpGet:
      path: /healthz
      port: kvb-metrics
    periodSeconds: {{ $b.livenessProbe.periodSeconds }}
    timeoutSeconds: {{ $b.livenessProbe.timeoutSeconds }}
    failureThreshold: {{ $b.livenessProbe.failureThreshold }}
  {{- end }}
  {{- if $b.readinessProbe.enabled }}
  readinessProbe:
    httpGet:
      path: /readyz
      port: kvb-metrics
    periodSeconds: {{ $b.readinessProbe.periodSeconds }}
    timeoutSeconds: {{ $b.readinessProbe.timeoutSeconds }}
    failureThreshold: {{ $b.readinessProbe.failureThreshold }}
  {{- end }}
  {{- with $b.resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  {{- with $b.securityContext }}
  securityContext:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  volumeMounts:
    - name: kv-bridge-tmp
      mountPath: /tmp
    {{- if $secretFiles }}
    - name: kv-bridge-nats-secrets
      mountPath: {{ include "kv-bridge.secretsMountPath" . }}
      readOnly: true
    {{- end }}
    {{- if include "kv-bridge.podCreds" . }}
    # Only this pod's key of the Secret ($(POD_NAME) is the env var above).
    - name: kv-bridge-nats-pod-creds
      mountPath: {{ include "kv-bridge.podCredsPath" . }}
      subPathExpr: {{ printf "$(POD_NAME)%s" .Values.bridge.nats.credsPerPod.keySuffix | quote }}
      readOnly: true
    {{- end }}
    {{- with $b.extraVolumeMounts }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
{{- end }}

{{/*
The sidecar's volumes: a small in-memory /tmp (the root filesystem is read-only)
and, when any NATS secret is configured, one projected volume mapping each
Secret key to a file. The volume is mounted only into the sidecar.
*/}}
{{- define "kv-bridge.sidecar.volumes" -}}
{{- $secretFiles := (include "kv-bridge.secretFiles" . | fromYaml).files -}}
- name: kv-bridge-tmp
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.bridge.tmpSizeLimit }}
{{- with include "kv-bridge.podCreds" . }}
- name: kv-bridge-nats-pod-creds
  secret:
    secretName: {{ . }}
    defaultMode: 0444
{{- end }}
{{- if $secretFiles }}
- name: kv-bridge-nats-secrets
  projected:
    # Mounted only into the kv-bridge container, which runs as one non-root user
    # whatever the pod's fsGroup is, hence world-readable inside that container.
    defaultMode: 0444
    sources:
      {{- range $secretFiles }}
      - secret:
          name: {{ .secret }}
          items:
            - key: {{ .key }}
              path: {{ .path }}
      {{- end }}
{{- end }}
{{- end }}
