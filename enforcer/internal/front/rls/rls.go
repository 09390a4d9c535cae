// Package rls is Envoy's rate limit service, envoy.service.ratelimit.v3.RateLimitService.
package rls

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"net/http"
	"net/netip"
	"slices"
	"strings"
	"time"

	corev3 "github.com/envoyproxy/go-control-plane/envoy/config/core/v3"
	rlv3 "github.com/envoyproxy/go-control-plane/envoy/extensions/common/ratelimit/v3"
	rlsv3 "github.com/envoyproxy/go-control-plane/envoy/service/ratelimit/v3"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/types/known/durationpb"
	"google.golang.org/protobuf/types/known/wrapperspb"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/seam"
)

// Descriptor entry keys with a meaning of their own (docs/enforcer.md, "Envoy's rate limit
// service"); every other entry is a request header of the entry's key.
const (
	// EntryRemoteAddress is Envoy's remote_address action: the client address.
	EntryRemoteAddress = "remote_address"
	// EntryMethod and EntryPath are the request's method and path, as request_headers actions
	// on :method and :path with these descriptor keys give them.
	EntryMethod = "method"
	EntryPath   = "path"
	// EntryPolicy names the policy ("<namespace>/<name>") a descriptor asks about, for gateways
	// whose rate limit service has one domain for every route (Contour): Envoy's generic_key
	// action with this descriptor key. It is not a request header.
	EntryPolicy = "sluice-policy"
)

// Server is Envoy's rate limit service, envoy.service.ratelimit.v3.RateLimitService. A call's
// domain names the policy ("<namespace>/<name>"), or, when the domain is no policy served here
// (a gateway with one domain for every route), each descriptor names its own with an
// EntryPolicy entry; each descriptor describes a request, its entries mapped onto what the
// policy's rules match and key on; every rule that matches any of the descriptors is decided,
// and all are charged or none. A call for a policy not served here is answered OVER_LIMIT, with
// a body naming the policy, never decided against no rules: not an error, which Envoy's default
// failure_mode_deny (false) would let through unlimited.
type Server struct {
	rlsv3.UnimplementedRateLimitServiceServer
	Limiter *limiter.Limiter
}

// Bounds of one ShouldRateLimit call, past which it is refused with RESOURCE_EXHAUSTED before
// anything is decided; MaxMessageBytes is the gRPC server's limit on a request message.
const (
	MaxDescriptors  = 32
	MaxEntries      = 16
	MaxMessageBytes = 64 << 10
)

// ShouldRateLimit decides a call's descriptors together.
func (s *Server) ShouldRateLimit(ctx context.Context, req *rlsv3.RateLimitRequest) (*rlsv3.RateLimitResponse, error) {
	// The bound first: a refusal answers a status for each descriptor.
	if n := len(req.GetDescriptors()); n > MaxDescriptors {
		return nil, status.Errorf(codes.ResourceExhausted, "%d descriptors: at most %d are decided in one call", n, MaxDescriptors)
	}
	reqs, refused, err := s.requests(req)
	if refused != nil || err != nil {
		return refused, err
	}
	// Detached from the call, as every front end decides (the seam): Envoy's timeout must not
	// fail the store.
	per, overall := s.Limiter.DecideAll(context.Background(), reqs)
	if ctx.Err() != nil {
		s.Limiter.Left() // Envoy gave up on the call meanwhile
	}
	return answer(req, per, overall)
}

// requests are the requests a call's descriptors describe, each for its policy; or the call's
// refusal, or the error that fails it.
func (s *Server) requests(req *rlsv3.RateLimitRequest) ([]limiter.Request, *rlsv3.RateLimitResponse, error) {
	domain := req.GetDomain()
	byDomain := s.Limiter.Policy(domain) != nil
	if !byDomain && !slices.ContainsFunc(req.GetDescriptors(), namesPolicy) {
		return nil, refuse(req, seam.NotServedProblem, fmt.Sprintf("domain %q: no policy of that name is served here; the domain is the policy's <namespace>/<name>, "+
			"or each descriptor names its policy with an entry %q", seam.Abbreviate(domain), EntryPolicy)), nil
	}
	reqs := make([]limiter.Request, len(req.GetDescriptors()))
	for i, d := range req.GetDescriptors() {
		r, refused, err := s.request(req, i, d, byDomain)
		if refused != nil || err != nil {
			return nil, refused, err
		}
		reqs[i] = r
	}
	return reqs, nil, nil
}

