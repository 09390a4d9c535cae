package enforcer

import (
	"encoding/json"
	"net/http"
	"net/netip"
	"strings"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
	"github.com/sluice-dev/sluice/enforcer/internal/store"
)

// keysReply is what the admin endpoint /keys answers.
type keysReply struct {
	Policy string     `json:"policy"`
	Rules  []ruleKeys `json:"rules"`
}

type ruleKeys struct {
	Rule string `json:"rule"`
	// ID is the rule's state ID, the end of each of its keys.
	ID string `json:"id"`
	// Pattern finds every client's key of the rule: redis-cli --scan --pattern '<pattern>'.
	Pattern string `json:"pattern"`
	// Key is the key of the described request, when the rule matches it.
	Key string `json:"key,omitempty"`
}

// KeysPath is the admin endpoint that names a policy's Redis keys. The key names are hashes, so
// that raw client keys never reach Redis; this endpoint computes them for an operator:
//
//	GET /keys?policy=<namespace>/<name>
//	    every rule's ID and the SCAN pattern that finds all its keys
//	GET /keys?policy=<namespace>/<name>&addr=<client address>[&method=GET][&path=/x][&header=Name:value ...]
//	    also the key of each rule that matches such a request
const KeysPath = "/keys"

func (e *Enforcer) serveKeys(w http.ResponseWriter, r *http.Request) {
	q := r.URL.Query()
	id := q.Get("policy")
	var reply *keysReply
	if p := e.limiter.Policy(id); p != nil {
		reply = &keysReply{Policy: p.ID}
		describe := q.Has("addr") || q.Has("path") || q.Has("header")
		var req limiter.Request
		if describe {
			addr, err := netip.ParseAddr(q.Get("addr"))
			if q.Has("addr") && err != nil {
				http.Error(w, "addr: "+err.Error(), http.StatusBadRequest)
				return
			}
			req = limiter.Request{Method: strings.ToUpper(q.Get("method")), Path: q.Get("path"), Peer: addr.Unmap()}
			if req.Method == "" {
				req.Method = http.MethodGet
			}
			if req.Path == "" {
				req.Path = "/"
			}
			h := http.Header{}
			for _, kv := range q["header"] {
				name, value, ok := strings.Cut(kv, ":")
				if !ok {
					http.Error(w, "header: want Name:value, got "+kv, http.StatusBadRequest)
					return
				}
				h.Add(strings.TrimSpace(name), strings.TrimSpace(value))
			}
			req.Header = h
			req.Policy = p.ID
		}
		var keys map[string]string
		if describe {
			var invalid string
			if keys, invalid = e.limiter.Keys(&req); invalid != "" {
				http.Error(w, invalid, http.StatusBadRequest)
				return
			}
		}
		for i := range p.Rules {
			rule := &p.Rules[i]
			reply.Rules = append(reply.Rules, ruleKeys{Rule: rule.Name, ID: rule.StateKey, Pattern: store.RulePattern(rule.StateKey), Key: keys[rule.Name]})
		}
	}
	if reply == nil {
		http.Error(w, "no policy "+id+" is served here; name it as <namespace>/<name>", http.StatusNotFound)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	_ = json.NewEncoder(w).Encode(reply)
}
