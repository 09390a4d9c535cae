package main

import (
	"context"
	"errors"
	"io"
	"net"
	"strings"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials"
	"google.golang.org/grpc/credentials/insecure"
	testpb "google.golang.org/grpc/interop/grpc_testing"
	"google.golang.org/grpc/metadata"
	grpcstatus "google.golang.org/grpc/status"
)

// testService answers unary calls with their payload and streams each message back as it
// arrives, with header and trailer metadata on both.
type testService struct {
	testpb.UnimplementedTestServiceServer
}

func (testService) EmptyCall(context.Context, *testpb.Empty) (*testpb.Empty, error) {
	return &testpb.Empty{}, nil
}

func (testService) CacheableUnaryCall(context.Context, *testpb.SimpleRequest) (*testpb.SimpleResponse, error) {
	return &testpb.SimpleResponse{}, nil
}

func (testService) UnaryCall(ctx context.Context, req *testpb.SimpleRequest) (*testpb.SimpleResponse, error) {
	_ = grpc.SetHeader(ctx, metadata.Pairs("x-upstream-header", "unary"))
	_ = grpc.SetTrailer(ctx, metadata.Pairs("x-upstream-trailer", "unary"))
	return &testpb.SimpleResponse{Payload: req.GetPayload()}, nil
}

func (testService) FullDuplexCall(stream grpc.BidiStreamingServer[testpb.StreamingOutputCallRequest, testpb.StreamingOutputCallResponse]) error {
	stream.SetTrailer(metadata.Pairs("x-upstream-trailer", "stream"))
	for {
		req, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		if err := stream.Send(&testpb.StreamingOutputCallResponse{Payload: req.GetPayload()}); err != nil {
			return err
		}
	}
}

// serveGRPC runs the test service, in cleartext HTTP/2 or, with creds, over TLS.
func serveGRPC(t *testing.T, creds credentials.TransportCredentials) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var opts []grpc.ServerOption
	if creds != nil {
		opts = append(opts, grpc.Creds(creds))
	}
	srv := grpc.NewServer(opts...)
	testpb.RegisterTestServiceServer(srv, testService{})
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(srv.Stop)
	return ln.Addr().String()
}

func grpcClient(t *testing.T, addr string) testpb.TestServiceClient {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+addr, grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { _ = conn.Close() })
	return testpb.NewTestServiceClient(conn)
}

func payload(s string) *testpb.Payload { return &testpb.Payload{Body: []byte(s)} }

