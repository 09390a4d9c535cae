package main

import (
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"io"
	"math/big"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/test/local"
)

// The hop to the upstream through the real binary: TLS with a CA of the test's own, HTTP/2 by
// ALPN and by prior knowledge, client certificates, timeouts and pooled connections.

const upstreamPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: upstream, namespace: test}
spec:
  targetRef: {name: api, port: 443}
  rules:
    - name: one-call
      match: {path: {type: Prefix, value: /grpc.testing.TestService/EmptyCall}}
      fixedWindow: {limit: 1, window: 1h}
    - name: closed
      match: {path: {type: Prefix, value: /grpc.testing.TestService/CacheableUnaryCall}}
      fixedWindow: {limit: 1000000, window: 1h}
      failureMode: Closed
    - name: any
      fixedWindow: {limit: 1000000, window: 1h}
`

// binaryEnforcer is the enforcer binary in front of one upstream.
type binaryEnforcer struct {
	p            *local.Process
	proxy, admin string
	log          *local.Output
}

func startFronting(t *testing.T, upstream string, flags ...string) *binaryEnforcer {
	t.Helper()
	return startFrontingWith(t, upstreamPolicy, upstream, flags...)
}

// startFrontingWith is startFronting with a policy file of the caller's.
func startFrontingWith(t *testing.T, policy, upstream string, flags ...string) *binaryEnforcer {
	t.Helper()
	file := filepath.Join(t.TempDir(), "policy.yaml")
	if err := os.WriteFile(file, []byte(policy), 0o600); err != nil {
		t.Fatal(err)
	}
	e := &binaryEnforcer{log: &local.Output{}}
	e.proxy, _ = local.FreeAddr()
	e.admin, _ = local.FreeAddr()
	p, err := local.Start("enforcer", e.log, binary(t), append([]string{"--policy=" + file, "--upstream=" + upstream,
		"--listen=" + e.proxy, "--check-listen=", "--admin-listen=" + e.admin, "--shutdown-delay=0s"}, flags...)...)
	if err != nil {
		t.Fatal(err)
	}
	e.p = p
	t.Cleanup(func() {
		p.Stop()
		if t.Failed() {
			t.Logf("enforcer log:\n%s", e.log.String())
		}
	})
	if err := local.WaitHTTP(p, "http://"+e.admin+"/readyz", 30*time.Second); err != nil {
		t.Fatal(err)
	}
	return e
}

func (e *binaryEnforcer) metric(t *testing.T, series string) float64 {
	t.Helper()
	return (&hostile{admin: e.admin}).metric(t, series)
}

// testPKI is a CA of the test's own, a server certificate for api.test and 127.0.0.1, and a
// client certificate, all signed by it, written as PEM files.
type testPKI struct {
	pool                      *x509.CertPool
	server, client            tls.Certificate
	caFile, certFile, keyFile string
}

func newTestPKI(t *testing.T) *testPKI {
	t.Helper()
	dir := t.TempDir()
	caKey, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	caTmpl := &x509.Certificate{SerialNumber: big.NewInt(1), Subject: pkix.Name{CommonName: "sluice test CA"}, NotBefore: time.Now().Add(-time.Hour),
		NotAfter: time.Now().Add(time.Hour), IsCA: true, BasicConstraintsValid: true, KeyUsage: x509.KeyUsageCertSign}
	caDER, err := x509.CreateCertificate(rand.Reader, caTmpl, caTmpl, &caKey.PublicKey, caKey)
	if err != nil {
		t.Fatal(err)
	}
	ca, _ := x509.ParseCertificate(caDER)
	pki := &testPKI{pool: x509.NewCertPool()}
	pki.pool.AddCert(ca)
	issue := func(serial int64, usage x509.ExtKeyUsage, names []string, ips []net.IP) (tls.Certificate, []byte, []byte) {
		key, _ := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
		tmpl := &x509.Certificate{SerialNumber: big.NewInt(serial), Subject: pkix.Name{CommonName: "sluice test"}, NotBefore: time.Now().Add(-time.Hour),
			NotAfter: time.Now().Add(time.Hour), DNSNames: names, IPAddresses: ips, ExtKeyUsage: []x509.ExtKeyUsage{usage}, KeyUsage: x509.KeyUsageDigitalSignature}
		der, err := x509.CreateCertificate(rand.Reader, tmpl, ca, &key.PublicKey, caKey)
		if err != nil {
			t.Fatal(err)
		}
		keyDER, _ := x509.MarshalPKCS8PrivateKey(key)
		certPEM := pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der})
		keyPEM := pem.EncodeToMemory(&pem.Block{Type: "PRIVATE KEY", Bytes: keyDER})
		c, err := tls.X509KeyPair(certPEM, keyPEM)
		if err != nil {
			t.Fatal(err)
		}
		return c, certPEM, keyPEM
	}
	pki.server, _, _ = issue(2, x509.ExtKeyUsageServerAuth, []string{"api.test"}, []net.IP{net.ParseIP("127.0.0.1")})
	var certPEM, keyPEM []byte
	pki.client, certPEM, keyPEM = issue(3, x509.ExtKeyUsageClientAuth, nil, nil)
	pki.caFile, pki.certFile, pki.keyFile = filepath.Join(dir, "ca.pem"), filepath.Join(dir, "client.pem"), filepath.Join(dir, "client-key.pem")
	for file, data := range map[string][]byte{pki.caFile: pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: caDER}), pki.certFile: certPEM, pki.keyFile: keyPEM} {
		if err := os.WriteFile(file, data, 0o600); err != nil {
			t.Fatal(err)
		}
	}
	return pki
}

// serveTLS serves h over TLS with the PKI's server certificate, offering the given ALPN
// protocols, and requiring a client certificate when asked to.
func serveTLS(t *testing.T, pki *testPKI, h http.Handler, alpn []string, requireClient bool) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	c := &tls.Config{Certificates: []tls.Certificate{pki.server}, NextProtos: alpn, MinVersion: tls.VersionTLS12}
	if requireClient {
		c.ClientAuth, c.ClientCAs = tls.RequireAndVerifyClientCert, pki.pool
	}
	srv := &http.Server{Handler: h, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(tls.NewListener(ln, c)) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().String()
}

// serveH2C serves h in cleartext HTTP/2 with prior knowledge only, as gRPC servers do.
func serveH2C(t *testing.T, h http.Handler) string {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var protocols http.Protocols
	protocols.SetUnencryptedHTTP2(true)
	srv := &http.Server{Handler: h, Protocols: &protocols, ReadHeaderTimeout: 10 * time.Second}
	go func() { _ = srv.Serve(ln) }()
	t.Cleanup(func() { _ = srv.Close() })
	return ln.Addr().String()
}

// protoEcho answers with the protocol the request reached it in.
var protoEcho = http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { _, _ = io.WriteString(w, r.Proto) })

// Each upstream scheme through the binary, from an HTTP/1.1 and an h2c client: what the upstream
// reads, and a TLS upstream that cannot be verified is a 502, never a cleartext hop.
func TestEnforcerBinaryWhenTheUpstreamSpeaksTLSOrHTTP2ThenRequestsReachItSo(t *testing.T) {
	pki := newTestPKI(t)
	h2TLS := serveTLS(t, pki, protoEcho, []string{"h2", "http/1.1"}, false)
	h1TLS := serveTLS(t, pki, protoEcho, []string{"http/1.1"}, false)
	mtls := serveTLS(t, pki, protoEcho, []string{"h2"}, true)
	h2c := serveH2C(t, protoEcho)
	cases := []struct {
		name     string
		upstream string
		flags    []string
		status   int
		proto    string // what the upstream read
	}{
		{"when the TLS upstream offers h2 then it is spoken", "https://" + h2TLS, []string{"--upstream-ca-file=" + pki.caFile}, 200, "HTTP/2.0"},
		{"when the TLS upstream offers only HTTP/1.1 then it is spoken", "https://" + h1TLS, []string{"--upstream-ca-file=" + pki.caFile}, 200, "HTTP/1.1"},
		{"when the server name is one the certificate holds then it is verified by that name", "https://" + h2TLS,
			[]string{"--upstream-ca-file=" + pki.caFile, "--upstream-server-name=api.test"}, 200, "HTTP/2.0"},
		{"when the server name is not in the certificate then 502", "https://" + h2TLS,
			[]string{"--upstream-ca-file=" + pki.caFile, "--upstream-server-name=other.test"}, 502, ""},
		{"when only the system roots are trusted then the test CA's certificate is refused: 502", "https://" + h2TLS, nil, 502, ""},
		{"when the upstream wants a client certificate and gets it then it answers", "https://" + mtls,
			[]string{"--upstream-ca-file=" + pki.caFile, "--upstream-cert-file=" + pki.certFile, "--upstream-key-file=" + pki.keyFile}, 200, "HTTP/2.0"},
		{"when the upstream wants a client certificate and gets none then 502", "https://" + mtls, []string{"--upstream-ca-file=" + pki.caFile}, 502, ""},
		{"when the upstream is h2c then HTTP/2 is spoken with prior knowledge", "h2c://" + h2c, nil, 200, "HTTP/2.0"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			e := startFronting(t, c.upstream, c.flags...)
			for _, via := range []string{"HTTP/1.1", "h2c"} {
				resp, err := local.ClientFor(via, 20*time.Second).Get("http://" + e.proxy + "/proto")
				if err != nil {
					t.Fatalf("%s: %v", via, err)
				}
				body, _ := io.ReadAll(resp.Body)
				_ = resp.Body.Close()
				if resp.StatusCode != c.status || (c.status == 200 && string(body) != c.proto) {
					t.Errorf("from %s: %d, the upstream read %q; want %d, %q", via, resp.StatusCode, body, c.status, c.proto)
				}
				if resp.Header.Get("RateLimit") == "" {
					t.Errorf("from %s: no RateLimit fields", via)
				}
			}
		})
	}
}

// heldPolicy holds a concurrency slot for each request to /held, and lets every other pass.
const heldPolicy = `apiVersion: ratelimit.sluice.dev/v1alpha1
kind: RateLimitPolicy
metadata: {name: held, namespace: test}
spec:
  targetRef: {name: api, port: 443}
  rules:
    - name: held
      match: {path: {type: Prefix, value: /held}}
      concurrency: {limit: 5, leaseTimeout: 10s}
    - name: any
      fixedWindow: {limit: 1000000, window: 1h}
