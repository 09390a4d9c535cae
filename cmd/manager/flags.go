package main

import (
	"flag"
	"fmt"
	"strings"
	"time"

	"github.com/sluice-dev/sluice/cmd/internal/flagrules"
)

// flagRules are the combinations of the manager's flags that cannot work, refused at start with
// exit 2 and every reason, naming the flags; a new flag that only works beside another joins with
// a rule here.
var flagRules = []flagrules.Rule{
	flagrules.NoArguments,
	func(c flagrules.Cmdline) string {
		if lease := c.GivenOf("leader-elect-lease-duration", "leader-elect-renew-deadline", "leader-elect-retry-period"); len(lease) > 0 && c.Value("leader-elect") != "true" {
			return strings.Join(lease, ", ") + " time leader election, which needs --leader-elect"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		// client-go's own bounds, which it would only check once the manager runs.
		lease, renew, retry := c.Get("leader-elect-lease-duration").(time.Duration), c.Get("leader-elect-renew-deadline").(time.Duration), c.Get("leader-elect-retry-period").(time.Duration)
		switch {
		case renew >= lease:
			return fmt.Sprintf("--leader-elect-renew-deadline %v must be shorter than --leader-elect-lease-duration %v", renew, lease)
		case float64(renew) <= 1.2*float64(retry):
			return fmt.Sprintf("--leader-elect-renew-deadline %v must be longer than 1.2 times --leader-elect-retry-period %v", renew, retry)
		case retry <= 0:
			return "--leader-elect-retry-period must be positive"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		builtIn := c.GivenOf("webhook-secret", "webhook-cert-hosts", "validating-webhook-configuration", "webhook-ca-validity", "webhook-cert-validity", "webhook-cert-check-interval")
		if len(builtIn) > 0 && c.Value("webhook-cert-dir") != "" {
			return strings.Join(builtIn, ", ") + " shape the built-in certificates, which --webhook-cert-dir replaces"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		var bad []string
		for _, name := range []string{"workers", "kube-api-burst"} {
			if c.Get(name).(int) < 1 {
				bad = append(bad, "--"+name)
			}
		}
		if c.Get("kube-api-qps").(float64) <= 0 {
			bad = append(bad, "--kube-api-qps")
		}
		for _, name := range []string{"report-interval", "webhook-ca-validity", "webhook-cert-validity", "webhook-cert-check-interval"} {
			if c.Get(name).(time.Duration) <= 0 {
				bad = append(bad, "--"+name)
			}
		}
		if len(bad) > 0 {
			return strings.Join(bad, ", ") + " must be positive"
		}
		return ""
	},
	func(c flagrules.Cmdline) string {
		if c.Get("redis-probe-interval").(time.Duration) < 0 {
			return "--redis-probe-interval must not be negative (0 disables the probe)"
		}
		return ""
	},
}

// checkFlags applies flagRules to the parsed command line.
func checkFlags(fs *flag.FlagSet) error { return flagrules.Check(fs, flagRules) }
