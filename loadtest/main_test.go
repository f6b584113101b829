package loadtest

import (
	"testing"

	"go.uber.org/goleak"
)

func TestMain(m *testing.M) {
	goleak.VerifyTestMain(m,
		// grpc-go's xds:/// resolver, as NewXDSResolverWithConfigForTesting
		// builds it (TestXDSClientOverTLSThroughTier), owns an xDS client
		// pool that nothing can close, and the pool's TLS channel
		// credentials watch their files until it is: grpc-go's, not ours.
		goleak.IgnoreTopFunction("google.golang.org/grpc/credentials/tls/certprovider/pemfile.(*watcher).run"))
}
