package main

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"sigs.k8s.io/yaml"

	"github.com/meshrelay/meshrelay/ledger"
	"github.com/meshrelay/meshrelay/shard/adminpb"
)

// selectorFlags adds --key and --prefix, which narrow a command to keys.
func selectorFlags(cmd *cobra.Command) *adminpb.Selector {
	s := &adminpb.Selector{}
	cmd.Flags().StringVar(&s.Key, "key", "", "only this key")
	cmd.Flags().StringVar(&s.KeyPrefix, "prefix", "", "only keys starting with this (sidecar/<namespace>/ is a namespace)")
	cmd.PreRunE = func(*cobra.Command, []string) error {
		if s.Key != "" && s.KeyPrefix != "" {
			return usageError{fmt.Errorf("--key and --prefix: give one")}
		}
		return nil
	}
	return s
}

func ringCmd(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "ring",
		Short: "List the tier's members as the relay asked sees them (* marks it)",
		Args:  noArgs,
		RunE: func(cmd *cobra.Command, _ []string) error {
			return o.call(cmd.Context(), func(ctx context.Context, c adminpb.AdminClient) error {
				ring, err := c.GetRing(ctx, &adminpb.GetRingRequest{})
				if err != nil {
					return err
				}
				slices.SortFunc(ring.Members, func(a, b *adminpb.Member) int { return strings.Compare(a.GetName(), b.GetName()) })
				return o.print(ring, func(w io.Writer) {
					row(w, "MEMBER", "STATE", "XDS ADDRESS", "ADMIN ADDRESS", "ENVOYS")
					for _, m := range ring.GetMembers() {
						name := m.GetName()
						if m.GetSelf() {
							name += "*"
						}
						admin := m.GetAdminAddress()
						if admin == "" {
							admin = "-"
						}
						row(w, name, m.GetState(), m.GetXdsAddress(), admin, m.GetEnvoys())
					}
					fmt.Fprintf(w, "\ngossip health score of %s: %d (0 is healthy; it rises while that relay is slow)\n", ring.GetRelay(), ring.GetHealthScore())
				})
			})
		},
	}
}

func shardsCmd(o *options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "shards",
		Short: "List the tier's keys: owner, ledger version, Envoys, and the relays holding each",
		Args:  noArgs,
	}
	sel := selectorFlags(cmd)
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		return o.call(cmd.Context(), func(ctx context.Context, c adminpb.AdminClient) error {
			list, err := c.ListShards(ctx, &adminpb.ListShardsRequest{Selector: sel})
			if err != nil {
				return err
			}
			o.warnMissing(list.GetMissing())
			return o.print(list, func(w io.Writer) {
				row(w, "KEY", "OWNER", "VERSION", "ENVOYS", "CURRENT", "HOLDERS")
				for _, sh := range list.GetShards() {
					row(w, sh.GetKey(), sh.GetOwner(), short(sh.GetLedgerVersion()), sh.GetEnvoys(), sh.GetCurrent(), holders(sh))
				}
				fmt.Fprintln(w, aggregation(list.GetShards()))
				for _, line := range splitLines(list.GetShards()) {
					fmt.Fprintln(w, line)
				}
			})
		})
	}
	return cmd
}

// aggregation sums up how the shards aggregate the tier's Envoys.
func aggregation(shards []*adminpb.Shard) string {
	var a ledger.Aggregation
	for _, sh := range shards {
		a.Add(int(sh.GetEnvoys()))
	}
	return a.String()
}

// splitLines says which keys split, and how: a divergence check found
// members the upstream gives other config than the node the key presents.
func splitLines(shards []*adminpb.Shard) []string {
	var out []string
	for _, sh := range shards {
		if len(sh.GetSplits()) > 0 {
			out = append(out, fmt.Sprintf("key %s diverged (its profile is too coarse for this mesh); moved to keys of their own: %s", sh.GetKey(), strings.Join(sh.GetSplits(), "; ")))
		}
	}
	return out
}