`

// The requests an HTTP/1.1 client sends that the fast path would forward on connections of their
// own, a WebSocket upgrade and a request holding a concurrency slot, reach an https upstream as
// every other does: through net/http's transport, with the CA, the server name and the client
// certificate given (the fasthttp proxy had a TLS branch of its own for them, which nothing
// reached and which ignored all three).
func TestEnforcerBinaryWhenAnHTTPSUpstreamWantsItsNameAndAClientCertificateThenUpgradesAndHeldRequestsPresentThem(t *testing.T) {
	pki := newTestPKI(t)
	ws := websocketLate(0)
	up := serveTLS(t, pki, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		if r.URL.Path == "/ws" {
			ws.ServeHTTP(w, r)
			return
		}
		_, _ = io.WriteString(w, r.TLS.ServerName+" "+r.TLS.PeerCertificates[0].Subject.CommonName)
	}), []string{"http/1.1"}, true)
	e := startFrontingWith(t, heldPolicy, "https://"+up, "--upstream-ca-file="+pki.caFile, "--upstream-server-name=api.test",
		"--upstream-cert-file="+pki.certFile, "--upstream-key-file="+pki.keyFile)

	resp, err := local.ClientFor("HTTP/1.1", 20*time.Second).Get("http://" + e.proxy + "/held")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	_ = resp.Body.Close()
	if resp.StatusCode != http.StatusOK || string(body) != "api.test sluice test" {
		t.Errorf("a request holding a slot: %d, the upstream read %q; want 200 by the name api.test with the client certificate", resp.StatusCode, body)
	}

	_, br := upgraded(t, e.proxy)
	if line, err := br.ReadString('\n'); line != "late\n" {
		t.Fatalf("through the upgraded connection: %q, %v", line, err)
	}
}
