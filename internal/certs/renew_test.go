package certs

import (
	"bytes"
	"crypto/x509"
	"encoding/pem"
	"testing"
	"time"
)

func parse(t *testing.T, data []byte) []*x509.Certificate {
	t.Helper()
	var certs []*x509.Certificate
	for b, rest := pem.Decode(data); b != nil; b, rest = pem.Decode(rest) {
		c, err := x509.ParseCertificate(b.Bytes)
		if err != nil {
			t.Fatal(err)
		}
		certs = append(certs, c)
	}
	return certs
}

// verify checks that the serving certificate of data is trusted by its bundle for host.
func verify(t *testing.T, data map[string][]byte, host string, at time.Time) {
	t.Helper()
	pool := x509.NewCertPool()
	if !pool.AppendCertsFromPEM(data[KeyCABundle]) {
		t.Fatal("empty CA bundle")
	}
	if _, err := parse(t, data[KeyCert])[0].Verify(x509.VerifyOptions{Roots: pool, DNSName: host, CurrentTime: at}); err != nil {
		t.Fatalf("serving certificate not trusted by the bundle: %v", err)
	}
}

func TestRenewWhenTimePassesThenEachCertificateIsRenewedWithAThirdOfItsLifeLeft(t *testing.T) {
	r := &Rotator{Hosts: []string{"webhook.sluice-system.svc", "127.0.0.1"}, CAValidity: 96 * time.Hour, CertValidity: 9 * time.Hour}
	t0 := time.Date(2026, 12, 2, 0, 0, 0, 0, time.UTC)
	step := func(data map[string][]byte, at time.Duration) (map[string][]byte, bool) {
		t.Helper()
		out, changed, err := r.renew(data, t0.Add(at))
		if err != nil {
			t.Fatal(err)
		}
		verify(t, out, r.Hosts[0], t0.Add(at))
		return out, changed
	}

	first, changed := step(nil, 0)
	if !changed || len(parse(t, first[KeyCABundle])) != 1 {
		t.Fatalf("when there is no Secret then a CA and a certificate are made; changed = %v", changed)
	}
	if _, changed := step(first, 5*time.Hour); changed {
		t.Error("when two thirds of the certificate's life remain then nothing changes")
	}
	second, changed := step(first, 6*time.Hour+time.Minute)
	if !changed || bytes.Equal(second[KeyCert], first[KeyCert]) || !bytes.Equal(second[KeyCACert], first[KeyCACert]) {
		t.Error("when a third of the certificate's life remains then the certificate is renewed by the same CA")
	}

	// The CA: at 64h a third of its 96h remains. The certificate is renewed as it comes due until
	// then; the last time at 61h, so it is not due when the CA is.
	data := second
	for _, at := range []time.Duration{12, 18, 24, 30, 36, 42, 48, 54, 61} {
		data, _ = step(data, at*time.Hour)
	}
	rotated, changed := step(data, 64*time.Hour+time.Minute)
	bundle := parse(t, rotated[KeyCABundle])
	if !changed || bytes.Equal(rotated[KeyCACert], data[KeyCACert]) || len(bundle) != 2 {
		t.Fatalf("when a third of the CA's life remains then a new CA is made and the bundle holds both; bundle has %d", len(bundle))
	}
	if !bytes.Equal(rotated[KeyCert], data[KeyCert]) {
		t.Error("right after a CA renewal the serving certificate must stay, so the bundle is published first")
	}
	next, changed := step(rotated, 64*time.Hour+2*time.Minute)
	if !changed || parse(t, next[KeyCert])[0].CheckSignatureFrom(parse(t, next[KeyCACert])[0]) != nil {
		t.Error("one round after a CA renewal the serving certificate is signed by the new CA")
	}

	r.Hosts = []string{"other.sluice-system.svc"}
	moved, changed := step(next, 64*time.Hour+3*time.Minute)
	if !changed || parse(t, moved[KeyCert])[0].DNSNames[0] != "other.sluice-system.svc" {
		t.Error("when the hosts change then the certificate is made for the new hosts")
	}
}
