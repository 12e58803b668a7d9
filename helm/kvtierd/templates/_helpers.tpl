{{/*
The chart name, truncated to the 63 characters of a label value.
*/}}
{{- define "kvtierd.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
The full name: release-chart, or the release name alone when it already holds the chart name.
*/}}
{{- define "kvtierd.fullname" -}}
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

{{/*
chart-version, the helm.sh/chart label.
*/}}
{{- define "kvtierd.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/*
Labels of every object.
*/}}
{{- define "kvtierd.labels" -}}
helm.sh/chart: {{ include "kvtierd.chart" . }}
{{ include "kvtierd.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: kvtierd
{{- end }}

{{/*
Selector labels: a small subset that never changes over upgrades (selectors are immutable).
*/}}
{{- define "kvtierd.selectorLabels" -}}
app.kubernetes.io/name: {{ include "kvtierd.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{/*
The daemon image: repository:tag, or repository@digest; the tag defaults to the appVersion.
*/}}
{{- define "kvtierd.image" -}}
{{- if .Values.image.digest }}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest }}
{{- else }}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}
{{- end }}

{{/*
The ServiceAccount name.
*/}}
{{- define "kvtierd.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "kvtierd.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- default "default" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/*
The tokens Secret name: the existing one, or the one the chart creates.
*/}}
{{- define "kvtierd.tokensSecretName" -}}
{{- default (printf "%s-tokens" (include "kvtierd.fullname" .)) .Values.tokens.existingSecret }}
{{- end }}

{{/*
The SSD claim name: the existing one, or the one the chart creates.
*/}}
{{- define "kvtierd.ssdClaimName" -}}
{{- default (printf "%s-ssd" (include "kvtierd.fullname" .)) .Values.ssd.persistentVolumeClaim.existingClaim }}
{{- end }}

