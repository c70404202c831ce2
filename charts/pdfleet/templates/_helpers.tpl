{{/* Names, labels and the derived lists every template shares. */}}

{{- define "pdfleet.name" -}}
{{- .Chart.Name | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{- define "pdfleet.fullname" -}}
{{- if contains .Chart.Name .Release.Name -}}
{{- .Release.Name | trunc 50 | trimSuffix "-" -}}
{{- else -}}
{{- printf "%s-%s" .Release.Name .Chart.Name | trunc 50 | trimSuffix "-" -}}
{{- end -}}
{{- end -}}

{{- define "pdfleet.selectorLabels" -}}
app.kubernetes.io/name: {{ include "pdfleet.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/component: operator
{{- end -}}

{{- define "pdfleet.labels" -}}
{{ include "pdfleet.selectorLabels" . }}
app.kubernetes.io/part-of: pdfleet
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end -}}

{{- define "pdfleet.serviceAccountName" -}}
{{- default (include "pdfleet.fullname" .) .Values.serviceAccount.name -}}
{{- end -}}

{{/* The managed namespaces as a JSON list (empty when cluster-wide). */}}
{{- define "pdfleet.namespaces" -}}
{{- if .Values.watch.clusterWide -}}
{{- list | toJson -}}
{{- else if .Values.watch.namespaces -}}
{{- .Values.watch.namespaces | uniq | toJson -}}
{{- else -}}
{{- list .Release.Namespace | toJson -}}
{{- end -}}
{{- end -}}

{{- define "pdfleet.image" -}}
{{- if .Values.image.digest -}}
{{- printf "%s@%s" .Values.image.repository .Values.image.digest -}}
{{- else -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) -}}
{{- end -}}
{{- end -}}

{{- define "pdfleet.webhookService" -}}
{{- printf "%s-webhook" (include "pdfleet.fullname" .) -}}
{{- end -}}

{{- define "pdfleet.webhookSecret" -}}
{{- printf "%s-webhook-tls" (include "pdfleet.fullname" .) -}}
{{- end -}}

{{/* Cluster-scoped names carry the release namespace: two releases may share a cluster. */}}
{{- define "pdfleet.clusterName" -}}
{{- printf "%s-%s" (include "pdfleet.fullname" .) .Release.Namespace | trunc 63 | trimSuffix "-" -}}
{{- end -}}

{{/* The serving certificate's DNS names and IPs as {"dns": [...], "ips": [...]}. */}}
{{- define "pdfleet.webhookNames" -}}
{{- $svc := include "pdfleet.webhookService" . -}}
{{- $ns := .Release.Namespace -}}
{{- $dns := list $svc (printf "%s.%s" $svc $ns) (printf "%s.%s.svc" $svc $ns) (printf "%s.%s.svc.cluster.local" $svc $ns) -}}
{{- $ips := list -}}
{{- with .Values.webhook.url -}}
{{- $host := (urlParse .).hostname -}}
{{- if regexMatch "^[0-9.]+$|:" $host -}}
{{- $ips = append $ips $host -}}
{{- else -}}
{{- $dns = append $dns $host -}}
{{- end -}}
{{- end -}}
{{- dict "dns" $dns "ips" $ips | toJson -}}
{{- end -}}

{{/* The target labels pdfleet's rules and dashboard use (files/prometheus-rules.yaml): the deployment (a runtime
pod's pdfleet.io/deployment, a router pod's pdfleet.io/router), the role (prefill, decode, router) and the
generation key. The same relabelling as the e2e's Prometheus (tests/e2e/test_monitoring_runtimes.py). */}}
{{- define "pdfleet.monitorRelabelings" -}}
- sourceLabels: [__meta_kubernetes_pod_label_pdfleet_io_deployment, __meta_kubernetes_pod_label_pdfleet_io_router]
  separator: ""
  targetLabel: pdfleet_deployment
- sourceLabels: [__meta_kubernetes_pod_label_pdfleet_io_role]
  targetLabel: pdfleet_role
- sourceLabels: [__meta_kubernetes_pod_label_pdfleet_io_router]
  regex: .+
  targetLabel: pdfleet_role
  replacement: router
- sourceLabels: [__meta_kubernetes_pod_label_pdfleet_io_compat]
  targetLabel: pdfleet_compat
{{- end -}}

{{- define "pdfleet.namespaceSelector" -}}
{{- if .Values.watch.clusterWide }}
any: true
{{- else }}
matchNames: {{- include "pdfleet.namespaces" . | fromJsonArray | toYaml | nindent 2 }}
{{- end }}
{{- end -}}
