package relay

import (
	"context"
	"crypto/subtle"
	"net/http"
	"strings"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/reflection"
	"google.golang.org/grpc/status"
)

// The admin listener serves HTTP/1 (health, readiness, /metrics, pprof) and,
// over HTTP/2 on the same port, gRPC: grpc.health.v1 (the relay's
// readiness), server reflection, and whatever Config.AdminServices
// registers (the admin API of the tier). With Config.AdminTLS it serves
// TLS (mTLS if the config asks for client certificates); with
// Config.AdminToken every gRPC call but health checks, and pprof, must
// carry the bearer token.

// newAdminGRPC builds the admin listener's gRPC server.
func (r *Relay) newAdminGRPC() *grpc.Server {
	s := grpc.NewServer(grpc.MaxSendMsgSize(r.cfg.MaxMsgSize),
		grpc.UnaryInterceptor(func(ctx context.Context, req any, info *grpc.UnaryServerInfo, handler grpc.UnaryHandler) (any, error) {
			if err := r.adminAuth(ctx, info.FullMethod); err != nil {
				return nil, err
			}
			return handler(ctx, req)
		}),
		grpc.StreamInterceptor(func(srv any, ss grpc.ServerStream, info *grpc.StreamServerInfo, handler grpc.StreamHandler) error {
			if err := r.adminAuth(ss.Context(), info.FullMethod); err != nil {
				return err
			}
			return handler(srv, ss)
		}))
	healthpb.RegisterHealthServer(s, adminHealth{r})
	reflection.Register(s)
	if r.cfg.AdminServices != nil {
		r.cfg.AdminServices(s)
	}
	return s
}

// adminAuth checks an admin gRPC call's bearer token, if the relay has
// one. Health checks need none: kubelet's gRPC probes carry none, and
// readiness tells nothing secret.
func (r *Relay) adminAuth(ctx context.Context, method string) error {
	if r.cfg.AdminToken == "" || strings.HasPrefix(method, "/grpc.health.v1.Health/") {
		return nil
	}
	md, _ := metadata.FromIncomingContext(ctx)
	for _, v := range md.Get("authorization") {
		if r.tokenMatches(v) {
			return nil
		}
	}
	return status.Error(codes.Unauthenticated, "the admin API wants a bearer token (authorization: Bearer <token>)")
}

// tokenMatches reports whether an authorization header carries the admin
// token, in time that does not depend on where they differ.
func (r *Relay) tokenMatches(header string) bool {
	token, ok := strings.CutPrefix(header, "Bearer ")
	return ok && subtle.ConstantTimeCompare([]byte(token), []byte(r.cfg.AdminToken)) == 1
}

// adminAuthHTTP lets through only requests with the admin token, if the
// relay has one.
func (r *Relay) adminAuthHTTP(h http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if r.cfg.AdminToken != "" && !r.tokenMatches(req.Header.Get("Authorization")) {
			w.Header().Set("WWW-Authenticate", "Bearer")
			http.Error(w, "this endpoint wants the admin bearer token", http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, req)
	})
}

// adminHandler sends gRPC requests to g and everything else to mux.
func adminHandler(g *grpc.Server, mux http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, req *http.Request) {
		if req.ProtoMajor == 2 && strings.HasPrefix(req.Header.Get("Content-Type"), "application/grpc") {
			g.ServeHTTP(w, req)
			return
		}
		mux.ServeHTTP(w, req)
	})
}

// adminProtocols are HTTP/1 and HTTP/2, over TLS (Config.AdminTLS) or
// cleartext (h2c: gRPC without TLS).
func adminProtocols() *http.Protocols {
	p := new(http.Protocols)
	p.SetHTTP1(true)
	p.SetHTTP2(true)
	p.SetUnencryptedHTTP2(true)
	return p
}

// adminHealth answers grpc.health.v1 with the relay's readiness: SERVING
// once it has config to serve and until it drains.
type adminHealth struct{ r *Relay }

func (h adminHealth) status() healthpb.HealthCheckResponse_ServingStatus {
	if h.r.Ready() {
		return healthpb.HealthCheckResponse_SERVING
	}
	return healthpb.HealthCheckResponse_NOT_SERVING
}

func (h adminHealth) Check(_ context.Context, req *healthpb.HealthCheckRequest) (*healthpb.HealthCheckResponse, error) {
	if req.GetService() != "" {
		return nil, status.Errorf(codes.NotFound, "unknown service %q: ask for \"\" (the relay)", req.GetService())
	}
	return &healthpb.HealthCheckResponse{Status: h.status()}, nil
}

func (h adminHealth) List(context.Context, *healthpb.HealthListRequest) (*healthpb.HealthListResponse, error) {
	return &healthpb.HealthListResponse{Statuses: map[string]*healthpb.HealthCheckResponse{"": {Status: h.status()}}}, nil
}

// Watch sends the status, then every change of it (checked each second),
// until the caller leaves or the relay stops.
func (h adminHealth) Watch(req *healthpb.HealthCheckRequest, stream healthpb.Health_WatchServer) error {
	if req.GetService() != "" {
		return status.Errorf(codes.NotFound, "unknown service %q: ask for \"\" (the relay)", req.GetService())
	}
	t := time.NewTicker(time.Second)
	defer t.Stop()
	last := healthpb.HealthCheckResponse_UNKNOWN
	for {
		if st := h.status(); st != last {
			if err := stream.Send(&healthpb.HealthCheckResponse{Status: st}); err != nil {
				return err
			}
			last = st
		}
		select {
		case <-stream.Context().Done():
			return stream.Context().Err()
		case <-h.r.stopping:
			return status.Error(codes.Unavailable, "relay stopping")
		case <-t.C:
		}
	}
}
