// Command enforcer is the Sluice data plane: a reverse proxy and a check API that decide every
// request against RateLimitPolicy rules. Flags and environment become an enforcer.Config; the
// rest is enforcer.Run.
//
//	enforcer --policy FILE.yaml --upstream http://HOST:PORT [--listen :8080] [--check-listen :8081]
//	         [--admin-listen :9090] [--redis-url redis://HOST:PORT/DB | --redis-cluster H:P,H:P,...
//	         | --redis-sentinel H:P,... --redis-master NAME] [--redis-tls --redis-ca-file FILE]
//	         [--configmap NAMESPACE/NAME]
//
// Without a Redis flag the enforcer keeps counters in memory, exact for one replica. Redis
// credentials come from files (--redis-username-file, --redis-password-file: a mounted Secret) or
// from REDIS_USERNAME and REDIS_PASSWORD, never from flags. Flags that cannot work together are
// refused with exit 2 (flags.go); --help and --version exit 0.
package main

import (
	"context"
	"crypto/tls"
	"crypto/x509"
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"net/url"
	"os"
	"os/signal"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"syscall"
	"time"

	"github.com/go-logr/logr"
	"github.com/redis/go-redis/v9"
	"k8s.io/client-go/rest"
	"k8s.io/client-go/tools/clientcmd"

	"github.com/sluice-dev/sluice/api/v1alpha1"
	"github.com/sluice-dev/sluice/cmd/internal/termination"
	"github.com/sluice-dev/sluice/enforcer"
	"github.com/sluice-dev/sluice/internal/buildinfo"
	"github.com/sluice-dev/sluice/internal/settings"
)

func main() {
	cfg, err := parse(os.Args[1:])
	switch {
	case errors.Is(err, flag.ErrHelp):
		os.Exit(0) // the flag package printed the usage
	case errors.Is(err, errVersion):
		fmt.Println("enforcer", buildinfo.Read())
		os.Exit(0)
	case err != nil:
		for _, line := range strings.Split(err.Error(), "\n") {
			fmt.Fprintln(os.Stderr, "enforcer:", line)
		}
		_ = termination.Write(termination.Path, err.Error())
		os.Exit(2)
	}
	log := cfg.Log
	// go-redis would print every failed dial of its pool; the enforcer reports the store's
	// failures itself, once per change, in its log, metrics and report.
	redis.SetLogger(quiet{})
	ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
	err = enforcer.Run(ctx, cfg)
	stop()
	if err != nil {
		log.Error(err, "Enforcer failed")
		_ = termination.Write(termination.Path, err.Error())
		os.Exit(1)
	}
}

// cmdline is what the flags say, before it becomes an enforcer.Config.
type cmdline struct {
	cfg                                   enforcer.Config
	upstream, redisURL, cluster, sentinel string
	master, caFile, serverName            string
	useTLS                                bool
	configMap, kubeconfig, pool           string
	usernameFile, passwordFile            string
	logLevel                              string
	showVersion                           bool
	upCA, upServerName, upCert, upKey     string
	clockOffset                           time.Duration
}

func parse(args []string) (enforcer.Config, error) {
	fs := flag.NewFlagSet("enforcer", flag.ContinueOnError)
	c := define(fs)
	if err := fs.Parse(args); err != nil {
		return c.cfg, err
	}
	if c.showVersion {
		return c.cfg, errVersion
	}
	if c.cfg.PolicyFile == "" && c.pool == "" {
		return c.cfg, errors.New("--policy is required (or --pool, for a replica of an EnforcerPool)")
	}
	if err := checkFlags(fs); err != nil {
		return c.cfg, err
	}
	c.cfg.Log = logr.FromSlogHandler(slog.NewJSONHandler(os.Stderr, &slog.HandlerOptions{Level: logLevels[c.logLevel]}))
	if c.clockOffset != 0 {
		c.cfg.Now = func() time.Time { return time.Now().Add(c.clockOffset) }
	}
	for _, step := range []func() error{c.positive, c.configMapSource, c.poolSource, c.upstreamURL, c.redisStore} {
		if err := step(); err != nil {
			return c.cfg, err
		}
	}
	return c.cfg, nil
}