// holders lists the relays holding a shard as relay:source, stale marked.
func holders(sh *adminpb.Shard) string {
	var out []string
	for _, h := range sh.GetHolders() {
		s := h.GetRelay() + ":" + h.GetSource()
		if h.GetStale() {
			s += "(stale)"
		}
		out = append(out, s)
	}
	return strings.Join(out, ",")
}

func shardCmd(o *options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "shard KEY",
		Short: "Show one key: owner, ledger version, and each holder's account (per type: resources, bytes, subscriptions)",
		Args:  exactArgs(1),
	}
	maxNames := cmd.Flags().Int32("max-names", 5, "subscribed names listed per type and holder")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		return o.call(cmd.Context(), func(ctx context.Context, c adminpb.AdminClient) error {
			sd, err := c.GetShard(ctx, &adminpb.GetShardRequest{Key: args[0], MaxNames: *maxNames})
			if err != nil {
				return err
			}
			o.warnMissing(sd.GetMissing())
			return o.print(sd, func(w io.Writer) { shardDetail(w, sd) })
		})
	}
	return cmd
}

func shardDetail(w io.Writer, sd *adminpb.ShardDetail) {
	sh := sd.GetShard()
	row(w, "Key:", sh.GetKey())
	row(w, "Owner:", fmt.Sprintf("%s (%s)", sh.GetOwner(), sh.GetOwnerXdsAddress()))
	row(w, "Version:", sh.GetLedgerVersion())
	row(w, "Envoys:", fmt.Sprintf("%d, %d on the current version", sh.GetEnvoys(), sh.GetCurrent()))
	peers := map[string]string{}
	for _, d := range sd.GetHolders() {
		peers[d.GetRelay()] = strings.Join(d.GetPeers(), ",")
	}
	row(w)
	row(w, "RELAY", "SOURCE", "STALE", "ENVOYS", "VERSION", "PEERS SUBSCRIBED")
	for _, h := range sh.GetHolders() {
		p := peers[h.GetRelay()]
		if p == "" {
			p = "-"
		}
		row(w, h.GetRelay(), h.GetSource(), yesNo(h.GetStale()), h.GetEnvoys(), short(h.GetLedgerVersion()), p)
	}
	for _, d := range sd.GetHolders() {
		row(w)
		row(w, d.GetRelay()+":")
		row(w, "TYPE", "RESOURCES", "BYTES", "VERSION", "SUBSCRIBED")
		for _, td := range d.GetTypes() {
			sub := "all"
			if !td.GetWildcard() {
				sub = fmt.Sprintf("%d: %s", td.GetNamesTotal(), strings.Join(td.GetNames(), " "))
				if more := td.GetNamesTotal() - int64(len(td.GetNames())); more > 0 {
					sub += fmt.Sprintf(" (and %d more)", more)
				}
			}
			if td.GetPending() > 0 {
				sub += fmt.Sprintf(", %d not arrived", td.GetPending())
			}
			row(w, typeName(td.GetType()), td.GetResources(), td.GetBytes(), short(td.GetVersion()), sub)
		}
	}
}

