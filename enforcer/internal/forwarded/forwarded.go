// Package forwarded is what the proxies tell the upstream about the request they received, in
// X-Forwarded-For, -Host, -Proto and RFC 7239's Forwarded. A peer in a policy's trustedProxies is
// a proxy whose fields are kept: its chains are extended with the peer, and its original host
// and protocol are passed on (from X-Forwarded-Host and -Proto, or else from the first element
// of its Forwarded). Any other peer's fields are replaced by what the connection says: the peer,
// the Host it sent, and http (the proxy listens in cleartext).
package forwarded

import (
	"net/http"
	"net/netip"
	"strings"

	"github.com/sluice-dev/sluice/enforcer/internal/limiter"
)

// MaxBytes bounds the Forwarded value a trusted peer may hand on: a longer one, or one
// that does not parse, is replaced by the proxy's own element, as an untrusted peer's is.
const MaxBytes = 4 << 10

// Trusts reports whether any loaded policy trusts peer as a proxy in front of the enforcer.
func Trusts(l *limiter.Limiter, peer netip.Addr) bool {
	for _, p := range l.Policies() {
		for _, prefix := range p.TrustedProxies {
			if prefix.Contains(peer) {
				return true
			}
		}
	}
	return false
}

// AppendElement appends the proxy's own Forwarded element for a request from peer
// with the given Host: for=, host= and proto=http (the enforcer's listeners speak cleartext; TLS
// ends in front of it), quoted where RFC 7239 wants it.
func AppendElement(dst []byte, peer netip.Addr, host []byte) []byte {
	dst = append(dst, "for="...)
	switch {
	case peer.Is6():
		dst = append(dst, `"[`...)
		dst = peer.AppendTo(dst)
		dst = append(dst, `]"`...)
	case peer.IsValid():
		dst = peer.AppendTo(dst)
	default:
		dst = append(dst, "unknown"...)
	}
	if len(host) > 0 && quotable(host) {
		dst = append(dst, ";host="...)
		dst = appendForwardedValue(dst, host)
	}
	return append(dst, ";proto=http"...)
}

// appendForwardedValue appends v as a token, or as a quoted string when it is not one.
func appendForwardedValue(dst, v []byte) []byte {
	token := len(v) > 0
	for _, c := range v {
		if !isTokenChar(c) {
			token = false
			break
		}
	}
	if token {
		return append(dst, v...)
	}
	dst = append(dst, '"')
	for _, c := range v {
		if c == '"' || c == '\\' {
			dst = append(dst, '\\')
		}
		dst = append(dst, c)
	}
	return append(dst, '"')
}

// quotable reports whether v fits in a quoted string: no control character but HTAB.
func quotable(v []byte) bool {
	for _, c := range v {
		if !isQuotedPairChar(c) {
			return false
		}
	}
	return true
}

// First parses a Forwarded field value (its lines joined with ", ") and returns the
// host and proto parameters of its first element, unquoted ("" where absent). ok is false when
// the value is empty, over MaxBytes, or anywhere not RFC 7239's grammar: pairs of a
// token and a token or quoted string, separated by ';' within an element and ',' between
// elements, no parameter twice in one element, and a proto that is a URI scheme.
func First(v string) (host, proto string, ok bool) {
	if v == "" || len(v) > MaxBytes {
		return "", "", false
	}
	first := true
	var seen [4]bool // for, by, host, proto within the current element
	i := 0
	for {
		i = skipOWS(v, i)
		if i == len(v) {
			return host, proto, true
		}
		switch v[i] {
		case ',':
			first, seen = false, [4]bool{}
			i++
			continue
		case ';':
			i++
			continue
		}
		name, value, next, good := pair(v, i)
		k := param(name)
		if !good || k == 3 && !IsScheme(value) || k >= 0 && seen[k] {
			return "", "", false
		}
		if k >= 0 {
			seen[k] = true
		}
		if first && k == 2 {
			host = value
		}
		if first && k == 3 {
			proto = value
		}
		if i = skipOWS(v, next); i < len(v) && v[i] != ';' && v[i] != ',' {
			return "", "", false
		}
	}
}

