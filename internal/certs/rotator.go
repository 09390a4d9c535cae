// Package certs gives the webhook server a certificate on clusters without cert-manager: a
// self-signed CA and a serving certificate kept in one Secret, renewed before they expire, served
// from memory, and trusted through the caBundle of the webhook configurations.
//
// open-policy-agent/cert-controller does the same for Gatekeeper, but it hands the certificate to
// the server through the kubelet's projection of the Secret into the pod. `make demo` runs the
// manager with no kubelet, so this package serves the certificate itself and needs no volume.
package certs

import (
	"bytes"
	"context"
	"crypto/ecdsa"
	"crypto/elliptic"
	"crypto/rand"
	"crypto/tls"
	"crypto/x509"
	"crypto/x509/pkix"
	"encoding/pem"
	"errors"
	"fmt"
	"math/big"
	"net"
	"net/http"
	"slices"
	"sync/atomic"
	"time"

	admissionregistrationv1 "k8s.io/api/admissionregistration/v1"
	corev1 "k8s.io/api/core/v1"
	apierrors "k8s.io/apimachinery/pkg/api/errors"
	"k8s.io/apimachinery/pkg/types"
	"k8s.io/utils/clock"
	"sigs.k8s.io/controller-runtime/pkg/client"
	logf "sigs.k8s.io/controller-runtime/pkg/log"
)

// Keys of the Secret. tls.crt and tls.key make it a kubernetes.io/tls Secret; ca.crt is the
// bundle the API server trusts, which holds the previous CA for as long as it is still valid.
const (
	KeyCert     = corev1.TLSCertKey
	KeyKey      = corev1.TLSPrivateKeyKey
	KeyCABundle = "ca.crt"
	KeyCAKey    = "ca.key"
	KeyCACert   = "ca-current.crt"
)

// backdate makes a new certificate valid a little before it was made, for clocks that lag.
const backdate = 5 * time.Minute

// The Secret lives in the manager's namespace; only the two configurations of config/default are
// touched.
// +kubebuilder:rbac:groups="",namespace=system,resources=secrets,verbs=get;create;update
// +kubebuilder:rbac:groups=admissionregistration.k8s.io,resources=validatingwebhookconfigurations,resourceNames=sluice-validating-webhook-configuration,verbs=get;update

// Rotator keeps the webhook certificate. It is a manager.Runnable that runs on every replica:
// replicas share the Secret and resolve races by its resourceVersion.
type Rotator struct {
	// Client reads and writes without a cache: the manager watches no Secrets.
	Client client.Client
	// Secret holds the CA and the serving certificate.
	Secret types.NamespacedName
	// Hosts are the DNS names and IP addresses the API server dials, such as
	// <service>.<namespace>.svc or 127.0.0.1. The first is the certificate's common name.
	Hosts []string
	// MutatingWebhooks and ValidatingWebhooks name the configurations whose caBundle is kept.
	MutatingWebhooks, ValidatingWebhooks []string
	// CAValidity and CertValidity are the lifetimes of new certificates; each is renewed when a
	// third of its lifetime remains. Defaults: 10 years and 90 days.
	CAValidity, CertValidity time.Duration
	// Interval is how often the Secret and the configurations are checked. Default: 1 minute.
	Interval time.Duration
	// Clock decides when certificates are due and paces Start. Default the real clock.
	Clock clock.Clock

	current atomic.Pointer[tls.Certificate]
}

// GetCertificate serves the current certificate; use it as tls.Config.GetCertificate.
func (r *Rotator) GetCertificate(*tls.ClientHelloInfo) (*tls.Certificate, error) {
	if c := r.current.Load(); c != nil {
		return c, nil
	}
	return nil, errors.New("the webhook certificate is not ready yet")
}

// Ready is a readiness check: the server has a certificate.
func (r *Rotator) Ready(*http.Request) error {
	_, err := r.GetCertificate(nil)
	return err
}

// NeedLeaderElection is false: every replica serves the webhook, so every replica needs the
// certificate.
func (r *Rotator) NeedLeaderElection() bool { return false }

