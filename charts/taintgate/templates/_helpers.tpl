{{/* The agent config file, as the ConfigMap carries it. */}}
{{- define "taintgate.config" -}}
{{ toYaml .Values.config }}
{{- end -}}

{{/* The ConfigMap's name: with a hash of its content, as kustomize's configMapGenerator
     names it, so a changed config rolls the DaemonSet. */}}
{{- define "taintgate.configMapName" -}}
taintgate-config-{{ include "taintgate.config" . | sha256sum | trunc 10 }}
{{- end -}}

{{/* The image reference: by digest when one is given. */}}
{{- define "taintgate.image" -}}
{{- if .Values.image.digest -}}
{{ .Values.image.repository }}@{{ .Values.image.digest }}
{{- else -}}
{{ .Values.image.repository }}:{{ .Values.image.tag | default .Chart.AppVersion }}
{{- end -}}
{{- end -}}

{{/* Non-empty when the images stage has images to check: only then is the CRI runtime's
     socket directory mounted (containerd's socket is node root). */}}
{{- define "taintgate.imagesMount" -}}
{{- if and .Values.config.stages.images.enabled .Values.config.images.images -}}
true
{{- end -}}
{{- end -}}

{{/* Non-empty when a monitoring object renders: `enabled` is true, or `auto` and the
     cluster serves the Prometheus Operator's API. Call with (list ENABLED $). */}}
{{- define "taintgate.monitoring" -}}
{{- $enabled := index . 0 -}}
{{- $root := index . 1 -}}
{{- if or (eq (toString $enabled) "true") (and (eq (toString $enabled) "auto") ($root.Capabilities.APIVersions.Has "monitoring.coreos.com/v1")) -}}
true
{{- end -}}
{{- end -}}