func proxyConfigCmd(o *options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "proxy-config (NODE | --key KEY)",
		Short: "What the tier sent an Envoy (or a key's views), as Envoy's config dump, Secrets redacted",
		Long: `proxy-config shows what the relay an Envoy is connected to sent it, or
with --key a key's views, as Envoy's own config dump: -o json prints it
whole (the JSON Envoy's /config_dump serves), the table lists each
resource and its version. Fields Envoy marks sensitive (private keys,
passwords) are "[redacted]", as in Envoy's /config_dump.`,
		Args: maxArgs(1),
	}
	key := cmd.Flags().String("key", "", "a key's views instead of a node's")
	types := cmd.Flags().StringSlice("type", nil, "only these types: cds, eds, lds, rds, sds, or type URLs")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		req := &adminpb.ConfigDumpRequest{Key: *key, Json: true}
		if len(args) == 1 {
			req.Node = args[0]
		}
		if (req.Node == "") == (req.Key == "") {
			return usageError{errors.New("give a node or --key")}
		}
		for _, t := range *types {
			req.Types = append(req.Types, typeURL(t))
		}
		return o.call(cmd.Context(), func(ctx context.Context, c adminpb.AdminClient) error {
			d, err := c.GetConfigDump(ctx, req)
			if err != nil {
				return err
			}
			switch o.output {
			case "json":
				_, err := fmt.Fprintln(o.out, d.GetJson())
				return err
			case "yaml":
				b, err := yaml.JSONToYAML([]byte(d.GetJson()))
				if err != nil {
					return fmt.Errorf("the config dump as YAML: %w", err)
				}
				_, err = o.out.Write(b)
				return err
			}
			rows, err := dumpRows(d.GetJson())
			if err != nil {
				return err
			}
			return o.print(d, func(w io.Writer) {
				if d.GetNode() != "" {
					fmt.Fprintf(w, "%s on %s (key %s)\n\n", d.GetNode(), d.GetRelay(), d.GetKey())
				} else {
					fmt.Fprintf(w, "key %s on %s\n\n", d.GetKey(), d.GetRelay())
				}
				row(w, "TYPE", "NAME", "VERSION")
				for _, r := range rows {
					row(w, r[0], r[1], short(r[2]))
				}
			})
		})
	}
	return cmd
}

// typeURL reads a type as a short name (cds) or a type URL.
func typeURL(t string) string {
	for _, tn := range typeNames {
		if strings.EqualFold(t, tn.name) {
			return tn.url
		}
	}
	if strings.EqualFold(t, "sds") {
		return "type.googleapis.com/envoy.extensions.transport_sockets.tls.v3.Secret"
	}
	return t
}

// dumpRows lists the resources of an Envoy config dump (JSON, proto field
// names) as type, name, version.
func dumpRows(js string) ([][3]string, error) {
	var dump struct {
		Configs []map[string]json.RawMessage `json:"configs"`
	}
	if err := json.Unmarshal([]byte(js), &dump); err != nil {
		return nil, fmt.Errorf("read the config dump: %w", err)
	}
	// Each section: the list's field, the resource's field within an item
	// (empty: the item itself), the version's field, and the name's.
	sections := map[string]struct{ typ, list, res, version, name string }{
		"ClustersConfigDump":     {"CDS", "dynamic_active_clusters", "cluster", "version_info", "name"},
		"EndpointsConfigDump":    {"EDS", "dynamic_endpoint_configs", "endpoint_config", "version_info", "cluster_name"},
		"ListenersConfigDump":    {"LDS", "dynamic_listeners", "", "", "name"},
		"ScopedRoutesConfigDump": {"SRDS", "dynamic_scoped_route_configs", "", "version_info", "name"},
		"RoutesConfigDump":       {"RDS", "dynamic_route_configs", "route_config", "version_info", "name"},
		"SecretsConfigDump":      {"SDS", "dynamic_active_secrets", "", "version_info", "name"},
		"EcdsConfigDump":         {"ECDS", "ecds_filters", "ecds_filter", "version_info", "name"},
	}
	var out [][3]string
	for _, c := range dump.Configs {
		var at string
		json.Unmarshal(c["@type"], &at)
		sec, ok := sections[at[strings.LastIndex(at, ".")+1:]]
		if !ok {
			continue
		}
		var items []map[string]json.RawMessage
		json.Unmarshal(c[sec.list], &items)
		for _, it := range items {
			var name, version string
			res := it
			if sec.res != "" {
				json.Unmarshal(it[sec.res], &res)
			}
			json.Unmarshal(res[sec.name], &name)
			if sec.typ == "LDS" {
				var st map[string]json.RawMessage
				json.Unmarshal(it["active_state"], &st)
				json.Unmarshal(st["version_info"], &version)
			} else {
				json.Unmarshal(it[sec.version], &version)
			}
			if name == "" {
				json.Unmarshal(it["name"], &name)
			}
			out = append(out, [3]string{sec.typ, name, version})
		}
	}
	// The types in the dump's order, each one's resources by name.
	for i := 0; i < len(out); {
		j := i + 1
		for j < len(out) && out[j][0] == out[i][0] {
			j++
		}
		slices.SortFunc(out[i:j], func(a, b [3]string) int { return strings.Compare(a[1], b[1]) })
		i = j
	}
	return out, nil
}

