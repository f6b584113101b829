package main

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/shard/adminpb"
)

// options are the flags every command shares, and where it writes.
type options struct {
	address string
	output  string
	timeout time.Duration

	out, errOut io.Writer
	now         func() time.Time // for ages; time.Now outside tests
	started     bool             // the command line was valid: the command ran
}

// errSilent ends a command whose output already said what went wrong.
var errSilent = errors.New("relayctl: failed")

// run runs relayctl with args and returns its exit code: 0, 1 when a
// command fails (a wait timed out, say), 2 for a usage error.
func run(args []string, out, errOut io.Writer) int {
	o := &options{out: out, errOut: errOut, now: time.Now}
	root := newRoot(o)
	root.SetArgs(args)
	root.SetOut(out)
	root.SetErr(errOut)
	cmd, err := root.ExecuteC()
	switch {
	case err == nil:
		return 0
	case errors.Is(err, errSilent):
		return 1
	case !o.started || errors.As(err, new(usageError)):
		// Arguments and flags are checked before the command starts.
		fmt.Fprintf(errOut, "Error: %v\nRun '%s --help' for usage.\n", err, cmd.CommandPath())
		return 2
	}
	if st, ok := status.FromError(err); ok {
		err = fmt.Errorf("%s: %s", st.Code(), st.Message())
	}
	fmt.Fprintf(errOut, "Error: %v\n", err)
	return 1
}

// usageError is a mistake in the command line.
type usageError struct{ error }

func newRoot(o *options) *cobra.Command {
	root := &cobra.Command{
		Use:   "relayctl",
		Short: "Inspect a meshrelay tier through any relay's admin API",
		Long: `relayctl asks one relay's admin API (meshrelay.admin.v1, on the relay's
--admin-listen port); any relay answers for the whole tier.`,
		SilenceUsage:  true,
		SilenceErrors: true,
		PersistentPreRunE: func(*cobra.Command, []string) error {
			switch o.output {
			case "table", "json", "yaml":
				o.started = true
				return nil
			}
			return usageError{fmt.Errorf("-o %q: want table, json or yaml", o.output)}
		},
	}
	root.SetFlagErrorFunc(func(_ *cobra.Command, err error) error { return usageError{err} })
	f := root.PersistentFlags()
	f.StringVar(&o.address, "admin-address", "localhost:15014", "a relay's admin address (host:port)")
	f.StringVarP(&o.output, "output", "o", "table", "output format: table, json or yaml")
	f.DurationVar(&o.timeout, "timeout", 10*time.Second, "how long a query may take (wait has its own --wait-timeout)")
	root.AddCommand(ringCmd(o), shardsCmd(o), shardCmd(o), proxyStatusCmd(o), convergenceCmd(o),
		stragglersCmd(o), deliveryCmd(o), waitCmd(o))
	return root
}

// client dials the admin address. The connection is made on first use.
func (o *options) client() (adminpb.AdminClient, func(), error) {
	conn, err := grpc.NewClient(o.address, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		return nil, nil, usageError{fmt.Errorf("--admin-address %q: %w", o.address, err)}
	}
	return adminpb.NewAdminClient(conn), func() { conn.Close() }, nil
}

// call runs fn with a client and a context bounded by --timeout.
func (o *options) call(ctx context.Context, fn func(context.Context, adminpb.AdminClient) error) error {
	c, done, err := o.client()
	if err != nil {
		return err
	}
	defer done()
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	return fn(ctx, c)
}
