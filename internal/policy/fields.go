package policy

import (
	"math"
	"strconv"
	"strings"
	"time"

	"github.com/dunglas/httpsfv"

	"github.com/sluice-dev/sluice/internal/algorithm"
)

// Fields are a rule's members of the RateLimit-Policy and RateLimit response fields of
// draft-ietf-httpapi-ratelimit-headers, structured-field lists:
//
//	RateLimit-Policy: "burst";q=10;w=1
//	RateLimit: "burst";r=0;t=1
//
// The policy member never changes and the limit member changes only in r and t, so both are
// serialized once, when the rule is compiled, and every response appends two integers.
//
// A concurrency limit's quota is in the draft's concurrent-requests unit, with no window, and its
// limit member has no reset: a slot frees when a request in flight ends, which no clock says.
//
//	RateLimit-Policy: "in-flight";q=10;qu="concurrent-requests"
//	RateLimit: "in-flight";r=0
type Fields struct {
	// Policy is the whole RateLimit-Policy member: the quota q and its window w in seconds, or
	// its unit qu.
	Policy string
	// name is the rule name as a structured-field string.
	name string
	// noReset leaves t out of the limit member.
	noReset bool
}

func newFields(r *Rule) Fields {
	name, err := httpsfv.Marshal(httpsfv.NewItem(r.Name))
	if err != nil {
		return Fields{} // a name that is no sf-string: the schema allows none
	}
	if r.Limit.Kind == algorithm.Concurrency {
		return Fields{name: name, noReset: true, Policy: name + ";q=" + strconv.FormatInt(r.Limit.Limit, 10) + `;qu="concurrent-requests"`}
	}
	return Fields{name: name, Policy: name + ";q=" + strconv.FormatInt(r.Limit.Limit, 10) + ";w=" + strconv.FormatInt(max(1, Seconds(r.Limit.Horizon())), 10)}
}

// Limit is the RateLimit member for remaining units r and a reset in t seconds, built in one
// allocation: it is written on every response.
func (f Fields) Limit(remaining, reset int64) string {
	var num [20]byte
	var b strings.Builder
	b.Grow(len(f.name) + 2*len(";r=") + 2*len(num))
	b.WriteString(f.name)
	b.WriteString(";r=")
	b.Write(strconv.AppendInt(num[:0], remaining, 10))
	if !f.noReset {
		b.WriteString(";t=")
		b.Write(strconv.AppendInt(num[:0], reset, 10))
	}
	return b.String()
}

// Seconds rounds a duration up to whole seconds: a client that waits them is never early.
func Seconds(d time.Duration) int64 { return int64(math.Ceil(d.Seconds())) }