{{/*
Checks of value combinations the schema cannot express; each fails the render with the fix.
*/}}
{{- define "kvtierd.validate" -}}
{{- $grace := .Values.config.server.grace_s | default 10 | float64 }}
{{- if le (float64 .Values.terminationGracePeriodSeconds) $grace }}
{{- fail (printf "terminationGracePeriodSeconds (%v) must exceed config.server.grace_s (%v): the daemon needs the grace period plus time to flush the T2 index before SIGKILL" .Values.terminationGracePeriodSeconds $grace) }}
{{- end }}
{{- if and .Values.tcp.enabled (not .Values.tls.enabled) (not .Values.tcp.insecure) }}
{{- fail "tcp.enabled needs tls.enabled (a kubernetes.io/tls Secret in tls.secretName), or tcp.insecure=true (UNSAFE: traffic in the clear)" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tls.secretName) }}
{{- fail "tls.enabled needs tls.secretName: a Secret of type kubernetes.io/tls (tls.crt, tls.key, and ca.crt with tls.requireClientCerts)" }}
{{- end }}
{{- if and .Values.tls.enabled (not .Values.tcp.enabled) }}
{{- fail "tls.enabled secures the TCP listener: set tcp.enabled=true too (the unix socket needs no TLS)" }}
{{- end }}
{{- if and .Values.tokens.enabled (not .Values.tokens.existingSecret) (not .Values.tokens.entries) }}
{{- fail "tokens.enabled needs tokens.existingSecret (a Secret with a key \"tokens\") or tokens.entries" }}
{{- end }}
{{- if and .Values.shm.enabled .Values.shm.hostPath }}
{{- fail "shm.enabled (a private memory-backed /dev/shm) and shm.hostPath (the node's /dev/shm) both mount /dev/shm: choose one" }}
{{- end }}
{{- if and .Values.ssd.localPersistentVolume.create (not .Values.ssd.localPersistentVolume.node) }}
{{- fail "ssd.localPersistentVolume.create needs ssd.localPersistentVolume.node: the hostname of the node holding the disk" }}
{{- end }}
{{- if and .Values.ssd.localPersistentVolume.create (ne .Values.ssd.type "persistentVolumeClaim") }}
{{- fail "ssd.localPersistentVolume.create goes with ssd.type=persistentVolumeClaim (the chart's claim binds to it)" }}
{{- end }}
{{- $encryption := .Values.encryption }}
{{- if and $encryption.enabled (not $encryption.existingSecret) }}
{{- fail "encryption.enabled needs encryption.existingSecret: a Secret holding the master key (kubectl create secret generic kvtierd-master-key --from-literal=master.key=$(openssl rand -hex 32))" }}
{{- end }}
{{- if and $encryption.enabled (eq .Values.ssd.type "none") }}
{{- fail "encryption.enabled seals the SSD tier's values: it needs T2 (ssd.type other than none)" }}
{{- end }}
{{- if and $encryption.enabled .Values.sidecarExample.enabled }}
{{- fail "encryption.enabled is not rendered into the sidecar example: its pod has no master-key init container" }}
{{- end }}
{{- $remote := .Values.remote }}
{{- if and (not (include "kvtierd.remoteEndpoints" .)) (or $remote.existingSecret $remote.tls.enabled $remote.tls.existingSecret) }}
{{- fail "remote.existingSecret and remote.tls configure the T3 store: set remote.endpoints too (its host:port seed nodes); without endpoints there is no T3" }}
{{- end }}
{{- if and $remote.tls.existingSecret (not $remote.tls.enabled) }}
{{- fail "remote.tls.existingSecret goes with remote.tls.enabled=true" }}
{{- end }}
{{- if and $remote.tls.existingSecret (not (or $remote.tls.caKey $remote.tls.certKey $remote.tls.keyKey)) }}
{{- fail "remote.tls.existingSecret needs remote.tls.caKey, or remote.tls.certKey and remote.tls.keyKey (the files to mount from it)" }}
{{- end }}
{{- if and $remote.tls.existingSecret (ne (empty $remote.tls.certKey) (empty $remote.tls.keyKey)) }}
{{- fail "remote.tls.certKey and remote.tls.keyKey go together (a client certificate and its key), or are both \"\"" }}
{{- end }}
{{- range .Values.extraEnv }}
{{- if and (eq (toString .name) "KVTIERD_REMOTE_PASSWORD") (hasKey . "value") }}
{{- fail "extraEnv: KVTIERD_REMOTE_PASSWORD as a plain value puts the store's password in the pod spec; use remote.existingSecret (mounted as the file remote.password_file)" }}
{{- end }}
{{- end }}
{{- range .Values.extraArgs }}
{{- if regexMatch "^(--set=)?remote\\.password=" . }}
{{- fail "extraArgs: remote.password on the command line puts the store's password in the pod spec; use remote.existingSecret (mounted as the file remote.password_file)" }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The daemon's configuration as a dict of TOML sections: config from the values, plus the keys the
chart owns because they must match the pod (listeners, mounted files, volumes, device).
*/}}
{{- define "kvtierd.configDict" -}}
{{- $c := deepCopy .Values.config }}
{{- $server := get $c "server" | default dict }}
{{- $_ := set $server "socket" (printf "%s/kvtierd.sock" (trimSuffix "/" .Values.socket.dir)) }}
{{- if not (kindIs "invalid" .Values.socket.groupId) }}
{{- $_ = set $server "socket_group" (printf "%d" (int .Values.socket.groupId)) }}
{{- end }}
{{- $_ = set $server "socket_mode" .Values.socket.mode }}
{{- $_ = set $server "health_tcp" (printf "0.0.0.0:%d" (int .Values.probes.healthPort)) }}
{{- if .Values.metrics.enabled }}
{{- $_ = set $server "metrics_host" "0.0.0.0" }}
{{- $_ = set $server "metrics_port" (int .Values.metrics.port) }}
{{- else }}
{{- $_ = set $server "metrics_port" -1 }}
{{- end }}
{{- if .Values.tcp.enabled }}
{{- $_ = set $server "tcp" (printf "0.0.0.0:%d" (int .Values.tcp.port)) }}
{{- if .Values.tcp.insecure }}
{{- $_ = set $server "insecure_tcp" true }}
{{- end }}
{{- end }}
{{- if .Values.tls.enabled }}
{{- $_ = set $server "tls_cert" "/etc/kvtierd/tls/tls.crt" }}
{{- $_ = set $server "tls_key" "/etc/kvtierd/tls/tls.key" }}
{{- if .Values.tls.requireClientCerts }}
{{- $_ = set $server "tls_client_ca" "/etc/kvtierd/tls/ca.crt" }}
{{- end }}
{{- end }}
{{- if .Values.tokens.enabled }}
{{- $_ = set $server "tokens_file" "/etc/kvtierd/tokens/tokens" }}
{{- end }}
{{- $_ = set $c "server" $server }}
{{- $pool := get $c "pool" | default dict }}
{{- $_ = set $pool "device" (ternary .Values.gpu.device "cpu" .Values.gpu.enabled) }}
{{- $_ = set $c "pool" $pool }}
{{- $ssd := get $c "ssd" | default dict }}
{{- $_ = set $ssd "directory" (ternary "" .Values.ssd.mountPath (eq .Values.ssd.type "none")) }}
{{- $_ = set $c "ssd" $ssd }}
{{- if .Values.encryption.enabled }}
{{- $_ = set $c "encryption" (dict "enabled" true "master_key_file" "/etc/kvtierd/master-key/master.key") }}
{{- end }}
{{- $endpoints := include "kvtierd.remoteEndpoints" . }}
{{- if $endpoints }}
{{- $_ = set $c "remote" (include "kvtierd.remoteConfig" . | fromYaml) }}
{{- else if hasKey $c "policy" }}
{{- /* No store, no T3: the T3 edges stay out, so the TOML of a release without T3 does not change. */}}
{{- $_ = unset (get $c "policy") "t1_to_t3" }}
{{- $_ = unset (get $c "policy") "t2_to_t3" }}
{{- end }}
{{- toYaml $c }}
{{- end }}