// Start syncs at once and then every Interval until ctx ends. A failed sync is logged and
// retried within seconds (the webhook configurations may not exist yet when the manager starts);
// the previous certificate keeps being served.
func (r *Rotator) Start(ctx context.Context) error {
	log := logf.FromContext(ctx).WithName("certs")
	interval := r.Interval
	if interval <= 0 {
		interval = time.Minute
	}
	for {
		wait := interval
		if err := r.Sync(ctx); err != nil {
			log.Error(err, "Unable to sync the webhook certificate")
			wait = min(interval, retryAfterError)
		}
		select {
		case <-ctx.Done():
			return nil
		case <-r.clock().After(wait):
		}
	}
}

func (r *Rotator) clock() clock.Clock {
	if r.Clock == nil {
		return clock.RealClock{}
	}
	return r.Clock
}

// retryAfterError is how soon a failed sync is tried again.
const retryAfterError = 2 * time.Second

// Sync makes the Secret hold a CA and a serving certificate that are not due for renewal, serves
// that certificate, and puts the CA bundle into the webhook configurations.
func (r *Rotator) Sync(ctx context.Context) error {
	secret, err := r.ensureSecret(ctx, r.clock().Now())
	if err != nil {
		return err
	}
	cert, err := tls.X509KeyPair(secret.Data[KeyCert], secret.Data[KeyKey])
	if err != nil {
		return fmt.Errorf("load the certificate of secret %s: %w", r.Secret, err)
	}
	// The bundle goes out before the certificate it vouches for is served: until every
	// configuration holds it, the API server would refuse a certificate of a new CA, so the
	// previous certificate, which it trusts, is served on and the sync is tried again.
	if err := r.injectCABundle(ctx, secret.Data[KeyCABundle]); err != nil {
		return err
	}
	r.current.Store(&cert)
	return nil
}

// ensureSecret renews what is due and writes the Secret. A conflict with another replica is
// resolved by starting over from the Secret it wrote.
func (r *Rotator) ensureSecret(ctx context.Context, now time.Time) (*corev1.Secret, error) {
	for attempt := 0; ; attempt++ {
		secret := &corev1.Secret{}
		err := r.Client.Get(ctx, r.Secret, secret)
		exists := err == nil
		if err != nil && !apierrors.IsNotFound(err) {
			return nil, fmt.Errorf("get secret %s: %w", r.Secret, err)
		}
		if !exists {
			secret.Name, secret.Namespace, secret.Type = r.Secret.Name, r.Secret.Namespace, corev1.SecretTypeTLS
		}
		data, changed, err := r.renew(secret.Data, now)
		if err != nil || !changed {
			return secret, err
		}
		secret.Data = data
		if exists {
			err = r.Client.Update(ctx, secret)
		} else {
			err = r.Client.Create(ctx, secret)
		}
		if (apierrors.IsConflict(err) || apierrors.IsAlreadyExists(err)) && attempt < 3 {
			continue
		}
		if err != nil {
			return nil, fmt.Errorf("write secret %s: %w", r.Secret, err)
		}
		return secret, nil
	}
}

