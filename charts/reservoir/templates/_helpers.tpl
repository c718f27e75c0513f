{{/* The chart's name, or nameOverride. */}}
{{- define "reservoir.name" -}}
{{- default .Chart.Name .Values.nameOverride | trunc 63 | trimSuffix "-" }}
{{- end }}

{{/* The release's full name: every object of the release is named after it. At most 55
     characters, so that the longest name derived from it that must be a DNS label (63),
     the Service `<fullname>-metrics`, fits; the others (`-dashboard`, `-placement`, the
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

{{- /* The metrics Service's name: a DNS-1035 label, so no dots (a release named
       "team.a" made an invalid Service). */}}
{{- define "reservoir.metricsService" -}}
{{- printf "%s-metrics" (include "reservoir.fullname" . | replace "." "-") }}
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

{{/* The operator's identity as the API server sees it: the admission policies bind it. */}}
{{- define "reservoir.operatorUser" -}}
system:serviceaccount:{{ .Release.Namespace }}:{{ include "reservoir.serviceAccountName" . }}
{{- end }}

{{/* A CEL condition: the request is the operator's own. */}}
{{- define "reservoir.byOperator" -}}
request.userInfo.username == '{{ include "reservoir.operatorUser" . }}'
{{- end }}

{{/* A CEL condition: neither the operator nor an exempt group (admissionPolicy.exemptGroups). */}}
{{- define "reservoir.byOthers" -}}
request.userInfo.username != '{{ include "reservoir.operatorUser" . }}'
{{- with .Values.admissionPolicy.exemptGroups }} && !({{ toJson . }}.exists(g, has(request.userInfo.groups) && g in request.userInfo.groups)){{ end }}
{{- end }}

{{/* CEL: the namespaces the operator never writes workloads in (a list literal). */}}
{{- define "reservoir.protectedNamespaces" -}}
{{- toJson (uniq (append .Values.admissionPolicy.protectedNamespaces .Release.Namespace)) }}
{{- end }}

{{/* CEL list literals of the placement allow-lists. Pods also carry the tolerations the
     API server's DefaultTolerationSeconds plugin adds to every pod. */}}
{{- define "reservoir.tolerationKeys" -}}
{{- toJson .Values.placement.allowedTolerationKeys }}
{{- end }}
{{- define "reservoir.podTolerationKeys" -}}
{{- toJson (uniq (concat .Values.placement.allowedTolerationKeys (list "node.kubernetes.io/not-ready" "node.kubernetes.io/unreachable"))) }}
{{- end }}
{{- define "reservoir.nodeLabelKeys" -}}
{{- toJson .Values.placement.allowedNodeLabelKeys }}
{{- end }}

{{/* CEL over `p`, a placement (a claim's spec.placement or a pod's spec): every
     toleration key, nodeSelector key and nodeAffinity key is allowed, no pod affinity.
     Arguments: (list $ "<cel expr of p>" "<toleration keys list>"). */}}
{{- define "reservoir.placementAllowed" -}}
{{- $p := index . 1 }}{{ $tolerations := index . 2 }}{{ $nodeKeys := include "reservoir.nodeLabelKeys" (index . 0) -}}
(!has({{ $p }}.tolerations) || {{ $p }}.tolerations.all(t, has(t.key) && t.key in {{ $tolerations }}))
  && (!has({{ $p }}.nodeSelector) || {{ $p }}.nodeSelector.all(k, k in {{ $nodeKeys }}))
  && (!has({{ $p }}.affinity) || (!has({{ $p }}.affinity.podAffinity) && !has({{ $p }}.affinity.podAntiAffinity)
    && (!has({{ $p }}.affinity.nodeAffinity) || (
      (!has({{ $p }}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution)
        || {{ $p }}.affinity.nodeAffinity.requiredDuringSchedulingIgnoredDuringExecution.nodeSelectorTerms.all(term,
          !has(term.matchFields) && (!has(term.matchExpressions) || term.matchExpressions.all(e, e.key in {{ $nodeKeys }}))))
      && (!has({{ $p }}.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution)
        || {{ $p }}.affinity.nodeAffinity.preferredDuringSchedulingIgnoredDuringExecution.all(w,
          !has(w.preference.matchFields) && (!has(w.preference.matchExpressions) || w.preference.matchExpressions.all(e, e.key in {{ $nodeKeys }}))))))))
{{- end }}

{{/* CEL: `o` and `old` agree on the optional field `f` (both absent, or equal).
     Arguments: (list "<field path after object./oldObject.>"). */}}
{{- define "reservoir.same" -}}
(has(object.{{ . }}) == has(oldObject.{{ . }}) && (!has(object.{{ . }}) || object.{{ . }} == oldObject.{{ . }}))
{{- end }}

{{/* The DeviceClasses of Reservoir's ResourceClaims: the values of
     reservoir.core.model.DEVICE_CLASSES (tests/integration/test_helm_chart.py checks). */}}
{{- define "reservoir.deviceClasses" -}}
["gpu.reservoir.dev"]
{{- end }}
{{/* The placeholder pods' image: reservoir.k8s.devices.PAUSE_IMAGE (checked likewise). */}}
{{- define "reservoir.pauseImage" -}}
registry.k8s.io/pause:3.10
{{- end }}
{{/* A ResourceClaim name Reservoir makes: reservoir-<claim uid>. */}}
{{- define "reservoir.claimNamePattern" -}}
^reservoir-[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}$
{{- end }}