// define defines the flags, each with its default from internal/settings where it has one.
func define(fs *flag.FlagSet) *cmdline {
	defaults := settings.Defaults()
	c := &cmdline{}
	// Settings without a flag of their own keep their defaults too.
	c.cfg.Enforcer = defaults
	fs.StringVar(&c.cfg.PolicyFile, "policy", "", "File of one or more RateLimitPolicy documents (required).")
	fs.StringVar(&c.upstream, "upstream", "", "URL that receives the requests that pass: http://HOST:PORT (HTTP/1.1), https://HOST:PORT (TLS; HTTP/2 when the upstream offers it by ALPN) or h2c://HOST:PORT (cleartext HTTP/2, as gRPC servers speak it).")
	fs.StringVar(&c.upCA, "upstream-ca-file", "", "PEM CA bundle that signs an https upstream's certificate; default the system roots.")
	fs.StringVar(&c.upServerName, "upstream-server-name", "", "Name to verify in an https upstream's certificate (and send as SNI); default the host of --upstream.")
	fs.StringVar(&c.upCert, "upstream-cert-file", "", "PEM client certificate to present to an https upstream; needs --upstream-key-file.")
	fs.StringVar(&c.upKey, "upstream-key-file", "", "PEM private key of --upstream-cert-file.")
	fs.DurationVar(&c.cfg.UpstreamConnectTimeout, "upstream-connect-timeout", defaults.UpstreamConnectTimeout, "Time to connect to the upstream, TLS handshake included; past it, 504.")
	fs.DurationVar(&c.cfg.UpstreamResponseHeaderTimeout, "upstream-response-header-timeout", defaults.UpstreamResponseHeaderTimeout, "Time the upstream has to start its response once the request is sent; past it, 504 (gRPC DEADLINE_EXCEEDED). A streamed response or upgraded connection that has begun, and a gRPC call (bounded by its own deadline), may last any time.")
	fs.DurationVar(&c.cfg.UpstreamIdleTimeout, "upstream-idle-timeout", defaults.UpstreamIdleTimeout, "How long an idle pooled upstream connection is kept; keep it below the upstream's keep-alive timeout (gunicorn 2s, Node and uvicorn 5s), so the upstream never closes one the proxy is about to use.")
	fs.StringVar(&c.cfg.Listen, "listen", ":"+strconv.Itoa(settings.ProxyPort), "Address of the reverse proxy.")
	fs.StringVar(&c.cfg.CheckListen, "check-listen", ":"+strconv.Itoa(settings.CheckPort), "Address of the check API for ingress forward-auth; empty disables it.")
	fs.StringVar(&c.cfg.RLSListen, "rls-listen", "", "Address of Envoy's rate limit service (gRPC, envoy.service.ratelimit.v3); empty, the default, disables it.")
	fs.StringVar(&c.cfg.AdminListen, "admin-listen", ":"+strconv.Itoa(settings.AdminPort), "Address of /metrics, /healthz and /readyz; empty disables it.")
	fs.StringVar(&c.redisURL, "redis-url", "", "Standalone Redis, redis://HOST:PORT/DB or rediss:// for TLS.")
	fs.StringVar(&c.cluster, "redis-cluster", "", "Redis Cluster seed nodes, HOST:PORT,HOST:PORT,...")
	fs.StringVar(&c.sentinel, "redis-sentinel", "", "Redis Sentinel addresses, HOST:PORT,...; needs --redis-master.")
	fs.StringVar(&c.master, "redis-master", "", "The master set name the sentinels watch.")
	fs.BoolVar(&c.useTLS, "redis-tls", false, "Connect to Redis with TLS (any mode).")
	fs.StringVar(&c.caFile, "redis-ca-file", "", "PEM CA bundle that signs the Redis certificates; default the system roots. Implies --redis-tls.")
	fs.StringVar(&c.serverName, "redis-server-name", "", "Name to verify in the Redis certificate; default the host of the address. Implies --redis-tls.")
	fs.StringVar(&c.usernameFile, "redis-username-file", "", "File holding the Redis username, read at every new connection; replaces REDIS_USERNAME.")
	fs.StringVar(&c.passwordFile, "redis-password-file", "", "File holding the Redis password, read at every new connection, so that a rotated mounted Secret takes effect without a restart; replaces REDIS_PASSWORD.")
	fs.DurationVar(&c.cfg.RedisTimeout, "redis-timeout", defaults.RedisTimeout, "Deadline of each Redis call; past it rules apply their failure mode.")
	fs.DurationVar(&c.cfg.ReloadInterval, "reload-interval", defaults.ReloadInterval, "How often the policy file is checked for changes.")
	fs.StringVar(&c.configMap, "configmap", "", "NAMESPACE/NAME of a ConfigMap to watch through the API server, whose key named as the --policy file holds the policy file; the file then serves at start and while the API server cannot be reached.")
	fs.StringVar(&c.pool, "pool", "", "NAMESPACE/NAME of an EnforcerPool: serve the policies of the ConfigMaps the manager writes into NAMESPACE labelled "+
		"ratelimit.sluice.dev/pool=NAME, each loaded apart, through the check API (/policies/<namespace>/<name>/...) and the rate limit service; "+
		"instead of --policy, and without the proxy.")
	fs.StringVar(&c.kubeconfig, "kubeconfig", "", "Kubeconfig for --configmap or --pool; default $KUBECONFIG, else the pod's service account.")
	fs.DurationVar(&c.cfg.ShutdownDelay, "shutdown-delay", defaults.ShutdownDelay, "How long to keep serving after SIGTERM, with /readyz failing, before the listeners close.")
	fs.DurationVar(&c.cfg.ShutdownTimeout, "shutdown-timeout", defaults.ShutdownTimeout, "How long in-flight requests may drain once the listeners close; longer rule maxWaits are cut short.")
	fs.IntVar(&c.cfg.MaxConns, "max-conns", defaults.MaxConns, "Open connections the proxy, the check API and the rate limit service hold together; one more is answered 503 and closed. The admin port has its own bounds (256, 64 per address).")
	fs.IntVar(&c.cfg.MaxConnsPerClient, "max-conns-per-client", defaults.MaxConnsPerClient, "Open connections of the proxy, the check API and the rate limit service from one address (behind an ingress, one ingress pod); one more is answered 429 and closed.")
	fs.DurationVar(&c.cfg.ReadTimeout, "read-timeout", defaults.ReadTimeout, "Time a client has to send a request's header block; past it, 408.")
	fs.DurationVar(&c.cfg.WriteTimeout, "write-timeout", defaults.WriteTimeout, "Time a connection's writes may make no progress (a client that stops reading) before it is closed; a response that keeps flowing may last any time.")
	fs.DurationVar(&c.cfg.IdleTimeout, "idle-timeout", defaults.IdleTimeout, "Time a connection may carry no request (HTTP/2 and gRPC: no stream) before it is closed, on every listener.")
	fs.BoolVar(&c.cfg.Pprof, "pprof", false, "Serve Go's profiles under /debug/pprof/ on the admin address.")
	fs.StringVar(&c.logLevel, "log-level", "info", "Least level logged: error, info, or debug, which adds every refusal and every failed upstream request (one line each: for finding a problem, not for production traffic).")
	fs.BoolVar(&c.showVersion, "version", false, "Print the version, commit and Go version, and exit.")
	// For tests only, and so not in --help: shift the enforcer's own clock, to show that
	// decisions on Redis use Redis TIME whatever the pod's clock says.
	fs.DurationVar(&c.clockOffset, testClockOffset, 0, "")
	fs.Usage = func() {
		_, _ = fmt.Fprintln(fs.Output(), "Usage of enforcer:")
		fs.VisitAll(func(f *flag.Flag) {
			if f.Name != testClockOffset {
				_, _ = fmt.Fprintf(fs.Output(), "  --%s\n    \t%s (default %q)\n", f.Name, f.Usage, f.DefValue)
			}
		})
	}
	return c
}

