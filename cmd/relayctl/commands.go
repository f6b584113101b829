package main

import (
	"context"
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
					row(w, "MEMBER", "XDS ADDRESS", "ADMIN ADDRESS", "ENVOYS")
					for _, m := range ring.GetMembers() {
						name := m.GetName()
						if m.GetSelf() {
							name += "*"
						}
						admin := m.GetAdminAddress()
						if admin == "" {
							admin = "-"
						}
						row(w, name, m.GetXdsAddress(), admin, m.GetEnvoys())
					}
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
			})
		})
	}
	return cmd
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
	return &cobra.Command{
		Use:   "shard KEY",
		Short: "Show one key: its owner, ledger version, and each relay that holds it",
		Args:  exactArgs(1),
		RunE: func(cmd *cobra.Command, args []string) error {
			return o.call(cmd.Context(), func(ctx context.Context, c adminpb.AdminClient) error {
				list, err := c.ListShards(ctx, &adminpb.ListShardsRequest{Selector: &adminpb.Selector{Key: args[0]}})
				if err != nil {
					return err
				}
				o.warnMissing(list.GetMissing())
				if len(list.GetShards()) == 0 {
					return fmt.Errorf("no relay holds key %q", args[0])
				}
				sh := list.GetShards()[0]
				return o.print(sh, func(w io.Writer) {
					row(w, "Key:", sh.GetKey())
					row(w, "Owner:", fmt.Sprintf("%s (%s)", sh.GetOwner(), sh.GetOwnerXdsAddress()))
					row(w, "Version:", sh.GetLedgerVersion())
					row(w, "Envoys:", fmt.Sprintf("%d, %d on the current version", sh.GetEnvoys(), sh.GetCurrent()))
					row(w)
					row(w, "RELAY", "SOURCE", "STALE", "ENVOYS", "VERSION")
					for _, h := range sh.GetHolders() {
						row(w, h.GetRelay(), h.GetSource(), yesNo(h.GetStale()), h.GetEnvoys(), short(h.GetLedgerVersion()))
					}
				})
			})
		},
	}
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
					for _, t := range e.GetTypes() {
						byType[t.GetType()] = t.GetStatus()
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
	for _, f := range []string{"type", "name", "hash"} {
		cmd.MarkFlagRequired(f)
	}
	cmd.RunE = func(cmd *cobra.Command, _ []string) error {
		for _, t := range typeNames {
			if strings.EqualFold(req.Type, t.name) {
				req.Type = t.url
			}
		}
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
				if err != nil {
					return err
				}
				for _, m := range ring.GetMembers() {
					if m.GetName() == args[0] || strings.HasPrefix(m.GetName(), args[0]+"-") && strings.Count(m.GetName()[len(args[0]):], "-") == 1 {
						target = m
					}
				}
				return nil
			})
			switch {
			case err != nil:
				return err
			case target == nil:
				return fmt.Errorf("no relay %q in the ring", args[0])
			case target.GetAdminAddress() == "":
				return fmt.Errorf("relay %s advertises no admin address", target.GetName())
			}
			c, done, err := o.clientAt(target.GetAdminAddress())
			if err != nil {
				return err
			}
			defer done()
			ctx, cancel := context.WithTimeout(cmd.Context(), o.timeout)
			defer cancel()
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
		},
	}
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
