package redistest

import (
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"fmt"
	"math/big"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/sluice-dev/sluice/internal/test/poll"
	"github.com/sluice-dev/sluice/internal/test/tier"
)

// NewTLSServer starts a standalone Redis that accepts only TLS, with a self-signed certificate
// for 127.0.0.1 and the name "redis.test"; it is stopped when the test ends.
func NewTLSServer(t testing.TB) *Server {
	t.Helper()
	tier.Needs(t, "redis-server")
	t.Helper()
	s, err := start(false, func(s *Server) ([]string, error) {
		cert, key, err := selfSigned(s.dir)
		if err != nil {
			return nil, err
		}
		pool := x509.NewCertPool()
		pem, _ := os.ReadFile(cert)
		pool.AppendCertsFromPEM(pem)
		s.CAFile, s.TLS = cert, &tls.Config{RootCAs: pool, MinVersion: tls.VersionTLS12}
		args, err := standalone([]string{"--tls-port", strconv.Itoa(s.Port), "--tls-cert-file", cert,
			"--tls-key-file", key, "--tls-ca-cert-file", cert, "--tls-auth-clients", "no"})(s)
		args[1] = "0" // --port 0: no plain TCP
		return args, err
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}

// selfSigned writes a self-signed certificate and its key into dir.
func selfSigned(dir string) (certFile, keyFile string, err error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return "", "", err
	}
	tmpl := &x509.Certificate{
		SerialNumber:          big.NewInt(1),
		Subject:               pkix.Name{CommonName: "redis.test"},
		DNSNames:              []string{"redis.test"},
		IPAddresses:           []net.IP{net.IPv4(127, 0, 0, 1)},
		NotBefore:             time.Now().Add(-time.Hour),
		NotAfter:              time.Now().Add(24 * time.Hour),
		KeyUsage:              x509.KeyUsageDigitalSignature | x509.KeyUsageCertSign,
		ExtKeyUsage:           []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, tmpl, &key.PublicKey, key)
	if err != nil {
		return "", "", err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return "", "", err
	}
	certFile, keyFile = filepath.Join(dir, "redis.crt"), filepath.Join(dir, "redis.key")
	if err := os.WriteFile(certFile, pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}), 0o600); err != nil {
		return "", "", err
	}
	return certFile, keyFile, os.WriteFile(keyFile, pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), 0o600)
}

// SentinelMaster is the master set name that NewSentinel watches.
const SentinelMaster = "sluice-master"

// NewReplica starts a replica of master and waits until it has synchronised; it is stopped when
// the test ends.
func NewReplica(t testing.TB, master *Server) *Server {
	t.Helper()
	tier.Needs(t, "redis-server")
	t.Helper()
	s, err := start(false, standalone([]string{"--replicaof", "127.0.0.1", strconv.Itoa(master.Port)}))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	c := s.Client(t)
	poll.WaitFor(t, 10*time.Second, func() error {
		info, err := c.Info(context.Background(), "replication").Result()
		if err == nil && !strings.Contains(info, "master_link_status:up") {
			err = fmt.Errorf("replica of %s not in sync: %s", master.Addr(), info)
		}
		return err
	})
	return s
}

// NewSentinel starts a Redis Sentinel that watches master as SentinelMaster, with a quorum of
// one, and waits until it knows the master's address; it is stopped when the test ends. It holds
// a master that does not answer for a second to be down, and then fails over to a replica.
func NewSentinel(t testing.TB, master *Server) *Server {
	t.Helper()
	tier.Needs(t, "redis-server")
	t.Helper()
	s, err := start(false, func(s *Server) ([]string, error) {
		conf := filepath.Join(s.dir, "sentinel.conf")
		body := fmt.Sprintf("port %d\nbind 127.0.0.1\ndir %s\nlogfile %s\nsentinel monitor %s 127.0.0.1 %d 1\n"+
			"sentinel down-after-milliseconds %[4]s 1000\nsentinel failover-timeout %[4]s 10000\n",
			s.Port, s.dir, filepath.Join(s.dir, "redis.log"), SentinelMaster, master.Port)
		return []string{conf, "--sentinel"}, os.WriteFile(conf, []byte(body), 0o600)
	})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(s.Stop)
	return s
}