// gRPC clients of grpc-go call a grpc-go server behind the binary, over h2c and over TLS: unary
// and bidirectional streaming calls pass whole, with the server's header and trailer metadata;
// a call over its limit is RESOURCE_EXHAUSTED naming the rule, with the RateLimit fields and
// Retry-After; a fail-closed rule whose store is down is UNAVAILABLE.
func TestEnforcerBinaryWhenGRPCCallsPassThenTheyWorkAndRefusalsAreGRPCStatuses(t *testing.T) {
	pki := newTestPKI(t)
	upstreams := map[string][]string{
		"h2c": {"h2c://" + serveGRPC(t, nil)},
		"TLS": {"https://" + serveGRPC(t, credentials.NewServerTLSFromCert(&pki.server)), "--upstream-ca-file=" + pki.caFile},
	}
	for name, args := range upstreams {
		t.Run("when the upstream speaks "+name, func(t *testing.T) {
			e := startFronting(t, args[0], args[1:]...)
			c := grpcClient(t, e.proxy)
			ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
			defer cancel()

			var header, trailer metadata.MD
			resp, err := c.UnaryCall(ctx, &testpb.SimpleRequest{Payload: payload("ping")}, grpc.Header(&header), grpc.Trailer(&trailer))
			if err != nil || string(resp.GetPayload().GetBody()) != "ping" {
				t.Fatalf("unary: %v, %v", resp, err)
			}
			if first(header, "x-upstream-header") != "unary" || first(trailer, "x-upstream-trailer") != "unary" || first(header, "ratelimit") == "" {
				t.Errorf("unary: header %v trailer %v, want the upstream's metadata and the RateLimit fields", header, trailer)
			}

			stream, err := c.FullDuplexCall(ctx)
			if err != nil {
				t.Fatal(err)
			}
			for _, m := range []string{"one", "two", "three"} {
				// Each answer arrives before the next message is sent: both directions stream.
				if err := stream.Send(&testpb.StreamingOutputCallRequest{Payload: payload(m)}); err != nil {
					t.Fatal(err)
				}
				got, err := stream.Recv()
				if err != nil || string(got.GetPayload().GetBody()) != m {
					t.Fatalf("stream: %v, %v, want %q", got, err, m)
				}
			}
			_ = stream.CloseSend()
			if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
				t.Fatalf("stream end: %v", err)
			}
			if first(stream.Trailer(), "x-upstream-trailer") != "stream" {
				t.Errorf("stream trailer %v", stream.Trailer())
			}

			if _, err := c.EmptyCall(ctx, &testpb.Empty{}); err != nil {
				t.Fatalf("first call of one-call: %v", err)
			}
			header, trailer = nil, nil
			_, err = c.EmptyCall(ctx, &testpb.Empty{}, grpc.Header(&header), grpc.Trailer(&trailer))
			st := grpcstatus.Convert(err)
			if st.Code() != codes.ResourceExhausted || !strings.Contains(st.Message(), `"one-call"`) {
				t.Fatalf("second call: %v, want RESOURCE_EXHAUSTED naming the rule", err)
			}
			md := metadata.Join(header, trailer)
			if first(md, "retry-after") == "" || first(md, "ratelimit") == "" || first(md, "ratelimit-policy") == "" {
				t.Errorf("refused call's metadata %v, want Retry-After and the RateLimit fields", md)
			}
		})
	}

	t.Run("when a fail-closed rule's store is down then UNAVAILABLE", func(t *testing.T) {
		dead, _ := net.Listen("tcp", "127.0.0.1:0")
		addr := dead.Addr().String()
		_ = dead.Close()
		e := startFronting(t, "h2c://"+serveGRPC(t, nil), "--redis-url=redis://"+addr+"/0", "--redis-timeout=200ms")
		c := grpcClient(t, e.proxy)
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		_, err := c.CacheableUnaryCall(ctx, &testpb.SimpleRequest{})
		if st := grpcstatus.Convert(err); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), `"closed"`) {
			t.Errorf("fail-closed call: %v, want UNAVAILABLE naming the rule", err)
		}
		if _, err := c.EmptyCall(ctx, &testpb.Empty{}); err != nil {
			t.Errorf("a fail-open rule's call with the store down: %v, want it passed", err)
		}
	})
}

func first(md metadata.MD, key string) string {
	if v := md.Get(key); len(v) > 0 {
		return v[0]
	}
	return ""
}

// A gRPC call whose upstream refuses the connection is UNAVAILABLE, the gRPC mapping of the
// proxy's 502, counted as an upstream error.
func TestEnforcerBinaryWhenAGRPCUpstreamRefusesConnectionsThenTheCallIsUnavailable(t *testing.T) {
	dead, _ := net.Listen("tcp", "127.0.0.1:0")
	addr := dead.Addr().String()
	_ = dead.Close()
	e := startFronting(t, "h2c://"+addr)
	ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
	defer cancel()
	_, err := grpcClient(t, e.proxy).UnaryCall(ctx, &testpb.SimpleRequest{})
	if st := grpcstatus.Convert(err); st.Code() != codes.Unavailable || !strings.Contains(st.Message(), "Bad Gateway") {
		t.Errorf("%v, want UNAVAILABLE saying Bad Gateway", err)
	}
	if n := e.metric(t, `sluice_upstream_failures_total{reason="error"}`); n != 1 {
		t.Errorf("sluice_upstream_failures_total{reason=\"error\"} = %v, want 1", n)
	}
}
