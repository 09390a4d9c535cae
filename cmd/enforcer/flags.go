package main

import (
	"errors"
	"flag"
	"fmt"
	"log/slog"
	"strings"

	"github.com/sluice-dev/sluice/cmd/internal/flagrules"
)

// errVersion asks main to print the version and exit 0.
var errVersion = errors.New("version asked")

// flagRules are the combinations of flags that cannot work: each says why a command line is
// refused, naming its flags, or "" when it is not. parse refuses a command line with every
// reason (main exits 2) before anything starts, so that no flag is ever ignored silently. A new
// flag that only works beside another joins with a rule here.
var flagRules = []flagrules.Rule{
	flagrules.NoArguments,
	func(c flagrules.Cmdline) string {
		if c.Given("listen") && c.Value("upstream") == "" {
			return "--listen needs --upstream: the proxy forwards to it and does not start without it"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		if c.Value("upstream") == "" && c.Value("check-listen") == "" && c.Value("rls-listen") == "" {
			return "nothing would decide requests: give --upstream (the proxy), --check-listen or --rls-listen"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		if stores := c.NonEmpty(redisStores...); len(stores) > 1 {
			return strings.Join(stores, " and ") + " exclude each other: give one Redis"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		if opts := c.GivenOf(redisOptions...); len(opts) > 0 && len(c.NonEmpty(redisStores...)) == 0 {
			verb := " need"
			if len(opts) == 1 {
				verb = " needs"
			}
			return strings.Join(opts, ", ") + verb + " a Redis (--redis-url, --redis-cluster or --redis-sentinel): without one the counters are in memory"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		if c.Value("redis-sentinel") != "" && c.Value("redis-master") == "" {
			return "--redis-sentinel needs --redis-master, the master set its sentinels watch"
		}
		if c.Given("redis-master") && c.Value("redis-sentinel") == "" {
			return "--redis-master names a Sentinel master set: it needs --redis-sentinel"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		if c.Given("kubeconfig") && c.Value("configmap") == "" && c.Value("pool") == "" {
			return "--kubeconfig is for --configmap or --pool, neither of which is given"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		if c.Value("pool") == "" {
			return ""
		}
		if others := c.NonEmpty("policy", "configmap", "upstream"); len(others) > 0 {
			return "--pool serves the pool's policies from their ConfigMaps, through the check API and the rate limit service: " +
				strings.Join(others, ", ") + " cannot go with it (a policy that needs the proxy runs its own enforcer)"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		if c.Value("pprof") == "true" && c.Value("admin-listen") == "" {
			return "--pprof serves on the admin address, which --admin-listen= disables"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		listeners := []string{"check-listen", "rls-listen", "admin-listen"}
		if c.Value("upstream") != "" {
			listeners = append([]string{"listen"}, listeners...)
		}
		by := map[string]string{}
		for _, name := range listeners {
			addr := c.Value(name)
			if addr == "" || strings.HasSuffix(addr, ":0") { // port 0: a port of the kernel's choice
				continue
			}
			if other, ok := by[addr]; ok {
				return fmt.Sprintf("--%s and --%s both listen on %s", other, name, addr)
			}
			by[addr] = name
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		if level := c.Value("log-level"); !known(logLevels, level) {
			return fmt.Sprintf("--log-level %q: want error, info or debug", level)
		}
		return ""
	},
}

// logLevels are the values of --log-level. logr's V(1), the level of per-request lines, is slog's
// -1: debug shows it, info does not.
var logLevels = map[string]slog.Level{"error": slog.LevelError, "info": slog.LevelInfo, "debug": slog.LevelDebug}

// redisStores are the flags that give a Redis, one of which the redisOptions need.
var redisStores = []string{"redis-url", "redis-cluster", "redis-sentinel"}

var redisOptions = []string{"redis-tls", "redis-ca-file", "redis-server-name", "redis-username-file", "redis-password-file", "redis-timeout"}

// checkFlags applies flagRules to a parsed command line.
func checkFlags(fs *flag.FlagSet) error { return flagrules.Check(fs, flagRules) }

func known[V any](m map[string]V, k string) bool {
	_, ok := m[k]
	return ok
}
