{{/* The alerting rules: a PrometheusRule's spec, and a Prometheus rule file as it is. */}}
{{- define "meshrelay.rules" -}}
{{- $r := .Values.monitoring.prometheusRule -}}
groups:
- name: meshrelay
  rules:
  - alert: MeshrelayUpstreamStreamsAboveKeys
    # istiod should see one stream per key: more streams than owned keys
    # means relays feed keys from istiod because they cannot reach the
    # owner (fallback), or a stream leaked.
    expr: sum by (namespace, job) (meshrelay_upstream_streams) > sum by (namespace, job) (meshrelay_keys_by_source{source="upstream"})
    for: 10m
    labels: {severity: warning}
    annotations:
      summary: More streams to istiod than keys owned in {{`{{ $labels.job }}`}}
      description: The relays hold {{`{{ $value }}`}} streams to istiod, more than the keys they own (one each); check meshrelay_peer_fallbacks_total and the peer port between relays.
  - alert: MeshrelayStaleKeys
    # Keys served from a snapshot or cache that no live source has
    # confirmed: istiod or the key's owner is not answering.
    expr: max by (namespace, job, pod) (meshrelay_stale_keys) > 0
    for: 10m
    labels: {severity: warning}
    annotations:
      summary: '{{`{{ $labels.pod }}`}} serves {{`{{ $value }}`}} stale keys'
      description: Keys have been served unconfirmed for 10 minutes; check the relay's upstream (meshrelay_upstream_reconnects_total) and istiod.
  - alert: MeshrelaySnapshotBehind
    # Snapshots in etcd lag the keys: a restart would start from old config.
    expr: max by (namespace, job, pod) (meshrelay_snapshot_behind_seconds) > {{ $r.snapshotBehindSeconds }}
    for: 5m
    labels: {severity: warning}
    annotations:
      summary: '{{`{{ $labels.pod }}`}} has not persisted its keys for {{`{{ $value }}`}} s'
      description: Snapshot writes to etcd are failing or slow (meshrelay_snapshot_writes_total by result, meshrelay_snapshot_write_lag_seconds).
  - alert: MeshrelayKeyDiverged
    # A divergence check found a member of a key that istiod gives other
    # config: the key split, and the member has a key of its own. Nothing
    # is wrong for the Envoys, but the key profile is too coarse for this
    # mesh, and each split costs istiod a stream.
    expr: sum by (namespace, job, type) (increase(meshrelay_key_divergences_total[1h])) > 0
    labels: {severity: info}
    annotations:
      summary: A key's {{`{{ $labels.type }}`}} diverged in {{`{{ $labels.job }}`}}
      description: relayctl shards names the split keys; the relay's warning names the node fields that differed. Add them to the key profile (--key-metadata or --key-fields).
  - alert: MeshrelayMakeBeforeBreakStall
    # A listener or route configuration waits past --resource-wait-timeout
    # for a cluster of its key that an Envoy cannot use yet (its endpoints
    # have not reached it): the relay never sends a route to a warming
    # cluster, so such a wait is a stall in the tier or upstream, and the
    # Envoy is behind on its routes until it ends.
    expr: sum by (namespace, job, type) (increase(meshrelay_make_before_break_overdue_total{outcome="held"}[10m])) > 0
    labels: {severity: warning}
    annotations:
      summary: '{{`{{ $labels.type }}`}} held back past the wait for a cluster not warm at the Envoy in {{`{{ $labels.job }}`}}'
      description: The relay's warning names the held resource; relayctl proxy-status lists the Envoys behind (not sent). Look at the key's source (meshrelay_stale_keys, the upstream's EDS).
  - alert: MeshrelayEnvoyNACKs
    # Envoys refuse config: a bad resource from istiod, or a mix of Envoy
    # versions istiod does not expect.
    expr: sum by (namespace, job, type) (rate(meshrelay_xds_nacks_total[5m])) > {{ $r.nackRate }}
    for: 10m
    labels: {severity: warning}
    annotations:
      summary: Envoys NACK {{`{{ $labels.type }}`}} at {{`{{ $value }}`}}/s
      description: relayctl proxy-status lists the NACKing Envoys and their errors.
  - alert: MeshrelayUpstreamNACKs
    # The relay refused a response of istiod (and kept the last good).
    expr: sum by (namespace, job, type) (increase(meshrelay_upstream_nacks_total[10m])) > 0
    labels: {severity: warning}
    annotations:
      summary: Relays refused {{`{{ $labels.type }}`}} from istiod
      description: The relays keep serving the last good config; the relay's log names the key and the error.
  - alert: MeshrelayConvergenceSlow
    # From a relay's receipt of a version to an Envoy's ACK of it.
    expr: histogram_quantile(0.99, sum by (namespace, job, le) (rate(meshrelay_proxy_convergence_time_seconds_bucket[5m]))) > {{ $r.convergenceP99Seconds }}
    for: 10m
    labels: {severity: warning}
    annotations:
      summary: Push to ACK P99 is {{`{{ $value }}`}} s in {{`{{ $labels.job }}`}}
      description: Envoys take long to ACK; check relay CPU, admission refusals and slow Envoys.
  - alert: MeshrelayDown
    # Prometheus cannot scrape a relay: it is down, or its admin port is
    # unreachable (its Envoys have moved to the other relays).
    expr: up{job="{{ $r.relayJob | default (include "meshrelay.fullname" .) }}"} == 0
    for: 5m
    labels: {severity: warning}
    annotations:
      summary: '{{`{{ $labels.instance }}`}} of {{`{{ $labels.job }}`}} is down'
      description: The relay has not answered a scrape for 5 minutes; check its pod's events and log (kubectl describe, kubectl logs --previous).
  - alert: MeshrelayAuthFailures
    # Sidecars' tokens fail: TokenReview itself fails (review_failed: the
    # API server is unreachable, or the relay lost its RBAC), or tokens do
    # not verify (bad_token). Either way sidecars cannot connect.
    expr: sum by (namespace, job, reason) (rate(meshrelay_xds_auth_failures_total{reason=~"review_failed|bad_token"}[5m])) > {{ $r.authFailureRate }}
    for: 10m
    labels: {severity: warning}
    annotations:
      summary: Streams refused for {{`{{ $labels.reason }}`}} at {{`{{ $value }}`}}/s in {{`{{ $labels.job }}`}}
      description: review_failed - check the relays' egress to the API server and their tokenreviews RBAC; bad_token - tokens of another cluster or issuer, or a wrong jwtVerifier.
  - alert: MeshrelayRingSplit
    # A relay sees fewer members than the relays scraped: gossip is
    # partitioned, and keys may have two owners.
    expr: min by (namespace, job) (meshrelay_ring_members) < count by (namespace, job) (meshrelay_ring_members)
    for: 5m
    labels: {severity: warning}
    annotations:
      summary: The ring of {{`{{ $labels.job }}`}} is split
      description: Check the gossip port (7946 TCP and UDP) between relays and the gossip key.
{{- end -}}