// renew returns the Secret data with the CA and the serving certificate renewed where due.
func (r *Rotator) renew(old map[string][]byte, now time.Time) (map[string][]byte, bool, error) {
	caValidity, certValidity := r.CAValidity, r.CertValidity
	if caValidity <= 0 {
		caValidity = 10 * 365 * 24 * time.Hour
	}
	if certValidity <= 0 {
		certValidity = 90 * 24 * time.Hour
	}
	data := map[string][]byte{}
	for k, v := range old {
		data[k] = v
	}
	ca, caKey, caErr := parsePair(data[KeyCACert], data[KeyCAKey])
	previous := ca
	changed := false
	if caErr != nil || due(ca, now, caValidity) {
		var caPEM, keyPEM []byte
		var err error
		ca, caKey, caPEM, keyPEM, err = newCA(now, caValidity)
		if err != nil {
			return nil, false, err
		}
		// Trust the new CA and, until it expires, the previous one: servers that still present a
		// certificate it signed keep working while they catch up.
		bundle := caPEM
		if caErr == nil && now.Before(previous.NotAfter) {
			bundle = slices.Concat(caPEM, data[KeyCACert])
		}
		data[KeyCACert], data[KeyCAKey], data[KeyCABundle] = caPEM, keyPEM, bundle
		changed = true
	}
	if r.certDue(data, ca, previous, changed && caErr == nil, now, certValidity) {
		certPEM, keyPEM, err := newServingCert(now, certValidity, ca, caKey, r.Hosts)
		if err != nil {
			return nil, false, err
		}
		data[KeyCert], data[KeyKey] = certPEM, keyPEM
		changed = true
	}
	return data, changed, nil
}

// certDue reports whether the serving certificate must be made anew: it is missing, due, for other
// hosts, or signed by a CA that is not trusted. Right after a CA renewal (overlap), a certificate
// of the previous CA is kept for one more round, so that the API server trusts the new CA before
// it is shown a certificate the new CA signed.
func (r *Rotator) certDue(data map[string][]byte, ca, previous *x509.Certificate, overlap bool, now time.Time, validity time.Duration) bool {
	cert, _, err := parsePair(data[KeyCert], data[KeyKey])
	if err != nil || due(cert, now, validity) || !sameHosts(cert, r.Hosts) {
		return true
	}
	if overlap && cert.CheckSignatureFrom(previous) == nil {
		return false
	}
	return cert.CheckSignatureFrom(ca) != nil
}

// due reports whether a certificate has less than a third of its lifetime left.
func due(c *x509.Certificate, now time.Time, validity time.Duration) bool {
	return now.After(c.NotAfter.Add(-validity / 3))
}

func (r *Rotator) injectCABundle(ctx context.Context, bundle []byte) error {
	var errs []error
	for _, name := range r.MutatingWebhooks {
		cfg := &admissionregistrationv1.MutatingWebhookConfiguration{}
		errs = append(errs, r.inject(ctx, name, cfg, func() bool {
			changed := false
			for i := range cfg.Webhooks {
				changed = setBundle(&cfg.Webhooks[i].ClientConfig, bundle) || changed
			}
			return changed
		}))
	}
	for _, name := range r.ValidatingWebhooks {
		cfg := &admissionregistrationv1.ValidatingWebhookConfiguration{}
		errs = append(errs, r.inject(ctx, name, cfg, func() bool {
			changed := false
			for i := range cfg.Webhooks {
				changed = setBundle(&cfg.Webhooks[i].ClientConfig, bundle) || changed
			}
			return changed
		}))
	}
	return errors.Join(errs...)
}

func (r *Rotator) inject(ctx context.Context, name string, cfg client.Object, set func() bool) error {
	if err := r.Client.Get(ctx, types.NamespacedName{Name: name}, cfg); err != nil {
		return fmt.Errorf("get webhook configuration %s: %w", name, err)
	}
	if !set() {
		return nil
	}
	if err := r.Client.Update(ctx, cfg); err != nil {
		return fmt.Errorf("update the caBundle of webhook configuration %s: %w", name, err)
	}
	return nil
}

func setBundle(c *admissionregistrationv1.WebhookClientConfig, bundle []byte) bool {
	if bytes.Equal(c.CABundle, bundle) {
		return false
	}
	c.CABundle = bundle
	return true
}

func parsePair(certPEM, keyPEM []byte) (*x509.Certificate, *ecdsa.PrivateKey, error) {
	b, _ := pem.Decode(certPEM)
	if b == nil {
		return nil, nil, errors.New("no certificate")
	}
	cert, err := x509.ParseCertificate(b.Bytes)
	if err != nil {
		return nil, nil, err
	}
	k, _ := pem.Decode(keyPEM)
	if k == nil {
		return nil, nil, errors.New("no key")
	}
	key, err := x509.ParseECPrivateKey(k.Bytes)
	if err != nil {
		return nil, nil, err
	}
	if !key.PublicKey.Equal(cert.PublicKey) {
		return nil, nil, errors.New("the key does not match the certificate")
	}
	return cert, key, nil
}