func proxyStatusCmd(o *options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "proxy-status [NODE]",
		Short: "Each Envoy's sync status per type (SYNCED, NOT SENT, STALE, NACKED), or one Envoy in detail",
		Long: `proxy-status lists the tier's Envoys as istioctl proxy-status does, per type:
SYNCED (it ACKed its key's current view), NOT SENT (the current view has not
been sent to it), STALE (sent, not answered yet), NACKED (it rejected the
latest response), DISCONNECTED (it left; kept a while). Given a node id, it
shows that Envoy in detail.`,
		Args: maxArgs(1),
	}
	sel := selectorFlags(cmd)
	req := &adminpb.ListEnvoysRequest{Selector: sel}
	cmd.Flags().StringVar(&req.Relay, "relay", "", "only the Envoys of this relay")
	cmd.Flags().BoolVar(&req.Lagging, "lagging", false, "only the Envoys behind their key's current version")
	cmd.Flags().BoolVar(&req.Nacking, "nacking", false, "only the Envoys holding a NACK")
	cmd.Flags().Int32Var(&req.Limit, "limit", 0, "at most this many Envoys (0: all)")
	cmd.RunE = func(cmd *cobra.Command, args []string) error {
		return o.call(cmd.Context(), func(ctx context.Context, c adminpb.AdminClient) error {
			if len(args) == 1 {
				info, err := c.LocateEnvoy(ctx, &adminpb.LocateEnvoyRequest{Node: args[0]})
				if err != nil {
					return err
				}
				return o.print(info, func(w io.Writer) { o.envoyDetail(w, info) })
			}
			if o.output == "table" {
				req.View = adminpb.EnvoyView_ENVOY_VIEW_BASIC // what the table shows
			}
			list, err := c.ListEnvoys(ctx, req)
			if err != nil {
				return err
			}
			o.warnMissing(list.GetMissing())
			slices.SortFunc(list.Envoys, func(a, b *adminpb.EnvoyInfo) int { return strings.Compare(a.GetNode(), b.GetNode()) })
			return o.print(list, func(w io.Writer) {
				head := []any{"NAME", "KEY", "RELAY"}
				for _, t := range typeNames {
					head = append(head, t.name)
				}
				row(w, head...)
				for _, e := range list.GetEnvoys() {
					byType := map[string]string{}
					for _, t := range e.GetTypes() { // the full view (-o json, yaml)
						byType[t.GetType()] = t.GetStatus()
					}
					for i, st := range e.GetStatuses() { // the basic view (table)
						if st != adminpb.SyncStatus_SYNC_STATUS_UNSPECIFIED && i < len(list.GetStatusTypes()) {
							byType[list.GetStatusTypes()[i]] = strings.ReplaceAll(st.String(), "_", " ")
						}
					}
					cols := []any{e.GetNode(), e.GetKey(), e.GetRelay()}
					for _, t := range typeNames {
						st, ok := byType[t.url]
						if !ok {
							st = "-" // not subscribed
						}
						cols = append(cols, st)
					}
					row(w, cols...)
				}
			})
		})
	}
	return cmd
}

