{{/* Labels of every object of the chart. */}}
{{- define "sluice.labels" -}}
app.kubernetes.io/name: sluice
app.kubernetes.io/instance: {{ .Release.Name }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
helm.sh/chart: {{ printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" }}
{{- end }}

{{/* The manager pods' selector, as in config/manager. */}}
{{- define "sluice.managerSelector" -}}
app.kubernetes.io/name: sluice
app.kubernetes.io/component: manager
{{- end }}

{{/*
The documents of a file in files/ (a copy of config/, made by make manifests), parsed; empty
documents dropped.
*/}}
{{- define "sluice.documents" -}}
{{- $docs := list }}
{{- range $doc := regexSplit "(?m)^---\\s*$" (.root.Files.Get .file) -1 }}
{{- $o := fromYaml $doc }}
{{- if $o }}{{ $docs = append $docs $o }}{{ end }}
{{- end }}
{{- toJson $docs }}
{{- end }}

{{/* An image of the values ({repository, tag}), tagged the chart's appVersion when tag is empty. */}}
{{- define "sluice.image" -}}
{{- $image := index . 0 }}
{{- printf "%s:%s" $image.repository ($image.tag | default (index . 1)) }}
{{- end }}