{{/*
remote.endpoints as the daemon's comma-separated "host:port" string ("" = no T3), from a list or a string.
*/}}
{{- define "kvtierd.remoteEndpoints" -}}
{{- $endpoints := .Values.remote.endpoints | default list }}
{{- if kindIs "string" $endpoints }}
{{- $endpoints = splitList "," $endpoints }}
{{- end }}
{{- $seeds := list }}
{{- range $endpoints }}
{{- with trim (toString .) }}
{{- $seeds = append $seeds . }}
{{- end }}
{{- end }}
{{- join "," $seeds }}
{{- end }}

{{/*
The [remote] section (T3) from remote.*: the store's settings, and the paths of the credential and TLS
files mounted from their Secrets (kvtierd.secretVolumes). The username comes from the Secret as the
env KVTIERD_REMOTE_USERNAME (kvtierd.env); the password is a file, never a value here.
*/}}
{{- define "kvtierd.remoteConfig" -}}
{{- $r := .Values.remote }}
{{- $remote := dict "endpoints" (include "kvtierd.remoteEndpoints" .) "mode" $r.mode "key_prefix" $r.keyPrefix
    "codec" $r.codec "timeout_s" $r.timeoutS "max_write_backlog_bytes" $r.maxWriteBacklogBytes
    "breaker_failures" $r.breaker.failures "breaker_open_s" $r.breaker.openS "ttl_s" $r.ttlS
    "probe_interval_s" $r.probeIntervalS
    "tls" (ternary true false $r.tls.enabled) }}
{{- if $r.existingSecret }}
{{- $_ := set $remote "password_file" "/etc/kvtierd/remote-auth/password" }}
{{- end }}
{{- if $r.tls.existingSecret }}
{{- if $r.tls.caKey }}
{{- $_ := set $remote "tls_ca_file" "/etc/kvtierd/remote-tls/ca.crt" }}
{{- end }}
{{- if $r.tls.certKey }}
{{- $_ := set $remote "tls_cert_file" "/etc/kvtierd/remote-tls/tls.crt" }}
{{- $_ := set $remote "tls_key_file" "/etc/kvtierd/remote-tls/tls.key" }}
{{- end }}
{{- end }}
{{- toYaml $remote }}
{{- end }}