// positive refuses a connection bound or timeout of zero, which would refuse every connection
// or cut every response.
func (c *cmdline) positive() error {
	cfg := &c.cfg
	for name, v := range map[string]int64{"--max-conns": int64(cfg.MaxConns), "--max-conns-per-client": int64(cfg.MaxConnsPerClient),
		"--read-timeout": int64(cfg.ReadTimeout), "--write-timeout": int64(cfg.WriteTimeout), "--idle-timeout": int64(cfg.IdleTimeout),
		"--upstream-connect-timeout": int64(cfg.UpstreamConnectTimeout), "--upstream-response-header-timeout": int64(cfg.UpstreamResponseHeaderTimeout),
		"--upstream-idle-timeout": int64(cfg.UpstreamIdleTimeout)} {
		if v <= 0 {
			return fmt.Errorf("%s must be positive", name)
		}
	}
	return nil
}

func (c *cmdline) configMapSource() error {
	if c.configMap == "" {
		return nil
	}
	ns, name, ok := strings.Cut(c.configMap, "/")
	if !ok || ns == "" || name == "" {
		return fmt.Errorf("--configmap %q: want NAMESPACE/NAME", c.configMap)
	}
	kube, err := c.kube("--configmap")
	if err != nil {
		return err
	}
	c.cfg.ConfigMap = &enforcer.ConfigMapSource{Namespace: ns, Name: name, Key: filepath.Base(c.cfg.PolicyFile), Kube: kube}
	return nil
}