func (o *options) envoyDetail(w io.Writer, e *adminpb.EnvoyInfo) {
	row(w, "Node:", e.GetNode())
	row(w, "Key:", e.GetKey())
	if e.GetConnected() {
		row(w, "Relay:", fmt.Sprintf("%s, connected %s ago", e.GetRelay(), o.age(e.GetConnectedAt().AsTime())))
	} else {
		row(w, "Relay:", fmt.Sprintf("%s, disconnected %s ago", e.GetRelay(), o.age(e.GetDisconnectedAt().AsTime())))
	}
	row(w, "Owner:", e.GetOwner())
	current := "yes"
	if !e.GetCurrent() {
		current = "no: " + e.GetReason()
	}
	row(w, "Current:", current)
	row(w)
	row(w, "TYPE", "STATUS", "ACKED", "SENT", "CURRENT VIEW", "NACK")
	for _, t := range e.GetTypes() {
		nack := "-"
		if n := t.GetNack(); n != nil {
			nack = fmt.Sprintf("%s ago: %s", o.age(n.GetAt().AsTime()), n.GetDetail())
		}
		row(w, typeName(t.GetType()), t.GetStatus(), short(t.GetAcked()), short(t.GetSent()), short(t.GetCurrentView()), nack)
	}
}

func convergenceCmd(o *options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "convergence",
		Short: "The share of Envoys on their key's current version: tier-wide, per relay (and per key)",
		Args:  noArgs,
	}
	sel := selectorFlags(cmd)
	keys := cmd.Flags().Bool("keys", false, "list every key too")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		return o.call(cmd.Context(), func(ctx context.Context, c adminpb.AdminClient) error {
			conv, err := c.GetConvergence(ctx, &adminpb.ConvergenceRequest{Selector: sel})
			if err != nil {
				return err
			}
			o.warnMissing(conv.GetMissing())
			return o.print(conv, func(w io.Writer) {
				row(w, "SCOPE", "NAME", "ENVOYS", "CURRENT", "SHARE")
				counts := func(scope, name string, c *adminpb.Counts) {
					row(w, scope, name, c.GetEnvoys(), c.GetCurrent(), percent(c.GetShare()))
				}
				counts("tier", "-", conv.GetTier())
				for _, r := range slices.Sorted(maps.Keys(conv.GetByRelay())) {
					counts("relay", r, conv.GetByRelay()[r])
				}
				if *keys {
					for _, k := range slices.Sorted(maps.Keys(conv.GetByKey())) {
						counts("key", k, conv.GetByKey()[k])
					}
				}
			})
		})
	}
	return cmd
}

func stragglersCmd(o *options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "stragglers",
		Short: "The Envoys behind their key's current version, each with the reason",
		Args:  noArgs,
	}
	sel := selectorFlags(cmd)
	limit := cmd.Flags().Int32("limit", 0, "at most this many (0: all)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		return o.call(cmd.Context(), func(ctx context.Context, c adminpb.AdminClient) error {
			list, err := c.ListStragglers(ctx, &adminpb.StragglersRequest{Selector: sel, Limit: *limit})
			if err != nil {
				return err
			}
			o.warnMissing(list.GetMissing())
			return o.print(list, func(w io.Writer) { o.stragglerTable(w, list.GetStragglers()) })
		})
	}
	return cmd
}

func (o *options) stragglerTable(w io.Writer, ss []*adminpb.Straggler) {
	ss = slices.Clone(ss)
	slices.SortFunc(ss, func(a, b *adminpb.Straggler) int { return strings.Compare(a.GetNode(), b.GetNode()) })
	row(w, "NODE", "KEY", "RELAY", "TYPE", "REASON", "SINCE", "NACK")
	for _, s := range ss {
		nack := "-"
		if n := s.GetNack(); n != nil {
			nack = n.GetFingerprint()
		}
		row(w, s.GetNode(), s.GetKey(), s.GetRelay(), typeName(s.GetType()), s.GetReason(), o.age(s.GetSince().AsTime()), nack)
	}
}

