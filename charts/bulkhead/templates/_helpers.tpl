{{/* Names and labels shared by the templates. */}}
{{- define "bulkhead.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 63 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "bulkhead.image" -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}

{{- define "bulkhead.labels" -}}
app.kubernetes.io/name: bulkhead
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version }}
{{- end -}}

{{- define "bulkhead.selector" -}}
app.kubernetes.io/name: bulkhead
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end -}}

{{- define "bulkhead.operatorName" -}}
{{ include "bulkhead.fullname" . }}-operator
{{- end -}}

{{- define "bulkhead.agentName" -}}
{{ include "bulkhead.fullname" . }}-agent
{{- end -}}
