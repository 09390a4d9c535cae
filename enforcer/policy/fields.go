package policy

import (
	"math"
	"strconv"
	"time"

	"github.com/dunglas/httpsfv"

	"github.com/sluice-dev/sluice/enforcer/algorithm"
)

// Fields are a rule's members of the RateLimit-Policy and RateLimit response fields of
// draft-ietf-httpapi-ratelimit-headers, structured-field lists:
//
//	RateLimit-Policy: "burst";q=10;w=1
//	RateLimit: "burst";r=0;t=1
//
// The policy member never changes and the limit member changes only in r and t, so both are
// serialized once, when the rule is compiled, and every response appends two integers.
type Fields struct {
	// Policy is the whole RateLimit-Policy member: the quota q and its window w in seconds.
	Policy string
	// name is the rule name as a structured-field string.
	name string
}

func newFields(r *Rule) Fields {
	name, err := httpsfv.Marshal(httpsfv.NewItem(r.Name))
	if err != nil {
		return Fields{} // a name that is no sf-string: the schema allows none
	}
	return Fields{name: name, Policy: name + ";q=" + strconv.FormatInt(r.Limit.Limit, 10) + ";w=" + strconv.FormatInt(max(1, Seconds(quotaWindow(r.Limit))), 10)}
}

// Limit is the RateLimit member for remaining units r and a reset in t seconds.
func (f Fields) Limit(remaining, reset int64) string {
	b := make([]byte, 0, len(f.name)+32)
	b = append(b, f.name...)
	b = append(b, ";r="...)
	b = strconv.AppendInt(b, remaining, 10)
	b = append(b, ";t="...)
	b = strconv.AppendInt(b, reset, 10)
	return string(b)
}

// Seconds rounds a duration up to whole seconds: a client that waits them is never early.
func Seconds(d time.Duration) int64 { return int64(math.Ceil(d.Seconds())) }

// quotaWindow is the time the quota refers to: the window, or the time an empty bucket takes to
// fill.
func quotaWindow(l algorithm.Limit) time.Duration {
	switch l.Kind {
	case algorithm.TokenBucket, algorithm.LeakyBucket:
		return time.Duration(float64(l.Period) * float64(l.Limit) / float64(l.Rate))
	}
	return l.Period
}