func deliveryCmd(o *options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "delivery --type TYPE --name NAME --hash HASH",
		Short: "Has a resource's content (or a later change) reached every Envoy whose view references it",
		Args:  noArgs,
	}
	sel := selectorFlags(cmd)
	req := &adminpb.DeliveryRequest{Selector: sel}
	cmd.Flags().StringVar(&req.Type, "type", "", "the resource's type: a type URL, or cds, eds, lds, rds")
	cmd.Flags().StringVar(&req.Name, "name", "", "the resource's name")
	cmd.Flags().StringVar(&req.Hash, "hash", "", "its content hash (hex, as in a Delta resource's version)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		if req.Type == "" || req.Name == "" || req.Hash == "" {
			return usageError{errors.New("--type, --name and --hash are required")}
		}
		req.Type = typeURL(req.Type)
		return o.call(cmd.Context(), func(ctx context.Context, c adminpb.AdminClient) error {
			d, err := c.CheckDelivery(ctx, req)
			if err != nil {
				return err
			}
			o.warnMissing(d.GetMissingRelays())
			return o.print(d, func(w io.Writer) {
				verdict := "delivered"
				switch {
				case !d.GetKnown():
					verdict = "not delivered: a key's history does not know this content"
				case !d.GetDone():
					verdict = "not delivered yet"
				}
				fmt.Fprintf(w, "%s %s at %s: %d of %d Envoys, %s\n", typeName(req.Type), req.Name, short(req.Hash),
					d.GetDelivered(), d.GetEnvoys(), verdict)
				if len(d.GetMissing()) > 0 {
					fmt.Fprintln(w)
					o.stragglerTable(w, d.GetMissing())
				}
			})
		})
	}
	return cmd
}

func waitCmd(o *options) *cobra.Command {
	cmd := &cobra.Command{
		Use:   "wait",
		Short: "Wait until a share of the Envoys is on their key's current version",
		Long: `wait follows the tier's convergence until --share of the selected Envoys
are on their key's current version (exit 0), or --wait-timeout passes
(exit 1, listing the stragglers).`,
		Args: noArgs,
	}
	sel := selectorFlags(cmd)
	share := cmd.Flags().Float64("share", 1, "the share of Envoys to wait for, in (0, 1]")
	timeout := cmd.Flags().Duration("wait-timeout", 30*time.Second, "how long to wait (at most 10m)")
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		if !(*share > 0 && *share <= 1) {
			return usageError{fmt.Errorf("--share %v: want a share in (0, 1]", *share)}
		}
		c, done, err := o.client()
		if err != nil {
			return err
		}
		defer done()
		// The server ends the wait; the client's bound only covers a
		// server that stopped answering.
		ctx, cancel := context.WithTimeout(cmd.Context(), *timeout+o.timeout)
		defer cancel()
		start := o.now()
		stream, err := c.Wait(ctx, &adminpb.WaitRequest{Selector: sel, Share: *share, Timeout: durationpb.New(*timeout)})
		if err != nil {
			return err
		}
		var last *adminpb.Convergence
		for {
			msg, err := stream.Recv()
			switch {
			case err == nil:
				if o.output == "table" {
					o.progress(msg, last)
				}
				last = msg
				continue
			case status.Code(err) == codes.DeadlineExceeded && last != nil:
				if o.output != "table" {
					o.print(last, nil)
					return errSilent
				}
				t := last.GetTier()
				fmt.Fprintf(o.out, "timed out after %s: %d of %d Envoys current (%s), want %s\n",
					*timeout, t.GetCurrent(), t.GetEnvoys(), percent(t.GetShare()), percent(*share))
				if len(last.GetStragglers()) > 0 {
					fmt.Fprintln(o.out)
					o.print(last, func(w io.Writer) { o.stragglerTable(w, last.GetStragglers()) })
				}
				return errSilent
			case errors.Is(err, io.EOF) && last.GetReached():
				if o.output != "table" {
					return o.print(last, nil)
				}
				t := last.GetTier()
				fmt.Fprintf(o.out, "reached: %d of %d Envoys current (%s) after %s\n",
					t.GetCurrent(), t.GetEnvoys(), percent(t.GetShare()), o.now().Sub(start).Round(time.Millisecond))
				return nil
			case errors.Is(err, io.EOF):
				return errors.New("the relay ended the wait without an answer")
			}
			return err
		}
	}
	return cmd
}