// request is the request that descriptor i of a call describes, for its policy: the call's
// domain when that is a policy served here (byDomain), else the one its EntryPolicy names.
func (s *Server) request(call *rlsv3.RateLimitRequest, i int, d *rlv3.RateLimitDescriptor, byDomain bool) (limiter.Request, *rlsv3.RateLimitResponse, error) {
	if n := len(d.GetEntries()); n > MaxEntries {
		return limiter.Request{}, nil, status.Errorf(codes.ResourceExhausted, "descriptor %d: %d entries, at most %d", i, n, MaxEntries)
	}
	if d.GetIsNegativeHits() {
		return limiter.Request{}, nil, status.Errorf(codes.InvalidArgument, "descriptor %d: negative hits are not supported", i)
	}
	r, named, err := descriptorRequest(d)
	var bad *contentError
	switch {
	case errors.As(err, &bad):
		return r, refuse(call, seam.MalformedProblem, fmt.Sprintf("descriptor %d: %s", i, bad.detail)), nil
	case err != nil:
		return r, nil, status.Errorf(codes.InvalidArgument, "descriptor %d: %v", i, err)
	}
	named, notServed := s.policyOf(i, named, call.GetDomain(), byDomain)
	if notServed != "" {
		return r, refuse(call, seam.NotServedProblem, notServed), nil
	}
	hits, checkOnly := hitsOf(call, d)
	r.Policy, r.Hits, r.CheckOnly, r.KeysRequired = named, hits, checkOnly, true
	return r, nil, nil
}

// policyOf is the policy descriptor i is decided for, given the one it names ("" for none) and
// the call's domain; or why no policy served here decides it.
func (s *Server) policyOf(i int, named, domain string, byDomain bool) (string, string) {
	switch {
	case named == "" && !byDomain:
		return "", fmt.Sprintf("descriptor %d names no policy: the domain %q is no policy served here; "+
			"name one with an entry %q", i, seam.Abbreviate(domain), EntryPolicy)
	case named == "":
		return domain, ""
	case byDomain && named != domain:
		return "", fmt.Sprintf("descriptor %d names policy %q, the domain %q", i, seam.Abbreviate(named), seam.Abbreviate(domain))
	case s.Limiter.Policy(named) == nil:
		return "", fmt.Sprintf("descriptor %d: %s", i, limiter.NotServed(named))
	}
	return named, ""
}

// hitsOf is what a descriptor charges each rule it matches, a multiple of its cost, and whether
// it only asks. A descriptor's own hits_addend overrides the request's, and may be 0: asked, not
// charged (as envoyproxy/ratelimit reads it). The request's 0 is its default, 1.
func hitsOf(call *rlsv3.RateLimitRequest, d *rlv3.RateLimitDescriptor) (hits int64, checkOnly bool) {
	addend := uint64(call.GetHitsAddend())
	if d.GetHitsAddend() != nil {
		addend = d.GetHitsAddend().GetValue()
		checkOnly = addend == 0
	}
	// Saturated, not wrapped: 2^63 and above would turn negative, and then into 1.
	return max(1, int64(min(addend, math.MaxInt64))), checkOnly
}

// answer is the answer to a call whose requests were decided: per request and overall.
func answer(req *rlsv3.RateLimitRequest, per []limiter.Result, overall limiter.Result) (*rlsv3.RateLimitResponse, error) {
	switch overall.Outcome {
	case limiter.Invalid:
		return refuse(req, seam.MalformedProblem, overall.Reason), nil
	case limiter.Unavailable:
		// A fail-closed rule whose store cannot answer: Envoy applies its failure_mode_deny.
		return nil, status.Errorf(codes.Unavailable, "the rate-limit store is unavailable and rule %q fails closed", overall.Rule.Name)
	}
	resp := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OK,
		Statuses: make([]*rlsv3.RateLimitResponse_DescriptorStatus, len(per)),
		// The RateLimit fields, and Retry-After with a refusal: sized once.
		ResponseHeadersToAdd: make([]*corev3.HeaderValue, 0, 4)}
	if overall.Outcome == limiter.Limited {
		resp.OverallCode = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	for i := range per {
		resp.Statuses[i] = descriptorStatus(&per[i])
	}
	v := seam.Judge(overall)
	v.Write(func(name, value string) {
		if name != "Content-Type" && name != "Cache-Control" { // Envoy writes its own 429
			resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd, &corev3.HeaderValue{Key: name, Value: value})
		}
	})
	// A leaky bucket's wait is not held: Envoy's call times out in milliseconds (20 ms by
	// default) and then applies its own failure mode, so a held answer would only turn a queue
	// into Envoy's failure_mode_deny. Over RLS a leaky bucket admits its capacity at once and
	// its drain rate after that (docs/enforcer.md).
	return resp, nil
}

