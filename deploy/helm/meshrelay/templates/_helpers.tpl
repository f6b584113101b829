{{/* meshrelay, or meshrelay-<revision>: the name of every object. */}}
{{- define "meshrelay.fullname" -}}
{{- if .Values.revision -}}meshrelay-{{ .Values.revision }}{{- else -}}meshrelay{{- end -}}
{{- end -}}

{{/* The pods' selector: unique per tier, so two revisions never select each other's relays. */}}
{{- define "meshrelay.selectorLabels" -}}
app: {{ include "meshrelay.fullname" . }}
{{- end -}}

{{/* Labels of every object, after istiod's: app, istio.io/rev, release. */}}
{{- define "meshrelay.labels" -}}
{{ include "meshrelay.selectorLabels" . }}
app.kubernetes.io/name: meshrelay
istio.io/rev: {{ .Values.revision | default "default" }}
release: {{ .Release.Name }}
{{- end -}}

{{/* The gossip cluster name: gossip of another name is dropped. */}}
{{- define "meshrelay.cluster" -}}
{{- if .Values.tier.cluster -}}{{ .Values.tier.cluster }}
{{- else if .Values.revision -}}{{ .Release.Namespace }}-{{ .Values.revision }}
{{- else -}}{{ .Release.Namespace }}{{- end -}}
{{- end -}}

{{- define "meshrelay.spiffe" -}}
spiffe://{{ .root.Values.meshConfig.trustDomain }}/ns/{{ .root.Release.Namespace }}/sa/{{ .sa }}
{{- end -}}

{{- define "meshrelay.xdsSecret" -}}
{{ .Values.xds.tls.secretName | default (printf "%s-xds-tls" (include "meshrelay.fullname" .)) }}
{{- end -}}

{{- define "meshrelay.peerSecret" -}}
{{ .Values.tier.peerSecretName | default (printf "%s-peer-tls" (include "meshrelay.fullname" .)) }}
{{- end -}}

{{- define "meshrelay.gossipSecret" -}}
{{ .Values.tier.gossipKey.existingSecret | default (printf "%s-gossip" (include "meshrelay.fullname" .)) }}
{{- end -}}

{{- define "meshrelay.sealSecret" -}}
{{ .Values.etcd.sealKey.existingSecret | default (printf "%s-seal" (include "meshrelay.fullname" .)) }}
{{- end -}}

{{/* etcd client URLs: the endpoints given, else the in-cluster trial etcd, else none. */}}
{{- define "meshrelay.etcdEndpoints" -}}
{{- if .Values.etcd.endpoints -}}{{ join "," .Values.etcd.endpoints }}
{{- else if .Values.etcd.inCluster.enabled -}}http://{{ include "meshrelay.fullname" . }}-etcd.{{ .Release.Namespace }}.svc:2379
{{- end -}}
{{- end -}}

{{/* Whether sidecars' tokens are verified by TokenReview. */}}
{{- define "meshrelay.tokenReview" -}}
{{- if and .Values.xds.tls.enabled (has .Values.xds.tls.auth (list "jwt" "any")) (eq .Values.xds.tls.jwtVerifier "tokenreview") -}}true{{- end -}}
{{- end -}}

{{- define "meshrelay.adminScheme" -}}
{{- if .Values.admin.tls -}}HTTPS{{- else -}}HTTP{{- end -}}
{{- end -}}

{{/* A generated key: the existing Secret's when there is one (lookup, at install), else 32 random bytes, base64. */}}
{{- define "meshrelay.generatedKey" -}}
{{- $existing := lookup "v1" "Secret" .root.Release.Namespace .name -}}
{{- if and $existing $existing.data (index $existing.data "key") -}}
{{ index $existing.data "key" }}
{{- else -}}
{{ randBytes 32 | b64enc }}
{{- end -}}
{{- end -}}

{{/* The host of upstream.address (istiod's Service), without the port. */}}
{{- define "meshrelay.upstreamHost" -}}
{{- regexReplaceAll ":[0-9]+$" .Values.upstream.address "" -}}
{{- end -}}

{{/* The admin port's name: Istio picks a Service port's protocol by its name's prefix, and https- is TLS (passed through), http- plaintext HTTP. */}}
{{- define "meshrelay.adminPortName" -}}
{{- if .Values.admin.tls -}}https-admin{{- else -}}http-admin{{- end -}}
{{- end -}}