func newCA(now time.Time, validity time.Duration) (*x509.Certificate, *ecdsa.PrivateKey, []byte, []byte, error) {
	tmpl := &x509.Certificate{
		Subject:               pkix.Name{CommonName: fmt.Sprintf("sluice-webhook-ca@%d", now.Unix()), Organization: []string{"Sluice"}},
		NotBefore:             now.Add(-backdate),
		NotAfter:              now.Add(validity),
		KeyUsage:              x509.KeyUsageCertSign | x509.KeyUsageDigitalSignature,
		BasicConstraintsValid: true,
		IsCA:                  true,
	}
	certPEM, keyPEM, key, err := sign(tmpl, nil, nil)
	if err != nil {
		return nil, nil, nil, nil, fmt.Errorf("create the webhook CA: %w", err)
	}
	ca, _, err := parsePair(certPEM, keyPEM)
	return ca, key, certPEM, keyPEM, err
}

// sameHosts reports whether a certificate names exactly hosts, in any order.
func sameHosts(c *x509.Certificate, hosts []string) bool {
	have := slices.Clone(c.DNSNames)
	for _, ip := range c.IPAddresses {
		have = append(have, ip.String())
	}
	slices.Sort(have)
	return slices.Equal(have, slices.Sorted(slices.Values(hosts)))
}

func newServingCert(now time.Time, validity time.Duration, ca *x509.Certificate, caKey *ecdsa.PrivateKey, hosts []string) ([]byte, []byte, error) {
	if len(hosts) == 0 {
		return nil, nil, errors.New("create the webhook serving certificate: no hosts")
	}
	tmpl := &x509.Certificate{
		Subject:     pkix.Name{CommonName: hosts[0]},
		NotBefore:   now.Add(-backdate),
		NotAfter:    now.Add(validity),
		KeyUsage:    x509.KeyUsageDigitalSignature,
		ExtKeyUsage: []x509.ExtKeyUsage{x509.ExtKeyUsageServerAuth},
	}
	for _, h := range hosts {
		if ip := net.ParseIP(h); ip != nil {
			tmpl.IPAddresses = append(tmpl.IPAddresses, ip)
		} else {
			tmpl.DNSNames = append(tmpl.DNSNames, h)
		}
	}
	certPEM, keyPEM, _, err := sign(tmpl, ca, caKey)
	if err != nil {
		return nil, nil, fmt.Errorf("create the webhook serving certificate: %w", err)
	}
	return certPEM, keyPEM, nil
}

// sign makes a key and a certificate for tmpl, signed by parent, or self-signed when parent is nil.
func sign(tmpl, parent *x509.Certificate, parentKey *ecdsa.PrivateKey) ([]byte, []byte, *ecdsa.PrivateKey, error) {
	key, err := ecdsa.GenerateKey(elliptic.P256(), rand.Reader)
	if err != nil {
		return nil, nil, nil, err
	}
	serial, err := rand.Int(rand.Reader, new(big.Int).Lsh(big.NewInt(1), 128))
	if err != nil {
		return nil, nil, nil, err
	}
	tmpl.SerialNumber = serial
	if parent == nil {
		parent, parentKey = tmpl, key
	}
	der, err := x509.CreateCertificate(rand.Reader, tmpl, parent, &key.PublicKey, parentKey)
	if err != nil {
		return nil, nil, nil, err
	}
	keyDER, err := x509.MarshalECPrivateKey(key)
	if err != nil {
		return nil, nil, nil, err
	}
	return pem.EncodeToMemory(&pem.Block{Type: "CERTIFICATE", Bytes: der}),
		pem.EncodeToMemory(&pem.Block{Type: "EC PRIVATE KEY", Bytes: keyDER}), key, nil
}
