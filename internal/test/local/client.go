package local

import (
	"net/http"
	"time"
)

// ClientFor is an HTTP client that speaks HTTP/1.1, or cleartext HTTP/2 with prior knowledge
// when via is "h2c", as the two kinds of client a proxy front end serves.
func ClientFor(via string, timeout time.Duration) *http.Client {
	var protocols http.Protocols
	if via == "h2c" {
		protocols.SetUnencryptedHTTP2(true)
	} else {
		protocols.SetHTTP1(true)
	}
	return &http.Client{Transport: &http.Transport{Protocols: &protocols}, Timeout: timeout}
}
