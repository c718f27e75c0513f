{{/* The chart's name, or nameOverride. */}}
{{- define "reservoir.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: every object of the release is named after it. At most 55
     characters, so that the longest name derived from it that must be a DNS label (63),
     the Service `<fullname>-metrics`, fits; the others (`-dashboard`, `-branchclaims`, the
     roles, the peering) may have 253. values.schema.json caps fullnameOverride at 55. */}}
{{- define "reservoir.fullname" -}}
{{- if .Values.fullnameOverride }}
{{- .Values.fullnameOverride | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- $name := default .Chart.Name .Values.nameOverride }}
{{- if contains $name .Release.Name }}
{{- .Release.Name | trunc 55 | trimSuffix "-" }}
{{- else }}
{{- printf "%s-%s" .Release.Name $name | trunc 55 | trimSuffix "-" }}
{{- end }}
{{- end }}
{{- end }}

{{- define "reservoir.chart" -}}
{{- printf "%s-%s" .Chart.Name .Chart.Version | replace "+" "_" | trunc 63 | trimSuffix "-" }}
{{- end }}

{{- define "reservoir.labels" -}}
helm.sh/chart: {{ include "reservoir.chart" . }}
{{ include "reservoir.selectorLabels" . }}
app.kubernetes.io/version: {{ .Chart.AppVersion | quote }}
app.kubernetes.io/managed-by: {{ .Release.Service }}
app.kubernetes.io/part-of: reservoir
{{- end }}

{{- define "reservoir.selectorLabels" -}}
app.kubernetes.io/name: {{ include "reservoir.name" . }}
app.kubernetes.io/instance: {{ .Release.Name }}
{{- end }}

{{- define "reservoir.serviceAccountName" -}}
{{- if .Values.serviceAccount.create }}
{{- default (include "reservoir.fullname" .) .Values.serviceAccount.name }}
{{- else }}
{{- required "serviceAccount.name is required when serviceAccount.create is false" .Values.serviceAccount.name }}
{{- end }}
{{- end }}

{{/* The kopf peering object's name: one per release. */}}
{{- define "reservoir.peeringName" -}}
{{- default (include "reservoir.fullname" .) .Values.peering.name }}
{{- end }}

{{- define "reservoir.image" -}}
{{- printf "%s:%s" .Values.image.repository (default .Chart.AppVersion .Values.image.tag) }}
{{- end }}

{{/* The operator's rules on Reservoir's kinds and the objects it reads or posts in a
     watched namespace (a Role per namespace, or the ClusterRole when cluster-wide). Each
     rule names exactly what the operator calls; see README "RBAC model". */}}
{{- define "reservoir.operatorRules" -}}
# kopf watches both kinds and patches finalizers and its annotations on them.
- apiGroups: ["reservoir.dev"]
  resources: ["reservationenvelopes"]
  verbs: ["get", "list", "watch", "patch"]
# ... and deletes settled claims past policy.settledClaimTTLSeconds.
- apiGroups: ["reservoir.dev"]
  resources: ["branchclaims"]
  verbs: ["get", "list", "watch", "patch", "delete"]
# The ledger (envelope status) and each claim's mirror of it: a PUT conditional on the
# resourceVersion, and merge patches for conditions.
- apiGroups: ["reservoir.dev"]
  resources: ["reservationenvelopes/status", "branchclaims/status"]
  verbs: ["update", "patch"]
# Claims' heartbeat Leases: renewal requests, read only (watched; one read again before
# a lease end is decided, in case the watch is behind).
- apiGroups: ["coordination.k8s.io"]
  resources: ["leases"]
  verbs: ["get", "list", "watch"]
# Workload pods labelled reservoir.dev/claim (PodScheduled/PodRunning commit points; patch
# lifts a GPU claim's hand-off gate), and the placeholder pods it creates and deletes to
# hold GPU claims' devices.
- apiGroups: [""]
  resources: ["pods"]
  verbs: ["list", "watch", "create", "delete", "patch"]
# A ResourceClaim per GPU claim: the scheduler allocates its devices (DRA).
- apiGroups: ["resource.k8s.io"]
  resources: ["resourceclaims"]
  verbs: ["list", "watch", "create", "delete"]
# Events: settlements, warnings, provider and loan news (kopf posts core/v1 Events).
- apiGroups: [""]
  resources: ["events"]
  verbs: ["create"]
{{- end }}

{{/* Cluster-scoped reads kopf makes at start-up (it retries a 403 for about a minute
     before it falls back, so the operator would start that late, logging errors): it
     watches CRDs to notice Reservoir's kinds being installed or upgraded, and, limited to
     namespaces, the Namespaces to see which of them exist. */}}
{{- define "reservoir.clusterRules" -}}
- apiGroups: ["apiextensions.k8s.io"]
  resources: ["customresourcedefinitions"]
  verbs: ["list", "watch"]
# Tenant pools (cluster-scoped): kopf watches them and patches finalizers; the pool's
# ledger is its status, written with a PUT conditional on the resourceVersion.
- apiGroups: ["reservoir.dev"]
  resources: ["reservationpools"]
  verbs: ["get", "list", "watch", "patch"]
- apiGroups: ["reservoir.dev"]
  resources: ["reservationpools/status"]
  verbs: ["update", "patch"]
{{- if .Values.watchNamespaces }}
- apiGroups: [""]
  resources: ["namespaces"]
  verbs: ["list", "watch"]
{{- end }}
{{- end }}
