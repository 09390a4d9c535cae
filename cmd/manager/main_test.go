package main

import (
	"flag"
	"strings"
	"testing"

	"github.com/google/go-cmp/cmp"

	"github.com/sluice-dev/sluice/internal/render"
)

func TestNetworkPolicyFlags(t *testing.T) {
	long := strings.Repeat("a", 63)
	cases := []struct {
		name    string
		args    []string
		want    *render.NetworkPolicyDefaults
		wantErr string
	}{
		{"when no flag is given then every enforcer gets a NetworkPolicy admitting the manager's namespace", nil,
			&render.NetworkPolicyDefaults{ManagerNamespace: "sluice-system"}, ""},
		{"when disabled then none is rendered", []string{"--enforcer-network-policy=false", "--check-namespaces=Bad"}, nil, ""},
		{"when lists are given then they are split and trimmed", []string{"--monitoring-namespaces=monitoring, " + long, "--check-namespaces=traefik,", "--proxy-namespaces=edge"},
			&render.NetworkPolicyDefaults{ManagerNamespace: "sluice-system", MonitoringNamespaces: []string{"monitoring", long}, CheckNamespaces: []string{"traefik"}, ProxyNamespaces: []string{"edge"}}, ""},
		{"when a name is one past 63 characters then the flag is refused", []string{"--proxy-namespaces=" + long + "a"}, nil, "--proxy-namespaces"},
		{"when a name is not a DNS label then the flag is refused", []string{"--check-namespaces=Gateways"}, nil, "--check-namespaces"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			fs := flag.NewFlagSet("manager", flag.ContinueOnError)
			var f networkPolicyFlags
			f.bind(fs)
			if err := fs.Parse(c.args); err != nil {
				t.Fatal(err)
			}
			got, err := f.defaults("sluice-system")
			if c.wantErr != "" {
				if err == nil || !strings.Contains(err.Error(), c.wantErr) {
					t.Fatalf("error = %v, want one naming %s", err, c.wantErr)
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			if diff := cmp.Diff(c.want, got); diff != "" {
				t.Errorf("defaults (-want +got):\n%s", diff)
			}
		})
	}
}