// refuse answers a call that Sluice does not decide, for a policy not served here or for what
// the request carries (a path that does not parse or is too long, more rules than a decision
// takes): OVER_LIMIT for every descriptor, whatever Envoy's failure mode, since an error is let
// through unlimited under Envoy's default (failure_mode_deny: false); with a problem body of
// typ naming why, which Envoy sends with its 429. What Envoy's own configuration gets wrong (too
// many descriptors or entries, negative hits, a repeated entry) stays an error.
func refuse(req *rlsv3.RateLimitRequest, typ, detail string) *rlsv3.RateLimitResponse {
	resp := &rlsv3.RateLimitResponse{OverallCode: rlsv3.RateLimitResponse_OVER_LIMIT}
	for range req.GetDescriptors() { // Envoy expects a status for each
		resp.Statuses = append(resp.Statuses, &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OVER_LIMIT})
	}
	resp.RawBody, _ = json.Marshal(seam.Problem{Type: typ, Title: http.StatusText(http.StatusTooManyRequests), Status: http.StatusTooManyRequests, Detail: detail})
	resp.RawBody = append(resp.RawBody, '\n')
	for _, h := range [][2]string{{"Content-Type", "application/problem+json"}, {"Cache-Control", "no-store"}} {
		resp.ResponseHeadersToAdd = append(resp.ResponseHeadersToAdd, &corev3.HeaderValue{Key: h[0], Value: h[1]})
	}
	return resp
}

// contentError is a descriptor that the request's own content makes undecidable: its path.
type contentError struct{ detail string }

func (e *contentError) Error() string { return e.detail }

// namesPolicy reports whether a descriptor names its policy (EntryPolicy).
func namesPolicy(d *rlv3.RateLimitDescriptor) bool {
	return slices.ContainsFunc(d.GetEntries(), func(e *rlv3.RateLimitDescriptor_Entry) bool {
		return strings.EqualFold(e.GetKey(), EntryPolicy)
	})
}

// descriptorRequest maps a descriptor's entries onto a request, and returns the policy it names
// (EntryPolicy), if any.
func descriptorRequest(d *rlv3.RateLimitDescriptor) (limiter.Request, string, error) {
	if n := len(d.GetEntries()); n > MaxEntries { // ShouldRateLimit refuses it before
		return limiter.Request{}, "", fmt.Errorf("%d entries, at most %d", n, MaxEntries)
	}
	h := &entryHeader{}
	in := seam.Input{Header: h, Target: "/"}
	var peer netip.Addr
	var named string
	hasPath := false
	var seen uint8 // the entries of a meaning of their own seen so far (entryBit)
	for _, e := range d.GetEntries() {
		key := strings.ToLower(e.GetKey())
		bit := entryBit(key)
		if seen&bit != 0 {
			return limiter.Request{}, "", fmt.Errorf("entry %q is repeated: a request has one", key)
		}
		seen |= bit
		switch key {
		case EntryPolicy:
			named = e.GetValue()
		case EntryRemoteAddress:
			a, err := netip.ParseAddr(e.GetValue())
			if err != nil {
				return limiter.Request{}, "", err
			}
			peer = a.Unmap()
		case EntryMethod:
			in.Method = e.GetValue()
		case EntryPath:
			in.Target, hasPath = e.GetValue(), true
		default:
			h.add(e.GetKey(), e.GetValue())
		}
	}
	r, bad := in.Request()
	if bad != nil {
		return r, "", &contentError{bad.Detail}
	}
	if !hasPath {
		r.Path = "" // a descriptor without a path carries none: rules keyed on it do not apply
	}
	r.Peer = peer
	return r, named, nil
}

