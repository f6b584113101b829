package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"fmt"
	"io"
	"os"
	"time"

	"github.com/spf13/cobra"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"

	"github.com/meshrelay/meshrelay/relay/auth"
	"github.com/meshrelay/meshrelay/shard/adminpb"
)

// options are the flags every command shares, and where it writes.
type options struct {
	address string
	output  string
	timeout time.Duration
	// TLS and the bearer token (see dialOptions).
	tls                 bool
	caFile, certFile    string
	keyFile, serverName string
	tokenFile           string

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
--admin-listen port); any relay answers for the whole tier.

Access: --token-file names a file holding the bearer token sent on every
call, over TLS only: the relays' admin token, or a Kubernetes
service-account token (a projected token such as istioctl's, read again at
each call since kubelet rotates it). With a client certificate (--cert-file)
a SPIFFE identity proves itself instead. An identity the relays list in
--admin-identities is an admin; any other sees only its own namespace's
Envoys, keys and config, and may not drain.`,
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
	f.BoolVar(&o.tls, "tls", false, "speak TLS to the admin API (implied by --ca-file and --cert-file)")
	f.StringVar(&o.caFile, "ca-file", "", "PEM file of the CAs that sign the relays' admin certificates (default: the system's)")
	f.StringVar(&o.certFile, "cert-file", "", "PEM file of the client certificate, for relays that require mTLS")
	f.StringVar(&o.keyFile, "key-file", "", "PEM file of the client certificate's key")
	f.StringVar(&o.serverName, "server-name", "", "name the relays' certificates are checked against (default: the host dialled)")
	f.StringVar(&o.tokenFile, "token-file", "", "file holding the bearer token sent on every call: the admin token, or a service-account JWT (read again at each call: kubelet rotates it); needs TLS")
	root.AddCommand(ringCmd(o), shardsCmd(o), shardCmd(o), proxyStatusCmd(o), proxyConfigCmd(o), convergenceCmd(o),
		stragglersCmd(o), deliveryCmd(o), waitCmd(o), drainCmd(o))
	return root
}

// client dials the admin address. The connection is made on first use.
func (o *options) client() (adminpb.AdminClient, func(), error) {
	return o.clientAt(o.address)
}

// clientAt dials a relay's admin address.
func (o *options) clientAt(addr string) (adminpb.AdminClient, func(), error) {
	opts, err := o.dialOptions()
	if err != nil {
		return nil, nil, err
	}
	conn, err := grpc.NewClient(addr, opts...)
	if err != nil {
		return nil, nil, usageError{fmt.Errorf("admin address %q: %w", addr, err)}
	}
	return adminpb.NewAdminClient(conn), func() { conn.Close() }, nil
}

// dialOptions are the transport credentials (TLS, with a client
// certificate for mTLS, or cleartext) and the bearer token, from the
// flags.
func (o *options) dialOptions() ([]grpc.DialOption, error) {
	useTLS := o.tls || o.caFile != "" || o.certFile != ""
	if (o.certFile == "") != (o.keyFile == "") {
		return nil, usageError{errors.New("--cert-file and --key-file go together")}
	}
	if !useTLS {
		if o.tokenFile != "" {
			return nil, usageError{errors.New("--token-file needs --tls: a bearer token must not cross the network in clear text")}
		}
		return []grpc.DialOption{grpc.WithTransportCredentials(insecure.NewCredentials())}, nil
	}
	tc := &tls.Config{ServerName: o.serverName, MinVersion: tls.VersionTLS12}
	if o.caFile != "" {
		b, err := os.ReadFile(o.caFile)
		if err != nil {
			return nil, fmt.Errorf("--ca-file: %w", err)
		}
		tc.RootCAs = x509.NewCertPool()
		if !tc.RootCAs.AppendCertsFromPEM(b) {
			return nil, fmt.Errorf("--ca-file %s: no PEM certificate in it", o.caFile)
		}
	}
	if o.certFile != "" {
		pair, err := tls.LoadX509KeyPair(o.certFile, o.keyFile)
		if err != nil {
			return nil, fmt.Errorf("--cert-file, --key-file: %w", err)
		}
		tc.Certificates = []tls.Certificate{pair}
	}
	opts := []grpc.DialOption{grpc.WithTransportCredentials(credentials.NewTLS(tc))}
	if o.tokenFile != "" {
		// Read once now, so that a missing or empty file fails before any
		// call, then again at each call.
		tf := auth.TokenFile{Path: o.tokenFile, Flag: "--token-file"}
		if _, err := tf.Token(); err != nil {
			return nil, err
		}
		opts = append(opts, grpc.WithPerRPCCredentials(tf))
	}
	return opts, nil
}

// call runs fn with a client and a context bounded by --timeout.
func (o *options) call(ctx context.Context, fn func(context.Context, adminpb.AdminClient) error) error {
	return o.callAt(ctx, o.address, fn)
}

// callAt is call against the relay at addr.
func (o *options) callAt(ctx context.Context, addr string, fn func(context.Context, adminpb.AdminClient) error) error {
	c, done, err := o.clientAt(addr)
	if err != nil {
		return err
	}
	defer done()
	ctx, cancel := context.WithTimeout(ctx, o.timeout)
	defer cancel()
	return fn(ctx, c)
}