// pair reads a parameter, a token, '=' and a token or quoted string, at v[i:], returning its
// name, its value unquoted and the index after it.
func pair(v string, i int) (name, value string, next int, ok bool) {
	j := i
	for j < len(v) && isTokenChar(v[j]) {
		j++
	}
	if j == i || j == len(v) || v[j] != '=' {
		return "", "", 0, false
	}
	value, next, ok = forwardedValue(v, j+1)
	return v[i:j], value, next, ok
}

// param is the place of a parameter RFC 7239 defines (for, by, host, proto) in an element's
// set of those seen, -1 for any other.
func param(name string) int {
	for k, p := range [...]string{"for", "by", "host", "proto"} {
		if strings.EqualFold(name, p) {
			return k
		}
	}
	return -1
}

// forwardedValue reads a token or a quoted string at v[i:], returning it unquoted and the index
// after it.
func forwardedValue(v string, i int) (value string, next int, ok bool) {
	if i < len(v) && v[i] == '"' {
		var b strings.Builder
		escaped := false
		for j := i + 1; j < len(v); j++ {
			c := v[j]
			switch {
			case c == '\\':
				if j+1 == len(v) || !isQuotedPairChar(v[j+1]) {
					return "", 0, false
				}
				if !escaped {
					escaped = true
					b.WriteString(v[i+1 : j])
				}
				j++
				b.WriteByte(v[j])
			case c == '"':
				if escaped {
					return b.String(), j + 1, true
				}
				return v[i+1 : j], j + 1, true
			case !isQuotedPairChar(c):
				return "", 0, false
			case escaped:
				b.WriteByte(c)
			}
		}
		return "", 0, false // no closing quote
	}
	j := i
	for j < len(v) && isTokenChar(v[j]) {
		j++
	}
	if j == i {
		return "", 0, false
	}
	return v[i:j], j, true
}

func skipOWS(v string, i int) int {
	for i < len(v) && (v[i] == ' ' || v[i] == '\t') {
		i++
	}
	return i
}

// isTokenChar is RFC 9110's tchar.
func isTokenChar(c byte) bool {
	switch {
	case c >= 'a' && c <= 'z', c >= 'A' && c <= 'Z', c >= '0' && c <= '9':
		return true
	}
	return strings.IndexByte("!#$%&'*+-.^_`|~", c) >= 0
}

// isQuotedPairChar is what a quoted string may hold: HTAB, SP, visible characters and
// obs-text; a '"' or '\' only escaped.
func isQuotedPairChar(c byte) bool { return c == '\t' || c == ' ' || (c > 0x20 && c != 0x7f) }

// IsScheme reports whether s is a URI scheme (RFC 3986, 3.1).
func IsScheme(s string) bool {
	if s == "" || !isAlpha(s[0]) {
		return false
	}
	for i := 1; i < len(s); i++ {
		if c := s[i]; !isAlpha(c) && (c < '0' || c > '9') && c != '+' && c != '-' && c != '.' {
			return false
		}
	}
	return true
}

func isAlpha(c byte) bool { return c >= 'a' && c <= 'z' || c >= 'A' && c <= 'Z' }

// Set sets the forwarded fields of a request the net/http proxy sends on, as the fasthttp
// proxy's rewrite does: out is the outgoing header, in the incoming one, host the Host the client
// sent.
func Set(out, in http.Header, peer netip.Addr, host string, trusted bool) {
	var xff, fwd []byte
	xfh, xfp := host, "http"
	if trusted {
		for _, prior := range in.Values("X-Forwarded-For") {
			xff = append(append(xff, prior...), ", "...)
		}
		prior := strings.Join(in.Values("Forwarded"), ", ")
		fh, fp, ok := First(prior)
		if ok {
			fwd = append(append(fwd, prior...), ", "...)
		}
		if v := in.Get("X-Forwarded-Host"); v != "" {
			xfh = v
		} else if fh != "" {
			xfh = fh
		}
		if v := in.Get("X-Forwarded-Proto"); v != "" {
			xfp = v
		} else if fp != "" {
			xfp = fp
		}
	}
	out.Set("X-Forwarded-For", string(peer.AppendTo(xff)))
	out.Set("X-Forwarded-Host", xfh)
	out.Set("X-Forwarded-Proto", xfp)
	out.Set("Forwarded", string(AppendElement(fwd, peer, []byte(host))))
}
