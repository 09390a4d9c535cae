package netproxy

import (
	"net/http"
	"strconv"

	"google.golang.org/grpc/codes"

	"github.com/sluice-dev/sluice/enforcer/internal/seam"
)

// The gRPC mapping of the proxy's answers. A gRPC client reads a call's outcome from the
// grpc-status and grpc-message fields, not from the HTTP status, so a refused call is answered
// HTTP 200 with a trailers-only response: grpc-status, grpc-message naming the rule, and the
// RateLimit fields and Retry-After as response headers, which grpc-go hands to the client as
// header metadata.
//
//	HTTP   gRPC
//	429    RESOURCE_EXHAUSTED (8)  a limit; the message names the rule
//	503    UNAVAILABLE (14)        a fail-closed rule's store is down
//	400    INVALID_ARGUMENT (3)    and 414: a call that cannot be decided
//	502    UNAVAILABLE (14)        the upstream cannot be reached
//	504    DEADLINE_EXCEEDED (4)   the upstream sent no response in time

// grpcCode is the gRPC status code of an HTTP status the proxy answers with.
func grpcCode(status int) codes.Code {
	switch status {
	case http.StatusOK:
		return codes.OK
	case http.StatusTooManyRequests:
		return codes.ResourceExhausted
	case http.StatusServiceUnavailable, http.StatusBadGateway:
		return codes.Unavailable
	case http.StatusGatewayTimeout:
		return codes.DeadlineExceeded
	case http.StatusBadRequest, http.StatusRequestURITooLong:
		return codes.InvalidArgument
	case http.StatusMethodNotAllowed:
		return codes.Unimplemented
	}
	return codes.Internal
}

// writeGRPCStatus sets the fields of a trailers-only gRPC response.
func writeGRPCStatus(h http.Header, code codes.Code, message string) {
	h.Set("Content-Type", "application/grpc")
	h.Set("Grpc-Status", strconv.Itoa(int(code)))
	h.Set("Grpc-Message", grpcPercentEncode(message))
	h.Del("Content-Length")
}

// grpcPercentEncode encodes a grpc-message as the gRPC over HTTP/2 protocol says: '%' and
// every byte outside printable ASCII as %XX.
func grpcPercentEncode(s string) string {
	const hex = "0123456789ABCDEF"
	var b []byte
	for i := 0; i < len(s); i++ {
		c := s[i]
		if c >= 0x20 && c <= 0x7e && c != '%' {
			if b != nil {
				b = append(b, c)
			}
			continue
		}
		if b == nil {
			b = append(make([]byte, 0, len(s)+8), s[:i]...)
		}
		b = append(b, '%', hex[c>>4], hex[c&15])
	}
	if b == nil {
		return s
	}
	return string(b)
}

// writeGRPC answers a call the seam did not allow, in gRPC.
func writeGRPC(h http.Header, v *seam.Verdict) {
	seam.SetRateLimitHeaders(h.Set, &v.Result)
	message := v.Detail
	if v.Status == http.StatusTooManyRequests || v.Status == http.StatusServiceUnavailable {
		p := seam.Describe(&v.Result)
		message = p.Detail
		if p.RetryAfter > 0 {
			h.Set("Retry-After", strconv.FormatInt(p.RetryAfter, 10))
		}
	}
	writeGRPCStatus(h, grpcCode(v.Status), message)
}