{{/*
One TOML value: a string quoted (JSON escapes are valid TOML basic-string escapes), a whole number
as an integer (Helm reads every YAML number as a float, and toToml would print 9464 as 9464.0, which
the daemon refuses for an integer key), any other number as a float, a boolean as true/false.
*/}}
{{- define "kvtierd.tomlValue" -}}
{{- if kindIs "string" . }}
{{- toJson . }}
{{- else if kindIs "bool" . }}
{{- ternary "true" "false" . }}
{{- else if or (kindIs "float64" .) (kindIs "float32" .) }}
{{- if eq (float64 .) (floor .) }}
{{- printf "%d" (int64 .) }}
{{- else }}
{{- printf "%v" . }}
{{- end }}
{{- else if or (kindIs "int" .) (kindIs "int64" .) }}
{{- printf "%d" . }}
{{- else }}
{{- fail (printf "config: a TOML value must be a string, number or boolean, got %v" .) }}
{{- end }}
{{- end }}

{{/*
/etc/kvtierd/kvtierd.toml: top-level keys, then one table per section, then [quotas."tenant"].
Keys are sorted, so the rendering (and the checksum annotation) is stable.
*/}}
{{- define "kvtierd.toml" -}}
{{- $c := include "kvtierd.configDict" . | fromYaml -}}
# kvtierd serve configuration, rendered by the Helm chart {{ include "kvtierd.chart" . }} from .Values.config
# (keys in README "Configuration"). Any key can be overridden by KVTIERD_SECTION_KEY or --set.
{{- range $key := keys $c | sortAlpha }}
{{- $value := get $c $key }}
{{- if not (kindIs "map" $value) }}
{{ $key }} = {{ include "kvtierd.tomlValue" $value }}
{{- end }}
{{- end }}
{{- range $section := list "server" "pool" "host" "ssd" "policy" "remote" "encryption" }}
{{- if hasKey $c $section }}
{{- $table := get $c $section | default dict }}

[{{ $section }}]
{{- range $key := keys $table | sortAlpha }}
{{ $key }} = {{ include "kvtierd.tomlValue" (get $table $key) }}
{{- end }}
{{- end }}
{{- end }}
{{- $quotas := get $c "quotas" | default dict }}
{{- range $tenant := keys $quotas | sortAlpha }}
{{- $quota := get $quotas $tenant }}