// poolSource is the pool the enforcer serves a replica of, if any.
func (c *cmdline) poolSource() error {
	if c.pool == "" {
		return nil
	}
	ns, name, ok := strings.Cut(c.pool, "/")
	if !ok || ns == "" || name == "" || strings.Contains(name, "/") {
		return fmt.Errorf("--pool %q: want NAMESPACE/NAME", c.pool)
	}
	kube, err := c.kube("--pool")
	if err != nil {
		return err
	}
	c.cfg.Pool = &enforcer.PoolSource{Namespace: ns, Name: name, Kube: kube}
	return nil
}

// kube is the API server's client config: --kubeconfig, $KUBECONFIG, or the pod's service
// account.
func (c *cmdline) kube(flag string) (*rest.Config, error) {
	kubeconfig := c.kubeconfig
	if kubeconfig == "" {
		kubeconfig = os.Getenv("KUBECONFIG")
	}
	kube, err := clientcmd.BuildConfigFromFlags("", kubeconfig)
	if err != nil {
		return nil, fmt.Errorf("%s: reach the API server: %w", flag, err)
	}
	kube.UserAgent = "sluice-enforcer"
	return kube, nil
}

// withoutUserinfo is a URL as given, with what stands between its scheme and an @ before its path
// (a user and password) replaced by "xxxxx", for an error that tells which URL is wrong: it
// ends up in logs and in the pod's status (its termination message).
func withoutUserinfo(raw string) string {
	scheme, rest, ok := strings.Cut(raw, "://")
	if !ok {
		return raw
	}
	authority := rest
	if i := strings.IndexAny(rest, "/?#"); i >= 0 {
		authority = rest[:i]
	}
	at := strings.LastIndex(authority, "@")
	if at < 0 {
		return raw
	}
	return scheme + "://xxxxx" + rest[at:]
}

func (c *cmdline) upstreamURL() error {
	if c.upstream != "" {
		u, err := url.Parse(c.upstream)
		if err != nil || u.Host == "" || !slices.Contains(enforcer.UpstreamSchemes, u.Scheme) {
			return fmt.Errorf("--upstream %q: want a URL such as http://127.0.0.1:3000, https://api:8443 or h2c://grpc:50051", withoutUserinfo(c.upstream))
		}
		c.cfg.Upstream = u
	}
	if c.upCA == "" && c.upServerName == "" && c.upCert == "" && c.upKey == "" {
		return nil
	}
	if c.cfg.Upstream == nil || c.cfg.Upstream.Scheme != "https" {
		return errors.New("--upstream-ca-file, --upstream-server-name, --upstream-cert-file and --upstream-key-file need an https --upstream")
	}
	t, err := upstreamTLS(c.upCA, c.upServerName, c.upCert, c.upKey)
	c.cfg.UpstreamTLS = t
	return err
}