// entryBit is an entry key's bit in a set of the keys of a meaning of their own, which a
// descriptor holds once at most; 0 for a request header, which it may repeat.
func entryBit(key string) uint8 {
	switch key {
	case EntryPolicy:
		return 1
	case EntryRemoteAddress:
		return 2
	case EntryMethod:
		return 4
	case EntryPath:
		return 8
	}
	return 0
}

// entryHeader is a descriptor's other entries as the request header fields they stand for, read
// as http.Header reads its fields, names compared without regard to ASCII case, in one
// allocation: a descriptor holds at most MaxEntries.
type entryHeader struct {
	n             int
	names, values [MaxEntries]string
}

func (h *entryHeader) add(name, value string) {
	h.names[h.n], h.values[h.n] = name, value
	h.n++
}

// Values implements policy.Header. The values of a name sent in a row share the header's array,
// capped, so that nothing the caller appends reaches it; only a name repeated apart copies.
func (h *entryHeader) Values(name string) []string {
	first, last, count := -1, -1, 0
	for i := range h.n {
		if asciiEqualFold(h.names[i], name) {
			if first < 0 {
				first = i
			}
			last = i
			count++
		}
	}
	switch {
	case count == 0:
		return nil
	case last-first+1 == count:
		return h.values[first : last+1 : last+1]
	}
	values := make([]string, 0, count)
	for i := first; i <= last; i++ {
		if asciiEqualFold(h.names[i], name) {
			values = append(values, h.values[i])
		}
	}
	return values
}

// asciiEqualFold reports whether two field names are equal without regard to ASCII case, as
// HTTP compares them: no other folding (strings.EqualFold also folds the Kelvin sign into k).
func asciiEqualFold(a, b string) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range len(a) {
		x, y := a[i], b[i]
		if 'A' <= x && x <= 'Z' {
			x += 'a' - 'A'
		}
		if 'A' <= y && y <= 'Z' {
			y += 'a' - 'A'
		}
		if x != y {
			return false
		}
	}
	return true
}

// descriptorStatus is a descriptor's status: its code, and the limit, remaining and reset of the
// rule its RateLimit fields describe.
func descriptorStatus(r *limiter.Result) *rlsv3.RateLimitResponse_DescriptorStatus {
	st := &rlsv3.RateLimitResponse_DescriptorStatus{Code: rlsv3.RateLimitResponse_OK}
	if r.Outcome == limiter.Limited {
		st.Code = rlsv3.RateLimitResponse_OVER_LIMIT
	}
	if r.Rule == nil || r.Decision.Limit == 0 { // no rule, or a refusal the store did not decide
		return st
	}
	d := r.Decision
	st.CurrentLimit = &rlsv3.RateLimitResponse_RateLimit{Name: r.Rule.Name, RequestsPerUnit: uint32(min(d.Limit, 1<<32-1))}
	st.CurrentLimit.Unit, st.CurrentLimit.UnitMultiplier = unitOf(r.Rule.Limit.Period)
	st.LimitRemaining = uint32(min(max(d.Remaining, 0), 1<<32-1))
	st.DurationUntilReset = durationpb.New(d.Reset)
	return st
}

// unitOf expresses a period in Envoy's units: the largest unit it is a whole number of, and the
// number. A period of no whole second is UNKNOWN.
func unitOf(period time.Duration) (rlsv3.RateLimitResponse_RateLimit_Unit, *wrapperspb.UInt32Value) {
	for _, u := range []struct {
		d    time.Duration
		unit rlsv3.RateLimitResponse_RateLimit_Unit
	}{
		{24 * time.Hour, rlsv3.RateLimitResponse_RateLimit_DAY},
		{time.Hour, rlsv3.RateLimitResponse_RateLimit_HOUR},
		{time.Minute, rlsv3.RateLimitResponse_RateLimit_MINUTE},
		{time.Second, rlsv3.RateLimitResponse_RateLimit_SECOND},
	} {
		if period >= u.d && period%u.d == 0 {
			n := period / u.d
			if n == 1 {
				return u.unit, nil
			}
			return u.unit, wrapperspb.UInt32(uint32(n))
		}
	}
	return rlsv3.RateLimitResponse_RateLimit_UNKNOWN, nil
}
