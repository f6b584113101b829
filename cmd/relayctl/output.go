package main

import (
	"fmt"
	"io"
	"maps"
	"slices"
	"strings"
	"text/tabwriter"
	"time"

	"google.golang.org/protobuf/encoding/protojson"
	"google.golang.org/protobuf/proto"
	"sigs.k8s.io/yaml"
)

// print writes msg as -o asks: the API's answer as JSON or YAML, or the
// table that table writes.
func (o *options) print(msg proto.Message, table func(w io.Writer)) error {
	switch o.output {
	case "json", "yaml":
		b, err := protojson.MarshalOptions{Multiline: true, Indent: "  "}.Marshal(msg)
		if err != nil {
			return fmt.Errorf("encode the answer: %w", err)
		}
		if o.output == "yaml" {
			if b, err = yaml.JSONToYAML(b); err != nil {
				return fmt.Errorf("encode the answer: %w", err)
			}
		} else {
			b = append(b, '\n')
		}
		_, err = o.out.Write(b)
		return err
	}
	w := tabwriter.NewWriter(o.out, 0, 4, 2, ' ', 0)
	table(w)
	return w.Flush()
}

// row writes one tab-separated row.
func row(w io.Writer, cols ...any) {
	for i, c := range cols {
		if i > 0 {
			fmt.Fprint(w, "\t")
		}
		fmt.Fprint(w, c)
	}
	fmt.Fprintln(w)
}

// warnMissing tells, on stderr, which relays did not answer in time: the
// answer lacks what they know.
func (o *options) warnMissing(missing map[string]string) {
	for _, r := range slices.Sorted(maps.Keys(missing)) {
		fmt.Fprintf(o.errOut, "warning: relay %s did not answer: %s\n", r, missing[r])
	}
}

// short abbreviates a ledger version (a hex Merkle root) as git does.
func short(v string) string {
	if v == "" {
		return "-"
	}
	return v[:min(len(v), 12)]
}

// typeNames are the xDS type URLs' short names, in istioctl's column order.
var typeNames = []struct{ url, name string }{
	{"type.googleapis.com/envoy.config.cluster.v3.Cluster", "CDS"},
	{"type.googleapis.com/envoy.config.listener.v3.Listener", "LDS"},
	{"type.googleapis.com/envoy.config.endpoint.v3.ClusterLoadAssignment", "EDS"},
	{"type.googleapis.com/envoy.config.route.v3.RouteConfiguration", "RDS"},
}

// typeName is a type URL's short name: CDS for a Cluster, the message name
// for types without one.
func typeName(url string) string {
	for _, t := range typeNames {
		if t.url == url {
			return t.name
		}
	}
	return url[strings.LastIndex(url, ".")+1:]
}

func percent(share float64) string { return fmt.Sprintf("%.1f%%", 100*share) }

// age says how long ago t was, to a unit that reads well.
func (o *options) age(t time.Time) string {
	if t.IsZero() {
		return "-"
	}
	d := o.now().Sub(t)
	switch {
	case d < time.Second:
		return d.Round(time.Millisecond).String()
	case d < time.Minute:
		return d.Round(time.Second).String()
	case d < time.Hour:
		return d.Round(time.Minute).String()
	}
	return d.Round(time.Hour).String()
}

func yesNo(b bool) string {
	if b {
		return "yes"
	}
	return "no"
}