func drainCmd(o *options) *cobra.Command {
	return &cobra.Command{
		Use:   "drain RELAY",
		Short: "Take a relay out of the tier: not ready, out of the ring, its Envoys moved to the others",
		Long: `drain finds RELAY (its ID or member name) in the ring of the relay at
--admin-address and asks it, at its own admin address, to drain: it turns
not ready, leaves the ring and closes its streams over its drain period;
Envoys reconnect through the Service to the other relays. It keeps running,
serving no Envoys, until it is stopped. The relay must allow it
(meshrelay serve --admin-allow-mutations).`,
		Args: exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			var target *adminpb.Member
			err := o.call(cmd.Context(), func(ctx context.Context, c adminpb.AdminClient) error {
				ring, err := c.GetRing(ctx, &adminpb.GetRingRequest{})
				if err == nil {
					target, err = findMember(ring, args[0])
				}
				return err
			})
			if err != nil {
				return err
			}
			if target.GetAdminAddress() == "" {
				return fmt.Errorf("relay %s advertises no admin address", target.GetName())
			}
			return o.callAt(cmd.Context(), target.GetAdminAddress(), func(ctx context.Context, c adminpb.AdminClient) error {
				got, err := c.Drain(ctx, &adminpb.DrainRequest{Relay: target.GetName()})
				if err != nil {
					return err
				}
				return o.print(got, func(w io.Writer) {
					if got.GetAlready() {
						fmt.Fprintf(w, "%s is draining already\n", got.GetRelay())
						return
					}
					fmt.Fprintf(w, "%s draining: closing %d streams over %s\n", got.GetRelay(), got.GetStreams(), got.GetPeriod().AsDuration())
				})
			})
		},
	}
}

// findMember finds the member a relay is named by: its member name, or an
// ID that only one member has (two incarnations of one ID, a restart not
// yet forgotten, must be told apart by their member names).
func findMember(ring *adminpb.Ring, name string) (*adminpb.Member, error) {
	var byID []*adminpb.Member
	for _, m := range ring.GetMembers() {
		switch {
		case m.GetName() == name:
			return m, nil
		case memberID(m.GetName()) == name:
			byID = append(byID, m)
		}
	}
	switch len(byID) {
	case 0:
		return nil, fmt.Errorf("no relay %q in the ring", name)
	case 1:
		return byID[0], nil
	}
	var names []string
	for _, m := range byID {
		names = append(names, m.GetName())
	}
	return nil, usageError{fmt.Errorf("relay %q is in the ring %d times (%s): name the member", name, len(byID), strings.Join(names, ", "))}
}

// memberID is a member name's relay ID: the name without its incarnation
// suffix (the last "-" and what follows).
func memberID(name string) string {
	if i := strings.LastIndexByte(name, '-'); i > 0 {
		return name[:i]
	}
	return name
}

// progress prints a wait's convergence when it changed.
func (o *options) progress(msg, last *adminpb.Convergence) {
	t := msg.GetTier()
	if last != nil && last.GetTier().GetCurrent() == t.GetCurrent() && last.GetTier().GetEnvoys() == t.GetEnvoys() {
		return
	}
	o.warnMissing(msg.GetMissing())
	fmt.Fprintf(o.out, "%d of %d Envoys current (%s)\n", t.GetCurrent(), t.GetEnvoys(), percent(t.GetShare()))
}

func noArgs(_ *cobra.Command, args []string) error {
	if len(args) > 0 {
		return usageError{fmt.Errorf("unexpected argument %q", args[0])}
	}
	return nil
}

func exactArgs(n int) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) != n {
			return usageError{fmt.Errorf("want %d argument(s), got %d", n, len(args))}
		}
		return nil
	}
}

func maxArgs(n int) cobra.PositionalArgs {
	return func(_ *cobra.Command, args []string) error {
		if len(args) > n {
			return usageError{fmt.Errorf("want at most %d argument(s), got %d", n, len(args))}
		}
		return nil
	}
}
