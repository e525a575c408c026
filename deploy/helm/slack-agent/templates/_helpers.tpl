{{- define "slack-agent.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "slack-agent.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "slack-agent.selectorLabels" -}}
app.kubernetes.io/name: {{ include "slack-agent.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{/* The serving pods only (the Deployment, Service, PDB, ServiceMonitor): never the
     migration Job's pod, which has no listener and must never be a Service endpoint. */}}
{{- define "slack-agent.serveSelectorLabels" -}}
{{ include "slack-agent.selectorLabels" . }}
app.kubernetes.io/component: serve
{{- end -}}

{{- define "slack-agent.labels" -}}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{ include "slack-agent.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
{{- end -}}

{{- define "slack-agent.serviceAccountName" -}}
{{- if .Values.serviceAccount.create -}}
{{- default (include "slack-agent.fullname" .) .Values.serviceAccount.name -}}
{{- else -}}
{{- default "default" .Values.serviceAccount.name -}}
{{- end -}}
{{- end -}}

{{- define "slack-agent.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}

{{/* The seconds the kubelet waits before SIGKILL: preStop + grace + wind-down, rounded up. */}}
{{- define "slack-agent.terminationGracePeriodSeconds" -}}
{{- $s := .Values.shutdown -}}
{{- add (ceil $s.preStopSeconds | int) (ceil $s.graceSeconds | int) (ceil $s.windDownSeconds | int) -}}
{{- end -}}

{{/* The variables every container of the release gets: the database, the settings, the
     grace (set here, so it cannot disagree with terminationGracePeriodSeconds). */}}
{{- define "slack-agent.env" -}}
{{- if not (or .Values.database.url .Values.database.existingSecret .Values.envFromSecrets) -}}
{{- fail "set database.url, database.existingSecret, or DATABASE_URL in one of envFromSecrets" -}}
{{- end -}}
{{- if .Values.database.existingSecret }}
- name: DATABASE_URL
  valueFrom:
    secretKeyRef:
      name: {{ .Values.database.existingSecret }}
      key: {{ .Values.database.secretKey }}
{{- else if .Values.database.url }}
- name: DATABASE_URL
  value: {{ .Values.database.url | quote }}
{{- end }}
- name: SHUTDOWN_GRACE_SECONDS
  value: {{ .Values.shutdown.graceSeconds | quote }}
{{- range $name, $value := .Values.env }}
{{- if ne $name "SHUTDOWN_GRACE_SECONDS" }}
- name: {{ $name }}
  value: {{ $value | quote }}
{{- end }}
{{- end }}
{{- end -}}

{{- define "slack-agent.envFrom" -}}
{{- range .Values.envFromSecrets }}
- secretRef:
    name: {{ . }}
{{- end }}
{{- end -}}