// redisStore is the Redis the flags name, if any: otherwise the memory store.
func (c *cmdline) redisStore() error {
	set := 0
	for _, v := range []string{c.redisURL, c.cluster, c.sentinel} {
		if v != "" {
			set++
		}
	}
	if set > 1 {
		return errors.New("--redis-url, --redis-cluster and --redis-sentinel exclude each other")
	}
	opts := enforcer.RedisOptions{Timeout: c.cfg.RedisTimeout, Username: os.Getenv("REDIS_USERNAME"), Password: os.Getenv("REDIS_PASSWORD")}
	if c.usernameFile != "" || c.passwordFile != "" {
		username, password, usernameFile, passwordFile := opts.Username, opts.Password, c.usernameFile, c.passwordFile
		opts.Credentials = func() (string, string) {
			return fileOr(usernameFile, username), fileOr(passwordFile, password)
		}
	}
	switch {
	case c.redisURL != "":
		u, err := redis.ParseURL(c.redisURL)
		if err != nil {
			// The parser's error quotes the URL, password and all; the reason alone is told.
			var uerr *url.Error
			if errors.As(err, &uerr) {
				err = uerr.Err
			}
			return fmt.Errorf("--redis-url %s: %w", withoutUserinfo(c.redisURL), err)
		}
		opts.Mode, opts.Addrs, opts.DB, opts.TLS = v1alpha1.RedisStandalone, []string{u.Addr}, u.DB, u.TLSConfig
		if u.Username != "" || u.Password != "" {
			opts.Username, opts.Password = u.Username, u.Password
		}
	case c.cluster != "":
		opts.Mode, opts.Addrs = v1alpha1.RedisCluster, strings.Split(c.cluster, ",")
	case c.sentinel != "":
		if c.master == "" {
			return errors.New("--redis-sentinel needs --redis-master")
		}
		opts.Mode, opts.Addrs, opts.MasterName = v1alpha1.RedisSentinel, strings.Split(c.sentinel, ","), c.master
	default:
		return nil // memory store
	}
	if c.useTLS || c.caFile != "" || c.serverName != "" {
		tlsConfig, err := redisTLS(c.caFile, c.serverName)
		if err != nil {
			return err
		}
		opts.TLS = tlsConfig
	}
	c.cfg.Redis = &opts
	return nil
}

// quiet discards go-redis's own log lines.
type quiet struct{}

func (quiet) Printf(context.Context, string, ...any) {}

// fileOr is the content of path, without a trailing newline, or fallback when path is empty. A
// file that cannot be read gives an empty credential, which Redis refuses in its own words.
func fileOr(path, fallback string) string {
	if path == "" {
		return fallback
	}
	data, _ := os.ReadFile(path)
	return strings.TrimRight(string(data), "\r\n")
}

// testClockOffset is the hidden flag that shifts the enforcer's clock in tests.
const testClockOffset = "test-clock-offset"

func redisTLS(caFile, serverName string) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("--redis-ca-file: %w", err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--redis-ca-file %s: no PEM certificate found", caFile)
		}
	}
	return c, nil
}

// upstreamTLS is the client TLS configuration of an https upstream.
func upstreamTLS(caFile, serverName, certFile, keyFile string) (*tls.Config, error) {
	c := &tls.Config{MinVersion: tls.VersionTLS12, ServerName: serverName}
	if caFile != "" {
		pem, err := os.ReadFile(caFile)
		if err != nil {
			return nil, fmt.Errorf("--upstream-ca-file: %w", err)
		}
		c.RootCAs = x509.NewCertPool()
		if !c.RootCAs.AppendCertsFromPEM(pem) {
			return nil, fmt.Errorf("--upstream-ca-file %s: no PEM certificate found", caFile)
		}
	}
	if (certFile == "") != (keyFile == "") {
		return nil, errors.New("--upstream-cert-file and --upstream-key-file go together")
	}
	if certFile != "" {
		cert, err := tls.LoadX509KeyPair(certFile, keyFile)
		if err != nil {
			return nil, fmt.Errorf("--upstream-cert-file, --upstream-key-file: %w", err)
		}
		c.Certificates = []tls.Certificate{cert}
	}
	return c, nil
}