[quotas.{{ toJson $tenant }}]
{{- range $key := keys $quota | sortAlpha }}
{{ $key }} = {{ include "kvtierd.tomlValue" (get $quota $key) }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The daemon container, shared by the DaemonSet and the sidecar example (with `sidecar` true it
becomes a native sidecar: restartPolicy Always, and a startup probe that holds the runner back
until the daemon serves). Call with (dict "root" $ "sidecar" bool).
*/}}
{{- define "kvtierd.container" -}}
{{- $root := .root }}
{{- $v := $root.Values -}}
- name: kvtierd
  image: {{ include "kvtierd.image" $root | quote }}
  imagePullPolicy: {{ $v.image.pullPolicy }}
  {{- if .sidecar }}
  restartPolicy: Always
  {{- end }}
  args:
    - --config
    - /etc/kvtierd/kvtierd.toml
    {{- with $v.extraArgs }}
    {{- toYaml . | nindent 4 }}
    {{- end }}
  {{- with include "kvtierd.env" $root | trim }}
  env:
    {{- . | nindent 4 }}
  {{- end }}
  ports:
    - name: health
      containerPort: {{ $v.probes.healthPort }}
      protocol: TCP
    {{- if $v.metrics.enabled }}
    - name: metrics
      containerPort: {{ $v.metrics.port }}
      protocol: TCP
    {{- end }}
    {{- if $v.tcp.enabled }}
    - name: grpc
      containerPort: {{ $v.tcp.port }}
      protocol: TCP
    {{- end }}
  startupProbe:
    grpc:
      port: {{ $v.probes.healthPort }}
      service: kvtierd.v1.KvTier
    periodSeconds: {{ $v.probes.startup.periodSeconds }}
    timeoutSeconds: {{ $v.probes.startup.timeoutSeconds }}
    failureThreshold: {{ $v.probes.startup.failureThreshold }}
  livenessProbe:
    grpc:
      port: {{ $v.probes.healthPort }}
      service: ""
    initialDelaySeconds: {{ $v.probes.liveness.initialDelaySeconds }}
    periodSeconds: {{ $v.probes.liveness.periodSeconds }}
    timeoutSeconds: {{ $v.probes.liveness.timeoutSeconds }}
    failureThreshold: {{ $v.probes.liveness.failureThreshold }}
  readinessProbe:
    grpc:
      port: {{ $v.probes.healthPort }}
      service: kvtierd.v1.KvTier
    initialDelaySeconds: {{ $v.probes.readiness.initialDelaySeconds }}
    periodSeconds: {{ $v.probes.readiness.periodSeconds }}
    timeoutSeconds: {{ $v.probes.readiness.timeoutSeconds }}
    failureThreshold: {{ $v.probes.readiness.failureThreshold }}
  {{- $resources := deepCopy $v.resources }}
  {{- if and $v.gpu.enabled (gt (int $v.gpu.count) 0) }}
  {{- $limits := get $resources "limits" | default dict }}
  {{- $_ := set $limits $v.gpu.resourceName (int $v.gpu.count) }}
  {{- $_ = set $resources "limits" $limits }}
  {{- end }}
  {{- with $resources }}
  resources:
    {{- toYaml . | nindent 4 }}
  {{- end }}
  securityContext:
    {{- toYaml $v.securityContext | nindent 4 }}
  volumeMounts:
    - name: config
      mountPath: /etc/kvtierd/kvtierd.toml
      subPath: kvtierd.toml
      readOnly: true
    - name: socket
      mountPath: {{ $v.socket.dir }}
    {{- if ne $v.ssd.type "none" }}
    - name: ssd
      mountPath: {{ $v.ssd.mountPath }}
    {{- end }}
    - name: tmp
      mountPath: /tmp
    {{- if or .sidecar $v.shm.enabled $v.shm.hostPath }}
    - name: shm
      mountPath: /dev/shm
    {{- end }}
    {{- if $v.tls.enabled }}
    - name: tls
      mountPath: /etc/kvtierd/tls
      readOnly: true
    {{- end }}
    {{- if $v.tokens.enabled }}
    - name: tokens
      mountPath: /etc/kvtierd/tokens
      readOnly: true
    {{- end }}
    {{- if $v.encryption.enabled }}
    - name: master-key
      mountPath: /etc/kvtierd/master-key
      readOnly: true
    {{- end }}
    {{- if and (include "kvtierd.remoteEndpoints" $root) $v.remote.existingSecret }}
    - name: remote-auth
      mountPath: /etc/kvtierd/remote-auth
      readOnly: true
    {{- end }}
    {{- if and (include "kvtierd.remoteEndpoints" $root) $v.remote.tls.existingSecret }}
    - name: remote-tls
      mountPath: /etc/kvtierd/remote-tls
      readOnly: true
    {{- end }}
{{- end }}

{{/*
The daemon's environment: the T3 store's username from its Secret (a secretKeyRef, so the pod spec
holds no credential), then extraEnv.
*/}}
{{- define "kvtierd.env" -}}
{{- $r := .Values.remote }}
{{- if and (include "kvtierd.remoteEndpoints" .) $r.existingSecret $r.usernameKey }}
- name: KVTIERD_REMOTE_USERNAME
  valueFrom:
    secretKeyRef:
      name: {{ $r.existingSecret }}
      key: {{ $r.usernameKey }}
{{- end }}
{{- with .Values.extraEnv }}
{{ toYaml . }}
{{- end }}
{{- end }}

{{/*
Volumes of the daemon other than the socket and the SSD tier (whose kind depends on the mode).
*/}}
{{- define "kvtierd.commonVolumes" -}}
- name: config
  configMap:
    name: {{ include "kvtierd.fullname" . }}
- name: tmp
  emptyDir:
    {{- if .Values.tmpSizeLimit }}
    sizeLimit: {{ .Values.tmpSizeLimit }}
    {{- end }}
{{- if .Values.shm.hostPath }}
- name: shm
  hostPath:
    path: /dev/shm
    type: Directory
{{- else if .Values.shm.enabled }}
- name: shm
  emptyDir:
    medium: Memory
    sizeLimit: {{ .Values.shm.sizeLimit }}
{{- end }}
{{- include "kvtierd.secretVolumes" . }}
{{- end }}

{{/*
The Secret volumes of the daemon, shared by the DaemonSet and the sidecar example: the TLS of the TCP
listener, the bearer tokens, and the T3 store's password and TLS files.
*/}}
{{- define "kvtierd.secretVolumes" -}}
{{- if .Values.tls.enabled }}
- name: tls
  secret:
    secretName: {{ .Values.tls.secretName }}
    defaultMode: 0440
{{- end }}
{{- if .Values.tokens.enabled }}
- name: tokens
  secret:
    secretName: {{ include "kvtierd.tokensSecretName" . }}
    defaultMode: 0440
    items:
      - key: tokens
        path: tokens
{{- end }}
{{- if .Values.encryption.enabled }}
- name: master-key-secret
  secret:
    secretName: {{ .Values.encryption.existingSecret }}
    defaultMode: 0400
    items:
      - key: {{ .Values.encryption.secretKey }}
        path: master.key
- name: master-key
  emptyDir:
    medium: Memory
    sizeLimit: 1Mi
{{- end }}
{{- $r := .Values.remote }}
{{- if include "kvtierd.remoteEndpoints" . }}
{{- if $r.existingSecret }}
- name: remote-auth
  secret:
    secretName: {{ $r.existingSecret }}
    defaultMode: 0440
    items:
      - key: {{ $r.passwordKey }}
        path: password
{{- end }}
{{- if $r.tls.existingSecret }}
- name: remote-tls
  secret:
    secretName: {{ $r.tls.existingSecret }}
    defaultMode: 0440
    items:
      {{- with $r.tls.caKey }}
      - key: {{ . }}
        path: ca.crt
      {{- end }}
      {{- if $r.tls.certKey }}
      - key: {{ $r.tls.certKey }}
        path: tls.crt
      - key: {{ $r.tls.keyKey }}
        path: tls.key
      {{- end }}
{{- end }}
{{- end }}
{{- end }}

{{/*
The pod securityContext: podSecurityContext, with socket.groupId among its supplementalGroups when
it is not the pod's own group (the daemon gives both sockets to that group, so it must be a member).
*/}}
{{- define "kvtierd.podSecurityContext" -}}
{{- $context := deepCopy .Values.podSecurityContext }}
{{- $gid := .Values.socket.groupId }}
{{- if and (not (kindIs "invalid" $gid)) (ne (int $gid) (int (.Values.securityContext.runAsGroup | default -1))) }}
{{- $groups := get $context "supplementalGroups" | default list }}
{{- if not (has (int $gid) $groups) }}
{{- $_ := set $context "supplementalGroups" (append $groups (int $gid)) }}
{{- end }}
{{- end }}
{{- toYaml $context }}
{{- end }}

{{/*
The group of the socket directory: socket.groupId, else the daemon's group.
*/}}
{{- define "kvtierd.socketGroupId" -}}
{{- if kindIs "invalid" .Values.socket.groupId }}{{ .Values.securityContext.runAsGroup }}{{ else }}{{ int .Values.socket.groupId }}{{ end }}
{{- end }}

{{/*
The init container that puts the master key where the daemon reads it: copied from its Secret volume,
mode 0400, into a memory-backed emptyDir. A Secret volume's files are group-readable under the pod's
fsGroup (the kubelet adds the group's read bit), and the daemon refuses a key file others may read.
*/}}
{{- define "kvtierd.masterKeyInit" -}}
- name: master-key
  image: {{ include "kvtierd.image" . | quote }}
  imagePullPolicy: {{ .Values.image.pullPolicy }}
  command: ["install", "-m", "0400", "/etc/kvtierd/master-key-secret/master.key", "/etc/kvtierd/master-key/master.key"]
  securityContext:
    {{- toYaml .Values.securityContext | nindent 4 }}
  resources:
    requests:
      cpu: 10m
      memory: 16Mi
    limits:
      memory: 64Mi
  volumeMounts:
    - name: master-key-secret
      mountPath: /etc/kvtierd/master-key-secret
      readOnly: true
    - name: master-key
      mountPath: /etc/kvtierd/master-key
{{- end }}
